"""UpdateWeights against a real server (the tiny random Qwen3, tied embeddings; the engine in its own
process, as `rollout serve` runs it): refusals at a tensor's first piece with the upload's memory
given back, values that are not finite and a tied lm_head refused by name, undecodable bytes as
INVALID_ARGUMENT, an update whose caller gave up withdrawn, a repeated update id applied once, and
requests admitted and finished on the old weights while an upload is still streaming; an update
split over parallel calls (one failing fails all, their count and update id checked); and the
same-host handover through shared memory (UpdateWeightsShared); the asyncio client's weight and
memory calls."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.weight_wire import encode_piece, tensor_piece
from trainer_client import AsyncRolloutClient, RolloutClient
from trainer_client.shared import SharedUpdate
from trainer_client.weights import encoded_ahead, weight_pieces, weight_streams

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_random_qwen3):
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=256)
    with BackgroundServer(functools.partial(LLMEngine, config), ServeConfig(port=0, engine_process=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def original(tiny_random_qwen3):
    return load_file(str(tiny_random_qwen3 / "model.safetensors"))


@pytest.fixture
def client(server, original):
    with RolloutClient(server.address, timeout=120) as c:
        yield c
        c.update_weights(original)  # every test leaves the checkpoint's weights behind


@pytest.fixture
def main_client(server, original):
    """A client that sends its updates to the main port (the server has a weight port too)."""
    with RolloutClient(server.address, timeout=120, use_weight_port=False) as c:
        yield c
        c.update_weights(original)


def _arena(server):
    return server.running.engine_loop.weight_arena


def _counting(pieces, seen: list):
    for piece in pieces:
        seen.append(piece)
        yield piece


def test_unknown_tensor_is_refused_at_its_first_piece_and_memory_is_given_back(server, client, original):
    v0 = client.server_info()["policy_version"]
    pulled: list = []
    pieces = weight_pieces({"model.bogus.weight": torch.zeros(64, 1 << 16)}, piece_bytes=1 << 18)  # 64 pieces
    with pytest.raises(grpc.RpcError) as err:
        client._update_weights(encoded_ahead(_counting(pieces, pulled)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown tensor 'model.bogus.weight'" in err.value.details()
    assert len(pulled) < 32  # the server stopped reading at the first piece
    assert _arena(server).resident_bytes() == 0 and client.server_info()["policy_version"] == v0


@pytest.mark.parametrize("bad, message", [
    ({"model.norm.weight": torch.full((64,), float("nan"))}, "'model.norm.weight' has values that are not finite"),
    ({"lm_head.weight": torch.zeros(3, 3)}, "'lm_head.weight' has shape (3, 3), expected (264, 64)"),
    ({"lm_head.weight": torch.zeros(264, 64)}, "'lm_head.weight' is tied to 'embed_tokens.weight'"),
])
def test_bad_values_are_refused_by_name_and_nothing_changes(server, client, bad, message):
    v0 = client.server_info()["policy_version"]
    before = client.generate([[1, 2, 3]], sampling=GREEDY).column("token_ids").to_pylist()
    with pytest.raises(grpc.RpcError) as err:
        client.update_weights(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert client.server_info()["policy_version"] == v0
    assert client.generate([[1, 2, 3]], sampling=GREEDY).column("token_ids").to_pylist() == before
    assert _arena(server).resident_bytes() == 0


def test_a_short_tensor_is_refused_and_the_next_update_runs(server, client, original):
    """A tensor whose pieces stop short is found when the stream ends (one call): INVALID_ARGUMENT
    naming it, the arena given back, and the next update is not refused as still in progress."""
    v0 = client.server_info()["policy_version"]
    half = memoryview(original["model.norm.weight"].view(torch.uint8).numpy())[:128]
    with pytest.raises(grpc.RpcError) as err:
        client._update_weights(iter([encode_piece(tensor_piece("model.norm.weight", "float32", (64,), half))]),
                               timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model.norm.weight" in err.value.details()
    assert _released(server) and client.server_info()["policy_version"] == v0
    assert client.update_weights(original, streams=1) == v0 + 1


def test_undecodable_bytes_are_invalid_argument(server):
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_unary("/rollout.v1.Rollout/UpdateWeights", request_serializer=lambda raw: raw,
                                    response_deserializer=lambda raw: raw)
        with pytest.raises(grpc.RpcError) as err:
            call(iter([b"\xff" * 16]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a WeightChunk message" in err.value.details()


@pytest.mark.parametrize("port", ["weight port", "main port"])
def test_an_update_whose_caller_gave_up_is_withdrawn(request, port, original):
    client = request.getfixturevalue("client" if port == "weight port" else "main_client")
    v0 = client.server_info()["policy_version"]
    long = {}
    worker = threading.Thread(target=lambda: long.update(t=client.generate(
        [[5, 6, 7]], sampling=dict(GREEDY, max_tokens=480))))  # near the model's 512 positions
    worker.start()
    _wait_for_running(client)
    perturbed = {k: v + 1 for k, v in original.items()}
    with pytest.raises(grpc.RpcError) as err:  # (a 100-token sample could finish inside the deadline)
        client.update_weights(perturbed, timeout=0.15)  # drains behind a 480-token sample
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    worker.join()
    assert long["t"].column("policy_version").to_pylist() == [v0]
    after = client.generate([[1, 2, 3]], sampling=GREEDY)  # admission resumed, old weights
    assert after.column("policy_version").to_pylist() == [v0] and client.server_info()["policy_version"] == v0


def test_a_repeated_update_id_applies_once(client, original):
    v0 = client.server_info()["policy_version"]
    assert client.update_weights(original, update_id="step-7") == v0 + 1
    assert client.update_weights(original, update_id="step-7") == v0 + 1  # the reply was "lost": a retry
    assert client.last_update["repeated"] and client.server_info()["policy_version"] == v0 + 1


def test_requests_run_on_the_old_weights_while_the_upload_streams(client, original):
    """A generate issued from inside the upload's piece stream (so the upload is half sent) is
    admitted and finishes on the old weights: the transfer does not pause the engine."""
    v0 = client.server_info()["policy_version"]
    perturbed = {k: v * 1.5 for k, v in original.items()}
    midway = {}

    def pieces():
        for i, piece in enumerate(weight_pieces(perturbed, piece_bytes=1 << 12)):
            if i == 8:
                midway["t"] = client.generate([[9, 8, 7]], n=2, sampling=GREEDY)
            yield piece

    assert client._update_weights(encoded_ahead(pieces()), timeout=120).policy_version == v0 + 1
    assert midway["t"].column("policy_version").to_pylist() == [v0, v0]
    assert client.generate([[9, 8, 7]], sampling=GREEDY).column("policy_version").to_pylist() == [v0 + 1]


def _wait_for_running(client, timeout: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout
    while client.server_info()["kv_blocks_free"] == client.server_info()["kv_blocks_total"]:
        assert time.monotonic() < end, "the request did not start"
        time.sleep(0.01)


def test_same_host_update_through_shared_memory_equals_the_grpc_path(client, original):
    """The state dict handed over as a /dev/shm file (mapped by the engine's process) gives the
    same model as the same state dict sent over gRPC; the file is gone afterwards."""
    v0 = client.server_info()["policy_version"]
    perturbed = {k: (v * 1.25).to(torch.bfloat16) for k, v in original.items()}  # cast on the way too
    assert client.update_weights(perturbed) == v0 + 1
    reference = client.generate([[4, 5, 6]], n=2, sampling=GREEDY).column("token_ids").to_pylist()
    client.update_weights(original)
    assert client.update_weights_shared(perturbed) == v0 + 3
    after = client.generate([[4, 5, 6]], n=2, sampling=GREEDY)
    assert after.column("token_ids").to_pylist() == reference and after.column("policy_version")[0].as_py() == v0 + 3
    assert not list(Path("/dev/shm").glob("rollout-weights-*"))


def test_same_host_update_refuses_bad_names_and_places(client, tmp_path):
    v0 = client.server_info()["policy_version"]
    with pytest.raises(grpc.RpcError) as err:
        client.update_weights_shared({"model.bogus": torch.zeros(2)})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown tensor 'model.bogus'" in err.value.details()
    with SharedUpdate({"model.norm.weight": torch.ones(64)}) as shared:
        outside = pb.SharedWeights.FromString(shared.request.SerializeToString())
        outside.tensors[0].file.path = str(tmp_path / "elsewhere")
        beyond = pb.SharedWeights.FromString(shared.request.SerializeToString())
        beyond.tensors[0].file.offset = 1 << 20
        for request, message in ((outside, "is not a file in /dev/shm"), (beyond, "not float32 elements inside")):
            with pytest.raises(grpc.RpcError) as err:
                client._stub.UpdateWeightsShared(request, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert client.server_info()["policy_version"] == v0


def test_async_client_weight_and_memory_calls(server, original):
    async def main():
        async with AsyncRolloutClient(server.address, timeout=120) as aclient:
            v0 = (await aclient.server_info())["policy_version"]
            assert await aclient.update_weights(original, update_id="async-1") == v0 + 1
            assert aclient._weight_address == f"127.0.0.1:{(await aclient.server_info())['weight_port']}"
            assert await aclient.update_weights(original, update_id="async-1") == v0 + 1
            assert await aclient.update_weights_shared(original) == v0 + 2
            assert (await aclient.release_memory(hold_requests=True))["released"]
            assert not (await aclient.resume_memory())["released"]

    asyncio.run(main())


def _released(server, timeout: float = 30.0) -> bool:
    """The arena's pages given back (the server's calls of a failed update wind down asynchronously)."""
    import time

    end = time.monotonic() + timeout
    arena = _arena(server)
    while arena.resident_bytes() and time.monotonic() < end:
        time.sleep(0.02)
    assert arena.resident_bytes() == 0, (f"{arena.resident_bytes()} bytes of the weight arena still resident after "
                                         f"{timeout} s (used {arena.used} of {arena.size})")
    return True


def test_an_update_over_parallel_streams_equals_one_stream(client, original):
    """WeightChunk.streams: the tensors split over four calls, each on its own connection, give the
    model one call gives, as one version; a repeat of its update id applies nothing."""
    groups = weight_streams(original, update_id="u", streams=4)
    assert len(groups) == 4 and all(list(g) for g in weight_streams(original, update_id="u", streams=4))
    v0 = client.server_info()["policy_version"]
    perturbed = {k: v * 1.5 for k, v in original.items()}
    assert client.update_weights(perturbed, streams=1) == v0 + 1
    reference = client.generate([[4, 5, 6]], n=2, sampling=GREEDY).column("token_ids").to_pylist()
    client.update_weights(original, streams=1)
    assert client.update_weights(perturbed, streams=4, update_id="four-streams") == v0 + 3
    assert len(client._weight_channels) == 4
    assert client.generate([[4, 5, 6]], n=2, sampling=GREEDY).column("token_ids").to_pylist() == reference
    assert client.update_weights(perturbed, streams=4, update_id="four-streams") == v0 + 3
    assert client.last_update["repeated"]


def test_a_failing_stream_fails_the_whole_update(server, client, original):
    """One call of four carries an unknown tensor: every call fails, nothing applies, the arena's
    memory is given back, and the next update runs."""
    v0 = client.server_info()["policy_version"]
    before = client.generate([[4, 5, 6]], sampling=GREEDY).column("token_ids").to_pylist()
    bad = {**{k: v * 1.5 for k, v in original.items()}, "model.bogus.weight": torch.zeros(64, 64)}
    with pytest.raises(grpc.RpcError) as err:
        client.update_weights(bad, streams=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'model.bogus.weight'" in err.value.details()
    assert _released(server) and client.server_info()["policy_version"] == v0
    assert client.generate([[4, 5, 6]], sampling=GREEDY).column("token_ids").to_pylist() == before
    assert client.update_weights(original, streams=4) == v0 + 1


def test_parallel_streams_must_agree_on_their_count_and_carry_an_update_id(server, client, original):
    v0 = client.server_info()["policy_version"]
    name, tensor = "model.norm.weight", original["model.norm.weight"]
    data = memoryview(tensor.view(torch.uint8).numpy())  # [256] bytes
    (call_a, call_b) = client._weight_calls(2)
    with pytest.raises(grpc.RpcError) as err:  # no update id
        call_a(iter([encode_piece(tensor_piece(name, "float32", (64,), data, streams=2))]),
               timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs an update_id" in err.value.details()
    go_on = threading.Event()

    def first_call():
        yield encode_piece(tensor_piece(name, "float32", (64,), data, update_id="x", streams=2))
        go_on.wait(60)

    pending = call_a.future(first_call(), timeout=60)
    arena, end = _arena(server), time.monotonic() + 30
    while not arena.resident_bytes() and time.monotonic() < end:  # update "x" opened by the first call
        time.sleep(0.01)  # (else the second call could open it first, with 3 streams, and wait for them)
    assert arena.resident_bytes(), "the first call's piece never reached the arena"
    other = {k: v for k, v in original.items() if k != name}
    with pytest.raises(grpc.RpcError) as err:  # the same update, another count
        call_b(encoded_ahead(weight_streams(other, update_id="x", streams=3)[0]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "says 3 streams" in err.value.details()
    pending.cancel()
    go_on.set()
    assert _released(server) and client.server_info()["policy_version"] == v0


def test_a_call_cancelled_while_its_update_opens_stops_the_opening(server, client, original, monkeypatch):
    """The first call of a split update opens the upload (an engine call, then the arena reserved)
    in a task of its own. A caller that gives up before the opening ends stops it: the arena is
    not reserved behind the failed update's release, nothing applies, the next update runs."""
    from rollout.server.weight_service import WeightService

    opening, finished, open_upload = threading.Event(), threading.Event(), WeightService._open_upload

    async def slow_open(self):
        opening.set()
        await asyncio.sleep(2.0)
        upload = await open_upload(self)
        finished.set()
        return upload

    monkeypatch.setattr(WeightService, "_open_upload", slow_open)
    v0 = client.server_info()["policy_version"]
    go_on = threading.Event()

    def first_call():
        yield encode_piece(tensor_piece("model.norm.weight", "float32", (64,),
                                        memoryview(original["model.norm.weight"].view(torch.uint8).numpy()),
                                        update_id="slow", streams=2))
        go_on.wait(60)

    (call_a,) = client._weight_calls(1)
    pending = call_a.future(first_call(), timeout=60)
    assert opening.wait(30)
    pending.cancel()
    go_on.set()
    assert _released(server) and client.server_info()["policy_version"] == v0
    assert not finished.wait(3.0)  # (past the 2 s the opening would have taken)
    monkeypatch.undo()
    assert client.update_weights(original, streams=2) == v0 + 1


def test_a_server_that_takes_no_parallel_calls_gets_one(server, original, monkeypatch):
    """A server that predates WeightChunk.streams (ServerInfo.max_weight_streams 0) would apply each
    call as an update of its own: the client sends it one call. This server takes 16, and refuses
    more, naming `streams`."""
    import rollout.server.convert as convert

    with RolloutClient(server.address, timeout=120) as fresh:
        assert fresh.server_info()["max_weight_streams"] == 16
        monkeypatch.setattr(convert, "MAX_WEIGHT_STREAMS", 0)
        v0 = fresh.server_info()["policy_version"]
        assert fresh.update_weights(original, streams=4) == v0 + 1 and len(fresh._weight_channels) == 1
        name, tensor = "model.norm.weight", original["model.norm.weight"]
        piece = tensor_piece(name, "float32", (64,), memoryview(tensor.view(torch.uint8).numpy()), update_id="y",
                             streams=17)
        with pytest.raises(grpc.RpcError) as err:
            fresh._update_weights(iter([encode_piece(piece)]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 16 calls" in err.value.details()
        assert fresh.server_info()["policy_version"] == v0 + 1


