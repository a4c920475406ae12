"""The fleet's parts that need no Ray cluster: a sub-request that loses its replica mid-stream drops
that replica's partial samples and resubmits its prompts with their seeds; the pick of a replica;
the weight history a restarted replica replays; rows in the caller's numbering; the launcher's
message when there is no cluster; FleetConfig's checks, naming the field."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from rollout.errors import InvalidArgument
from trainer_client.fleet_requests import FleetRequest
from trainer_client.fleet_routing import Replica, WeightHistory, pick_replica, prompt_seed, to_caller_rows

pytest.importorskip("ray")  # the launcher and trainer_client.fleet import it
from trainer_client.fleet import FleetConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _pairs(table: pa.Table) -> list[tuple[int, int]]:
    return list(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist()))


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


def _row(replica: int, sample: int) -> pa.RecordBatch:
    columns = {"request_id": ["sub"], "prompt_index": pa.array([0], pa.int32()),
               "sample_index": pa.array([sample], pa.int32()), "replica": [replica],
               "policy_version": pa.array([0], pa.int64())}  # fmt: skip
    return pa.RecordBatch.from_pydict(columns)


class _FakeStream:
    """One sub-request's batches (one sample each); `fail` raises after the first, as a dying server."""

    def __init__(self, replica: int, n: int, fail: bool):
        self.batches = [_row(replica, s) for s in range(n)]
        self.fail = fail

    def __aiter__(self):
        return self

    async def __anext__(self) -> pa.RecordBatch:
        await asyncio.sleep(0)
        if self.fail and len(self.batches) < 3:
            raise _Unavailable()
        if not self.batches:
            raise StopAsyncIteration
        return self.batches.pop(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _FakeCore:
    """Two replicas; replica 0 dies under every sub-request after sending one sample."""

    def __init__(self):
        self.replicas = [Replica(i, None, f"fake:{i}", "x", 0) for i in range(2)]
        self.window, self.max_attempts = 100, 3
        self.calls: list[tuple[int, int, int]] = []  # (replica, prompt's first token, seed)
        self._change = None

    def client(self, replica: Replica):
        core = self

        class Client:
            def stream(self, prompts, n, sampling, mask, grammar, request_id, timeout, return_text):
                core.calls.append((replica.index, prompts[0][0], sampling["seed"]))
                return _FakeStream(replica.index, n, fail=replica.index == 0)

        return Client()

    async def alive(self, replica: Replica) -> bool:
        return replica.index != 0

    def replica_failed(self, replica: Replica) -> None:
        replica.state = "recovering"

    def routing_changed(self) -> asyncio.Future:
        if self._change is None or self._change.done():
            self._change = asyncio.get_running_loop().create_future()
        return self._change

    def notify(self) -> None:
        if self._change is not None and not self._change.done():
            self._change.set_result(None)


def test_dead_replicas_partial_samples_are_dropped_and_its_prompts_resubmitted():
    core, out = _FakeCore(), []
    request = FleetRequest(core, [[p] for p in range(4)], 3, dict(seed=9), None, None, "req", None, out.append)
    asyncio.run(request.run())
    table = pa.Table.from_batches(out).sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")])
    assert _pairs(table) == [(p, s) for p in range(4) for s in range(3)]
    assert set(table.column("replica").to_pylist()) == {1}
    assert core.replicas[0].lost_prompts == 2 and core.replicas[0].dropped_samples == 2
    seeds = {}
    for _, prompt, seed in core.calls:
        assert seeds.setdefault(prompt, seed) == seed == prompt_seed(9, prompt)  # a resubmission keeps its seed


def test_pick_replica_takes_least_outstanding_healthy_within_window():
    replicas = [Replica(i, None, f"h:{i}", "x", 0) for i in range(3)]
    replicas[0].outstanding, replicas[1].outstanding, replicas[2].outstanding = 8, 4, 0
    replicas[2].state = "recovering"
    assert pick_replica(replicas, n=4, window=16).index == 1
    assert pick_replica(replicas, n=4, window=7) is None
    replicas[1].outstanding = 0
    assert pick_replica(replicas, n=64, window=16).index == 1  # an idle replica takes any n


def test_weight_history_drops_updates_a_later_one_covers():
    history = WeightHistory()
    history.add("full-1", {"a", "b"})
    history.add("part", {"b"})
    assert history.payloads() == ["full-1", "part"]
    snapshot = history.snapshot()
    history.add("full-2", {"a", "b"})
    assert history.payloads() == ["full-2"]
    history.restore(snapshot)
    assert history.payloads() == ["full-1", "part"]


def test_caller_rows_and_prompt_seeds():
    """Rows and metadata in the caller's numbering: fleet policy versions, no one server's instance id."""
    table = pa.table({"request_id": ["sub/3/0"] * 2, "prompt_index": pa.array([0, 0], pa.int32()),
                      "policy_version": pa.array([1, 1], pa.int64())})  # fmt: skip
    table = table.replace_schema_metadata({"model": "m", "instance_id": "abc", "policy_version": "1"})
    out = to_caller_rows(table, "req", 7, version_offset=2)
    assert out.to_pydict() == {"request_id": ["req"] * 2, "prompt_index": [7, 7], "policy_version": [3, 3]}
    assert out.schema.equals(table.schema, check_metadata=False)
    assert out.schema.metadata == {b"model": b"m", b"policy_version": b"3"}
    seeds = {prompt_seed(5, p) for p in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds) and prompt_seed(5, 3) == prompt_seed(5, 3)


def test_launcher_without_a_cluster_says_what_to_do(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("launch_fleet", REPO / "deploy" / "launch_fleet.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)

    def no_cluster(**kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(launcher.ray, "init", no_cluster)
    assert launcher.main(["--replicas", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("launch_fleet: no Ray cluster at --address auto (Could not find any running Ray instance")
    assert "ray start --head" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "field, value",
    [("num_replicas", 0), ("device", "tpu"), ("max_attempts", 0), ("detached", True), ("broadcast_backend", "mpi")],
)
def test_fleet_config_names_the_bad_field(field, value):
    with pytest.raises(InvalidArgument, match=f"^{field}: must be"):
        FleetConfig(**{"num_replicas": 1, field: value})
