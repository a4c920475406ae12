"""RolloutFleet on a local Ray cluster (CPU, node address 127.0.0.1), two replicas of the embedded
tiny model: prompts spread over both replicas come back exactly once in the caller's order with
valid masks; chat prompts, stop strings and text work through it; a weight update reaches every
replica and changes greedy outputs (pushed through the object store, or broadcast from the trainer
in a gloo group), memory release and resume reach every replica; a replica killed mid-generation
loses no sample, is restarted with the current weights and serves again, and so is one whose
server process crashes; one whose engine is stopped leaves the routing until it runs again; each
replica is reported as it comes up; a replica that cannot start is reported with its own log (no
Ray stack dump); a replica stopped elsewhere is said so once; shutdown leaves no server process
behind. The routing bookkeeping, the launcher's message and the config's checks:
test_fleet_routing.py."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from rollout.masks.check import check_table
from trainer_client import RolloutClient
from trainer_client.client import to_table

ray = pytest.importorskip("ray")
from ray._private import ray_constants  # noqa: E402

from trainer_client.fleet import RolloutFleet, stop_actors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "rollout" / "assets" / "tiny-qwen3" / "model.safetensors"
SERVE_ARGS = ["--num-kv-blocks", "96", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
              "--liveness-seconds", "2"]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
PROBES = ["def main():\n", "import sys\n", "class A:\n"]


@pytest.fixture(scope="module")
def fleet():
    """A fresh local Ray cluster whose node address is 127.0.0.1 (Ray 2.x on Linux maps 127.0.0.1 to
    the machine's routable address unless told it runs without clusters), and a 2-replica fleet."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        _start_local_ray()
        recorder, level = _Recorder(), FLEET_LOG.level
        FLEET_LOG.addHandler(recorder)
        FLEET_LOG.setLevel(logging.INFO)
        fleet = RolloutFleet(2, SERVE_ARGS, health_interval=0.5, server_env={"OMP_NUM_THREADS": "1"})
        try:
            yield fleet
        finally:
            FLEET_LOG.removeHandler(recorder)
            FLEET_LOG.setLevel(level)
            fleet.shutdown()
            ray.shutdown()


STARTUP_TIMEOUTS = ("Timed out waiting for file", "timed out during startup")  # Ray's own messages


def _start_local_ray(attempts: int = 3) -> None:
    """ray.init of a local cluster on 127.0.0.1, tried again when its GCS or raylet does not come up
    in time (two fresh-clone CI runs in a row timed out so, once waiting for the GCS's port file and
    once for the raylet; the same tests passed alone right after, and so did a plain ray.init)."""
    for attempt in range(attempts):
        try:
            ray.init(address="local", num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
                     log_to_driver=False)
            return
        except Exception as exc:  # (RuntimeError for the GCS, a bare Exception for the raylet)
            ray.shutdown()
            if attempt + 1 == attempts or not any(m in str(exc) for m in STARTUP_TIMEOUTS):
                raise


FLEET_LOG = logging.getLogger("trainer_client.fleet")
FLEET_LINES: list[str] = []  # what the fleet logged while the fixture's fleet started


class _Recorder(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        FLEET_LINES.append(record.getMessage())


def _pairs(table: pa.Table) -> list[tuple[int, int]]:
    return list(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist()))


def _wait_for(predicate, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _perturbed(names_containing: str, scale: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.float() for k, v in load_file(ASSET).items() if names_containing in k}
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def test_each_replica_is_reported_as_it_comes_up(fleet):  # (first: no replica has restarted yet)
    up = [line for line in FLEET_LINES if " serving at " in line]
    assert len(up) == 2, FLEET_LINES
    for line in up:
        index, address = re.fullmatch(r"replica (\d) serving at (\S+) \(its server started in \d+\.\d s\)",
                                      line).groups()
        assert address == fleet.replica_stats()[int(index)]["address"]


def test_generate_spreads_prompts_and_keeps_caller_order(fleet):
    assert [a.split(":")[0] for a in fleet.addresses] == ["127.0.0.1", "127.0.0.1"]
    prompts = [f"def f{i}(x):\n" + " " * i for i in range(8)]
    sampling = dict(temperature=1.0, top_k=8, max_tokens=8, seed=5)
    before = [r["samples"] for r in fleet.replica_stats()]
    table = fleet.generate(prompts, n=3, sampling=sampling, mask="support", request_id="spread")
    assert _pairs(table) == [(p, s) for p in range(8) for s in range(3)]
    assert table.column("prompt_token_ids").to_pylist() == [list(p.encode()) for p in prompts for _ in range(3)]
    assert set(table.column("request_id").to_pylist()) == {"spread"}
    assert set(table.column("policy_version").to_pylist()) == {fleet.policy_version}
    assert table.column("support_logprobs").null_count == 0
    report = check_table(table, max_width=8)
    assert report.ok, report.violations[:3]
    served = [r["samples"] - b for r, b in zip(fleet.replica_stats(), before)]
    assert sum(served) == 24 and min(served) > 0

    batches = list(fleet.stream(prompts[:4], n=2, sampling=sampling, mask="selected"))
    assert sorted(b.column("prompt_index")[0].as_py() for b in batches) == [0, 1, 2, 3]
    assert all(b.num_rows == 2 and len(set(b.column("prompt_index").to_pylist())) == 1 for b in batches)


def test_chat_prompts_stop_strings_and_text_through_the_fleet(fleet):
    chat = [{"role": "user", "content": "def f(x):"}]
    free = fleet.generate(chat, sampling=GREEDY, return_text=True)
    expected = [259, *b"user\ndef f(x):", 260, *b"\n", 259, *b"assistant\n"]  # the embedded ChatML template
    assert free.column("prompt_token_ids").to_pylist() == [expected]
    text = free.column("text")[0].as_py()
    stop = text[2:4]  # greedy: the same text comes again, and stops at the first occurrence of this
    table = fleet.generate(chat, n=2, sampling=dict(GREEDY, stop=[stop]), return_text=True)
    kept = text[: text.index(stop) + len(stop)]
    assert table.column("text").to_pylist() == [kept, kept] and len(stop) == 2
    assert table.column("stop_reason").to_pylist() == [stop, stop]
    assert table.column("finish_reason").to_pylist() == ["stop", "stop"]


def test_weight_broadcast_reaches_every_replica(fleet):
    before = fleet.generate(PROBES, sampling=GREEDY)
    version = fleet.update_weights(_perturbed("", 0.2, seed=1))
    assert version == fleet.policy_version
    infos = fleet.server_info()
    assert len(infos) == 2 and len({info["policy_version"] for info in infos}) == 1
    after = fleet.generate(PROBES, sampling=GREEDY)
    assert set(after.column("policy_version").to_pylist()) == {version}
    assert after.column("token_ids").to_pylist() != before.column("token_ids").to_pylist()
    assert fleet.update_weights(ASSET) == version + 1  # a safetensors path: the original weights again
    restored = fleet.generate(PROBES, sampling=GREEDY)
    assert restored.column("token_ids").to_pylist() == before.column("token_ids").to_pylist()


def test_broadcast_update_and_memory_release_reach_every_replica_at_once(fleet):
    """update_weights(broadcast=True): the fleet (rank 0) and both servers in one gloo group; then
    release_memory / resume_memory on both."""
    before = fleet.generate(PROBES, sampling=GREEDY)
    version = fleet.update_weights(_perturbed("", 0.2, seed=3), broadcast=True)
    assert {info["policy_version"] for info in fleet.server_info()} == {version - r.offset for r in fleet.replicas}
    after = fleet.generate(PROBES, sampling=GREEDY)
    assert set(after.column("policy_version").to_pylist()) == {version}
    assert after.column("token_ids").to_pylist() != before.column("token_ids").to_pylist()
    with pytest.raises(grpc.RpcError) as err:  # refused on both: nothing changes
        fleet.update_weights({"model.norm.weight": torch.zeros(3)}, broadcast=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fleet.policy_version == version
    assert fleet.update_weights(ASSET, broadcast=True) == version + 1  # the same group again
    assert fleet.generate(PROBES, sampling=GREEDY).column("token_ids") == before.column("token_ids")
    states = fleet.release_memory(hold_requests=True)
    assert len(states) == 2 and all(s["released"] and s["bytes"] > 0 for s in states)
    assert all(info["memory_released"] for info in fleet.server_info())
    assert not any(s["released"] for s in fleet.resume_memory())
    assert fleet.generate(PROBES, sampling=GREEDY).column("token_ids") == before.column("token_ids")


def test_killed_replica_loses_no_sample_and_rejoins_with_current_weights(fleet):
    fleet.update_weights(_perturbed("model.norm", 0.3, seed=2))  # a partial update the restart must replay
    prompts = [[65 + i, 66, 67] for i in range(10)]
    sampling = dict(temperature=1.0, top_k=8, max_tokens=64, ignore_eos=True, seed=11)
    victim = fleet.replica_stats()[1]
    watcher = RolloutClient(victim["address"], timeout=30)
    stream = fleet.stream(prompts, n=2, sampling=sampling, request_id="survivor")
    _wait_for(lambda: (lambda i: i["kv_blocks_free"] < i["kv_blocks_total"])(watcher.server_info()))
    ray.kill(fleet.actors[victim["index"]], no_restart=False)  # its server is generating now
    table = to_table(list(stream))
    assert _pairs(table) == [(p, s) for p in range(10) for s in range(2)]
    assert all(len(t) == 64 for t in table.column("token_ids").to_pylist())
    assert set(table.column("policy_version").to_pylist()) == {fleet.policy_version}

    def back() -> bool:
        now = fleet.replica_stats()[victim["index"]]
        return now["state"] == "healthy" and now["incarnation"] != victim["incarnation"]

    _wait_for(back)
    revived = fleet.replica_stats()[victim["index"]]
    assert revived["restarts"] == victim["restarts"] + 1 and revived["lost_prompts"] > 0
    assert not _pid_alive(victim["server_pid"])
    greedy = [
        RolloutClient(address, timeout=60).generate(PROBES, sampling=GREEDY).column("token_ids").to_pylist()
        for address in fleet.addresses
    ]
    assert len(greedy) == 2 and greedy[0] == greedy[1]  # the restarted server has the fleet's weights
    again = fleet.generate(prompts, n=2, sampling=sampling)
    assert _pairs(again) == _pairs(table)
    assert set(again.column("policy_version").to_pylist()) == {fleet.policy_version}
    assert fleet.replica_stats()[victim["index"]]["samples_since_restart"] > 0


def test_a_stalled_replica_leaves_the_routing_until_its_engine_moves_again(fleet):
    """A replica whose engine process is stopped (SIGSTOP) while a request waits on it turns health
    NOT_SERVING (its liveness watchdog): the fleet routes around it, and takes it back, the same
    server, once the engine runs again (SIGCONT)."""
    _wait_for(lambda: all(r["state"] == "healthy" for r in fleet.replica_stats()))
    victim = fleet.replica_stats()[1]
    engine = _engine_process(victim["server_pid"])
    stuck = RolloutClient(victim["address"], timeout=120).stream([[1, 2, 3]], sampling=GREEDY, request_id="stuck")
    os.kill(engine, signal.SIGSTOP)
    try:
        _wait_for(lambda: fleet.replica_stats()[1]["state"] == "recovering", timeout=60)
        before = [r["samples"] for r in fleet.replica_stats()]
        table = fleet.generate(PROBES, n=2, sampling=GREEDY)
        assert _pairs(table) == [(p, s) for p in range(3) for s in range(2)]
        served = [r["samples"] - b for r, b in zip(fleet.replica_stats(), before)]
        assert served == [6, 0]
    finally:
        os.kill(engine, signal.SIGCONT)
    assert to_table(list(stuck)).num_rows == 1
    _wait_for(lambda: fleet.replica_stats()[1]["state"] == "healthy")
    back = fleet.replica_stats()[1]
    assert back["incarnation"] == victim["incarnation"] and back["restarts"] == victim["restarts"]


def _engine_process(server_pid: int) -> int:
    """The server's engine process: its child started by multiprocessing's spawn."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if parent == server_pid and b"spawn_main" in cmdline:
                return int(entry.name)
    raise AssertionError(f"no engine process under {server_pid}")


def test_crashed_server_takes_its_actor_down_and_comes_back(fleet):
    before = fleet.replica_stats()[0]
    ray.get(fleet.actors[0].kill_server.remote())
    _wait_for(lambda: fleet.replica_stats()[0]["incarnation"] != before["incarnation"])
    _wait_for(lambda: fleet.replica_stats()[0]["state"] == "healthy")
    table = fleet.generate(PROBES * 2, n=2, sampling=dict(temperature=1.0, top_k=8, max_tokens=6, seed=1))
    assert _pairs(table) == [(p, s) for p in range(6) for s in range(2)]
    assert fleet.replica_stats()[0]["samples_since_restart"] > 0


def test_replica_that_cannot_start_is_reported_with_its_log(fleet):
    with pytest.raises(RuntimeError) as err:
        RolloutFleet(1, ["--model", "/no-such-checkpoint"], startup_timeout=60)
    message = str(err.value)
    assert re.match(r"replica 0 did not start: rollout serve exited with status \d+; log tail:\n", message)
    assert "model directory '/no-such-checkpoint' does not exist" in message  # the server's own words
    assert "ray::" not in message and "Traceback" not in message and message.count("\n") < 20  # no Ray dump


def test_a_replica_stopped_elsewhere_is_reported_once(fleet, caplog):
    caplog.set_level(logging.INFO, logger="trainer_client.fleet")
    stop_actors([fleet.actors[1]])  # what `launch_fleet.py --stop` does, from anywhere
    _wait_for(lambda: fleet.replica_stats()[1]["state"] == "dead")
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer_client.fleet"]
    assert sum("was stopped elsewhere" in line for line in lines) == 1, lines
    assert not any("waiting for Ray" in line or "dead for good" in line for line in lines), lines
    table = fleet.generate(PROBES, n=2, sampling=dict(temperature=1.0, top_k=8, max_tokens=4, seed=2))
    assert _pairs(table) == [(p, s) for p in range(3) for s in range(2)]  # the other replica serves


def test_shutdown_leaves_no_server_behind(fleet):
    pids = [r["server_pid"] for r in fleet.replica_stats() if r["state"] == "healthy"]
    assert pids and all(_pid_alive(pid) for pid in pids)
    fleet.shutdown()
    _wait_for(lambda: not any(_pid_alive(pid) for pid in pids), timeout=30)
