"""The gRPC front end against a small fake engine defined here (the real engine's tests are in
test_server.py): streaming and flushing, the error mapping, cancellation freeing KV blocks,
Abort, weight-update plumbing, health and reflection, and the asyncio client. The fake obeys
the engine API (rollout.engine.engine.LLMEngine) with trivial arithmetic in place of a model."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import grpc
import pyarrow as pa
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from safetensors.torch import save_file

from rollout.engine.outputs import SampleOutput
from rollout.engine.params import validate_mask_request
from rollout.engine.weight_specs import WeightSpecs, tensor_specs
from rollout.engine.weight_stage import WeightStage
from rollout.errors import InvalidArgument, ResourceExhausted
from rollout.schema import MASK_TOP_K_KEY, ROLLOUT_SCHEMA
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.server.service import FlushPolicy
from trainer_client import AsyncRolloutClient, RolloutClient

VOCAB, EOS, MAX_LEN, TOTAL_BLOCKS, MAX_QUEUED = 264, 256, 64, 512, 300
FAIL_TOKEN = 13  # a logit_bias on this id makes the fake fail the sample (a "mask overflow")


class FakeEngine:
    """Each step appends one token to every running sample: token = f(prompt, sample, position,
    weights). One KV block per running sample. Weight updates wait for running samples to drain."""

    vocab_size, eos_token_ids, model_name, drafter_name, max_model_len = VOCAB, [EOS], "fake", "none", MAX_LEN

    def __init__(self, step_s: float = 0.002):
        self.tokenizer = SimpleNamespace(encode=lambda text: SimpleNamespace(ids=list(text.encode())))
        self.policy_version, self.params, self.weights = 0, {"w": torch.zeros(4, 4)}, FakeWeights(self)
        self.running: dict[tuple[str, int, int], dict] = {}
        self.step_s, self.thread = step_s, None

    def _check_thread(self) -> None:
        self.thread = self.thread or threading.get_ident()
        assert self.thread == threading.get_ident(), "engine called from two threads"

    def add_request(self, request_id, prompts, params, n=1, mask=None, grammar=None) -> None:
        self._check_thread()
        params.validate(VOCAB)
        validate_mask_request(mask, params, 8)
        if not prompts:
            raise InvalidArgument("prompts", "must not be empty")
        if n < 1:
            raise InvalidArgument("n", f"must be >= 1, got {n}")
        for i, prompt in enumerate(prompts):
            if not prompt or len(prompt) + params.max_tokens > MAX_LEN:
                raise InvalidArgument(f"prompts[{i}]", "empty or too long for the context")
            if any(not 0 <= t < VOCAB for t in prompt):
                raise InvalidArgument(f"prompts[{i}]", "token id outside the vocabulary")
        if grammar is not None and grammar.kind not in ("json_schema", "regex", "ebnf"):
            raise InvalidArgument("grammar", f"unknown kind {grammar.kind!r}")
        if len(self.running) + len(prompts) * n > MAX_QUEUED:
            raise ResourceExhausted("queue full")
        for p, prompt in enumerate(prompts):
            for s in range(n):
                self.running[(request_id, p, s)] = dict(
                    prompt=list(prompt), params=params, mask=mask, tokens=[]
                )

    def step(self) -> list[SampleOutput]:
        self._check_thread()
        time.sleep(self.step_s)
        if self.weights.pending is not None and not self.running:
            self.params.update(self.weights.pending)
            self.weights.pending, self.policy_version = None, self.policy_version + 1
        finished = []
        for key, st in list(self.running.items()):
            shift = int(self.params["w"].sum().item())
            st["tokens"].append((sum(st["prompt"]) + key[2] + len(st["tokens"]) + shift) % 200)
            if FAIL_TOKEN in st["params"].logit_bias or len(st["tokens"]) >= st["params"].max_tokens:
                finished.append(self._output(key, self.running.pop(key), "length"))
        return finished

    def _output(self, key, st, reason) -> SampleOutput:
        out = SampleOutput(key[0], key[1], key[2], st["prompt"], st["tokens"], [-0.5] * len(st["tokens"]))
        out.finish_reason, out.accept_lengths, out.policy_version = (
            reason,
            [1] * len(st["tokens"]),
            self.policy_version,
        )
        if st["mask"]:
            out.support_ids = [[t, t + 1] for t in st["tokens"]]
        if st["mask"] == "support":
            out.support_logprobs = [[math.log(0.6), math.log(0.4)] for _ in st["tokens"]]
        if FAIL_TOKEN in st["params"].logit_bias:
            out.error, out.finish_reason = "support wider than max_mask_tokens", "error"
        return out

    def abort(self, request_id) -> list[SampleOutput]:
        self._check_thread()
        keys = [k for k in self.running if k[0] == request_id]
        return [self._output(k, self.running.pop(k), "abort") for k in keys]

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def kv_blocks(self) -> tuple[int, int]:
        return TOTAL_BLOCKS - len(self.running), TOTAL_BLOCKS

    def info(self) -> dict:
        limits = dict(max_mask_tokens=8, max_queued_samples=MAX_QUEUED, max_model_len=MAX_LEN)
        return dict(model="fake", vocab_size=VOCAB, eos_token_ids=[EOS], spec_method="none", block_size=16,
                    limits=limits, policy_version=self.policy_version, kv=self.kv_blocks())  # fmt: skip

    def weight_update_pending(self) -> bool:
        return self.weights.pending is not None

    def compiled(self) -> dict[str, int]:
        return dict(graphs=0, kernels=0)


class FakeWeights:
    """The engine's weight-update interface (rollout.engine.weights.WeightUpdater) over a dict of
    tensors: staged and checked by the real WeightStage, applied by the fake's step."""

    def __init__(self, engine: FakeEngine):
        self.engine, self.pending, self.pause_seconds = engine, None, 0.0

    def specs(self) -> WeightSpecs:
        return WeightSpecs(tensor_specs(self.engine.params))

    def new_stage(self, nbytes: int) -> WeightStage:
        return WeightStage(torch.device("cpu"), True, lambda draft, key: self.engine.params[key])

    def submit(self, stage: WeightStage, token: str = "", update_id: str = "") -> None:
        self.engine._check_thread()
        self.pending = {key: t.clone() for (_, key), t in stage.tensors.items()}

    def withdraw(self, token: str) -> bool:
        return False

    def applied_version(self, update_id: str) -> None:
        return None


@pytest.fixture(scope="module")
def server():
    config = ServeConfig(port=0, flush=FlushPolicy(rows=4, seconds=0.01))
    with BackgroundServer(FakeEngine, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with RolloutClient(server.address, timeout=30) as c:
        yield c


def test_generate_round_trip_text_and_token_prompts(client):
    table = client.generate(["ab", [1, 2, 3]], n=3, sampling=dict(max_tokens=5), request_id="rt")
    assert table.schema.remove_metadata() == ROLLOUT_SCHEMA
    assert table.num_rows == 6
    assert table.column("prompt_index").to_pylist() == [0, 0, 0, 1, 1, 1]
    assert table.column("sample_index").to_pylist() == [0, 1, 2, 0, 1, 2]
    assert table.column("prompt_token_ids").to_pylist()[0] == [97, 98]
    assert set(table.column("request_id").to_pylist()) == {"rt"}
    assert all(len(t) == 5 for t in table.column("token_ids").to_pylist())
    meta = table.schema.metadata
    assert meta[b"model"] == b"fake" and meta[b"mask_mode"] == b"none" and meta[b"spec_method"] == b"none"
    assert table.column("support_ids").null_count == 6


@pytest.mark.parametrize("mask", ["selected", "support"])
def test_mask_modes_reach_the_table(client, mask):
    table = client.generate([[5, 6]], n=2, mask=mask, sampling=dict(top_k=4, max_tokens=3))
    assert table.schema.metadata[b"mask_mode"] == mask.encode()
    assert table.column("support_ids").null_count == 0
    assert (table.column("support_logprobs").null_count == 0) == (mask == "support")
    # the server keeps one encoder per kind of call: each table still carries its own bound
    for top_k in (6, 4):
        again = client.generate([[5, 6]], mask=mask, sampling=dict(top_k=top_k, max_tokens=2))
        assert again.schema.metadata[MASK_TOP_K_KEY.encode()] == str(top_k).encode()
        assert again.schema.metadata[b"mask_mode"] == mask.encode()


def test_stream_flushes_in_small_batches(client):
    batches = list(client.stream([[1]] * 10, n=1, sampling=dict(max_tokens=2)))
    assert sum(b.num_rows for b in batches) == 10
    assert all(b.num_rows <= 4 for b in batches) and len(batches) >= 3


@pytest.mark.parametrize(
    "kwargs, code, field",
    [
        (dict(sampling=dict(temperature=-1.0)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(sampling=dict(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (dict(mask="everything"), grpc.StatusCode.INVALID_ARGUMENT, "mask"),
        (dict(mask="support", sampling=dict(top_k=0)), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(prompts=[[VOCAB + 5]]), grpc.StatusCode.INVALID_ARGUMENT, "prompts[0]"),
        (dict(prompts=[[1] * MAX_LEN]), grpc.StatusCode.INVALID_ARGUMENT, "prompts[0]"),
        (dict(prompts=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompts"),
        (dict(n=0), grpc.StatusCode.INVALID_ARGUMENT, "n"),
        (dict(grammar=("yaml", "x")), grpc.StatusCode.INVALID_ARGUMENT, "grammar"),
        (dict(prompts=[[1]] * (MAX_QUEUED + 1)), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue"),
        (
            dict(sampling=dict(max_tokens=3, logit_bias={FAIL_TOKEN: 1.0})),
            grpc.StatusCode.FAILED_PRECONDITION,
            "max_mask_tokens",
        ),
    ],
)
def test_errors_map_to_status_codes_and_the_server_keeps_serving(client, kwargs, code, field):
    args = dict(prompts=[[1, 2]], sampling=dict(max_tokens=3)) | kwargs
    with pytest.raises(grpc.RpcError) as err:
        client.generate(**args)
    assert err.value.code() == code
    assert field in err.value.details()
    assert client.generate([[1]], sampling=dict(max_tokens=2)).num_rows == 1


def test_unknown_sampling_key_is_refused_before_sending(client):
    with pytest.raises(InvalidArgument, match="sampling"):
        client.generate([[1]], sampling=dict(temprature=1.0))


def test_duplicate_running_request_id_is_refused(client, server):
    worker = threading.Thread(
        target=lambda: client.generate([[1]], sampling=dict(max_tokens=60), request_id="dup")
    )
    worker.start()
    _wait_for(lambda: server.engine_call(lambda e: any(k[0] == "dup" for k in e.running)))
    with pytest.raises(grpc.RpcError) as err:
        client.generate([[1]], sampling=dict(max_tokens=2), request_id="dup")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
    client.abort("dup")
    worker.join()


def test_leaving_the_stream_early_frees_kv_blocks(client, server):
    free0 = client.server_info()["kv_blocks_free"]
    stream = client.stream([[1]] * 8, n=4, sampling=dict(max_tokens=60), request_id="early")
    _wait_for(lambda: server.engine_call(lambda e: any(k[0] == "early" for k in e.running)))
    assert client.server_info()["kv_blocks_free"] == free0 - 32
    stream.close()
    _wait_for(lambda: client.server_info()["kv_blocks_free"] == free0)
    dropped = client.stream([[2]] * 4, sampling=dict(max_tokens=60), request_id="dropped")
    _wait_for(lambda: server.engine_call(lambda e: any(k[0] == "dropped" for k in e.running)))
    del dropped  # a stream abandoned unfinished (e.g. `break` out of its loop) cancels too
    _wait_for(lambda: client.server_info()["kv_blocks_free"] == free0)


def test_deadline_aborts_the_request(client):
    free0 = client.server_info()["kv_blocks_free"]
    with pytest.raises(grpc.RpcError) as err:
        client.generate([[1]] * 4, sampling=dict(max_tokens=60), timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: client.server_info()["kv_blocks_free"] == free0)


def test_abort_rpc_delivers_unfinished_samples_as_abort(client, server):
    results = {}
    worker = threading.Thread(
        target=lambda: results.update(
            t=client.generate([[1]], n=3, sampling=dict(max_tokens=60), request_id="ab")
        )
    )
    worker.start()
    _wait_for(lambda: server.engine_call(lambda e: any(k[0] == "ab" for k in e.running)))
    assert client.abort("ab") == 3
    worker.join()
    assert results["t"].column("finish_reason").to_pylist() == ["abort"] * 3
    assert client.abort("ab") == 0


def test_server_info_reports_engine_state(client):
    info = client.server_info()
    assert info["model"] == "fake" and info["vocab_size"] == VOCAB and info["eos_token_ids"] == [EOS]
    assert info["kv_blocks_total"] == TOTAL_BLOCKS and info["limits"]["max_queued_samples"] == MAX_QUEUED


def test_update_weights_state_dict_file_and_refusal(client, tmp_path):
    before = client.generate([[1]], sampling=dict(max_tokens=3)).column("token_ids").to_pylist()
    v0 = client.server_info()["policy_version"]
    with pytest.raises(grpc.RpcError) as err:
        client.update_weights({"w": torch.ones(3, 4)})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tensor 'w'" in err.value.details()
    assert client.server_info()["policy_version"] == v0
    assert client.update_weights({"w": torch.ones(4, 4)}) == v0 + 1
    after = client.generate([[1]], sampling=dict(max_tokens=3))
    assert after.column("token_ids").to_pylist() != before
    assert after.column("policy_version").to_pylist() == [v0 + 1]
    save_file({"w": torch.zeros(4, 4)}, tmp_path / "w.safetensors")
    assert client.update_weights(tmp_path / "w.safetensors") == v0 + 2
    assert client.generate([[1]], sampling=dict(max_tokens=3)).column("token_ids").to_pylist() == before


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="rollout.v1.Rollout")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"rollout.v1.Rollout", "grpc.health.v1.Health"} <= names


def test_async_client_generate_stream_and_errors(server):
    async def main():
        async with AsyncRolloutClient(server.address, timeout=30) as aclient:
            tables = await asyncio.gather(
                *[aclient.generate([[i + 1]], n=2, sampling=dict(max_tokens=4)) for i in range(8)]
            )
            assert all(t.num_rows == 2 for t in tables)
            batches = [b async for b in aclient.stream([[3]], n=5, sampling=dict(max_tokens=2))]
            assert isinstance(batches[0], pa.RecordBatch) and sum(b.num_rows for b in batches) == 5
            with pytest.raises(grpc.RpcError) as err:
                await aclient.generate([[1]], sampling=dict(top_p=2.0))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
            return (await aclient.server_info())["vocab_size"]

    assert asyncio.run(main()) == VOCAB


def _wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


def test_stream_encoder_writes_a_standard_ipc_stream_per_response():
    """Each response is a whole IPC stream (schema with its metadata, one batch, end of stream)
    that pyarrow's reader takes as it is, response after response of one encoder."""
    from rollout.masks.pack import Supports
    from rollout.schema import schema_with_metadata, to_record_batch
    from rollout.server.convert import StreamEncoder

    schema = schema_with_metadata("m", "d", "dflash", "support", 4)
    encoder = StreamEncoder(schema)
    sup = Supports.from_lists([[3, 1], [2]], [[-0.1, -2.4], [0.0]])
    for k in range(3):
        samples = [SampleOutput(f"r{k}", 0, j, [1, 2], token_ids=[3, 2], token_logprobs=[-0.1, 0.0],
                                supports=sup, accept_lengths=[2]) for j in range(k + 1)]
        message = encoder.encode(samples)
        table = pa.ipc.open_stream(message.arrow_ipc).read_all()
        assert message.num_rows == table.num_rows == k + 1
        assert table.schema.metadata == schema.metadata
        assert table.equals(pa.Table.from_batches([to_record_batch(samples, schema)]))
