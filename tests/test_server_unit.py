"""The gRPC front end against a small fake engine (tests/fake_engine.py; the real engine's tests
are in test_server.py): streaming and flushing, the error mapping, cancellation freeing KV blocks,
Abort, weight-update plumbing, health and reflection, and the asyncio client."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pyarrow as pa
import pytest
import torch
from fake_engine import EOS, FAIL_TOKEN, MAX_LEN, MAX_QUEUED, TOTAL_BLOCKS, VOCAB, FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from safetensors.torch import save_file

from rollout.errors import InvalidArgument
from rollout.outputs import SampleOutput
from rollout.schema import MASK_TOP_K_KEY, ROLLOUT_SCHEMA
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.server.service import FlushPolicy
from trainer_client import AsyncRolloutClient, RolloutClient


@pytest.fixture(scope="module")
def server():
    config = ServeConfig(port=0, engine_process=False, flush=FlushPolicy(rows=4, seconds=0.01))
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
    assert meta[b"vocab_size"] == str(VOCAB).encode()  # `rollout validate` checks every id against it
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
    assert err.value.code() == grpc.StatusCode.ABORTED and "request_id" in err.value.details()
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
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tensor w" in err.value.details()
    assert client.server_info()["policy_version"] == v0
    assert client.update_weights({"w": torch.ones(4, 4)}) == v0 + 1
    after = client.generate([[1]], sampling=dict(max_tokens=3))
    assert after.column("token_ids").to_pylist() != before
    assert after.column("policy_version").to_pylist() == [v0 + 1]
    assert after.schema.metadata[b"policy_version"] == str(v0 + 1).encode()
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


def test_async_stream_left_through_async_with_cancels_the_request(server, client):
    free0 = client.server_info()["kv_blocks_free"]

    async def main():
        async with AsyncRolloutClient(server.address, timeout=30) as aclient:
            async with aclient.stream([[1]] * 4, n=2, sampling=dict(max_tokens=60), request_id="awith") as stream:
                await asyncio.to_thread(
                    lambda: _wait_for(lambda: server.engine_call(lambda e: any(k[0] == "awith" for k in e.running))))
                assert not stream._call.done()
            assert stream._call.cancelled()  # leaving the block cancelled the call

    asyncio.run(main())
    _wait_for(lambda: client.server_info()["kv_blocks_free"] == free0)  # aborted, blocks freed


def _wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


def test_stream_encoder_writes_a_standard_ipc_stream_per_response():
    """Each response is a whole IPC stream (schema with its metadata, one batch, end of stream)
    that pyarrow's reader takes as it is, response after response of one encoder; the metadata's
    policy_version is each batch's newest."""
    from functools import partial

    from rollout.masks.pack import Supports
    from rollout.schema import schema_with_metadata, to_record_batch
    from rollout.server.convert import StreamEncoder

    schema_for = partial(schema_with_metadata, "m", "d", "dflash", "support", 4, instance_id="abc")
    encoder = StreamEncoder(schema_for)
    sup = Supports.from_lists([[3, 1], [2]], [[-0.1, -2.4], [0.0]])
    for k in range(4):
        samples = [SampleOutput(f"r{k}", 0, j, [1, 2], token_ids=[3, 2], token_logprobs=[-0.1, 0.0],
                                supports=sup, accept_lengths=[2], policy_version=k // 2 + j) for j in range(k + 1)]
        message = encoder.encode(samples)
        table = pa.ipc.open_stream(message.arrow_ipc).read_all()
        schema = schema_for(policy_version=k // 2 + k)
        assert message.num_rows == table.num_rows == k + 1
        assert table.schema.metadata == schema.metadata
        assert table.schema.metadata[b"policy_version"] == str(k // 2 + k).encode()
        assert table.schema.metadata[b"instance_id"] == b"abc"
        assert table.equals(pa.Table.from_batches([to_record_batch(samples, schema)]))
