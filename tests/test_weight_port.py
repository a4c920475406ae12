"""The weight port (rollout.server.weight_port) against a real server: updates go there and the
main port still takes them (one update may use both), bad input is refused as on the main port, a
call whose split update another call abandoned is ABORTED, an unreachable weight port leaves the
client on the main port, and --weight-port can be fixed or turned off."""

# ruff: noqa: F811  (the tests take the fixtures imported from test_weight_updates as arguments)
from __future__ import annotations

import functools
import socket
import threading

import grpc
import pytest
import torch
from test_weight_updates import GREEDY, _counting, _released, client, original, server  # noqa: F401 (fixtures)

from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.app import BackgroundServer, ServeConfig
from trainer_client import RolloutClient
from trainer_client.weights import encoded_ahead, weight_pieces, weight_streams


def _calls_to(address: str, count: int) -> list:
    """`count` UpdateWeights callables on connections of their own to `address` (taking encoded messages)."""
    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(count)]
    reply = pb.UpdateWeightsResponse.FromString
    return [c.stream_unary("/rollout.v1.Rollout/UpdateWeights", response_deserializer=reply) for c in channels]


def test_updates_go_to_the_weight_port_and_the_main_port_takes_them_too(server, client, original):
    """ServerInfo.weight_port names a second port; the client's updates go there, the main port
    still takes them, and one update may arrive over both (WeightChunk.streams) as one version."""
    info = client.server_info()
    main_port = int(server.address.rpartition(":")[2])
    assert info["weight_port"] > 0 and info["weight_port"] != main_port
    weight_address = f"127.0.0.1:{info['weight_port']}"
    v0 = info["policy_version"]
    perturbed = {k: v * 1.5 for k, v in original.items()}
    assert client.update_weights(perturbed, streams=2) == v0 + 1
    assert client._weight_address == weight_address and len(client._weight_channels) == 2
    reference = client.generate([[4, 5, 6]], sampling=GREEDY).column("token_ids").to_pylist()

    (main,) = _calls_to(server.address, 1)
    assert main(encoded_ahead(weight_pieces(original)), timeout=60).policy_version == v0 + 2
    assert client.generate([[4, 5, 6]], sampling=GREEDY).column("token_ids").to_pylist() != reference

    halves = weight_streams(perturbed, update_id="both-ports", streams=2)
    (on_weight_port,) = _calls_to(weight_address, 1)
    calls = [main.future(encoded_ahead(halves[0]), timeout=60), on_weight_port.future(encoded_ahead(halves[1]),
                                                                                       timeout=60)]
    assert [c.result().policy_version for c in calls] == [v0 + 3, v0 + 3]
    assert client.generate([[4, 5, 6]], sampling=GREEDY).column("token_ids").to_pylist() == reference


def test_on_the_weight_port_a_call_whose_sibling_went_away_is_aborted(server, client, original):
    """A split update on the weight port: one call stalls and its deadline passes (its caller hears
    DEADLINE_EXCEEDED), which withdraws the update; the other call, all sent and its own deadline
    far, hears ABORTED within a second rather than waiting for its deadline (or a CANCELLED it did
    not ask for)."""
    v0 = client.server_info()["policy_version"]
    weight_address = f"127.0.0.1:{client.server_info()['weight_port']}"
    halves = weight_streams(original, update_id="sibling", streams=2)
    go_on = threading.Event()

    def stalled(pieces):
        yield from pieces
        go_on.wait(60)

    short, far = _calls_to(weight_address, 2)
    far_call = far.future(encoded_ahead(halves[1]), timeout=60)
    with pytest.raises(grpc.RpcError) as err:
        short(stalled(encoded_ahead(halves[0])), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert far_call.exception(timeout=10).code() == grpc.StatusCode.ABORTED
    assert "another call of this update went away" in far_call.exception().details()
    go_on.set()
    assert _released(server) and client.server_info()["policy_version"] == v0


def test_the_weight_port_refuses_like_the_main_port(server, original):
    """Bad input on the weight port: refused at the tensor's first piece with the field named, the
    arena given back; an undecodable message is INVALID_ARGUMENT."""
    with RolloutClient(server.address, timeout=60) as c:
        v0 = c.server_info()["policy_version"]
        weight_address = f"127.0.0.1:{c.server_info()['weight_port']}"
    (call,) = _calls_to(weight_address, 1)
    pulled: list = []
    pieces = weight_pieces({"model.bogus.weight": torch.zeros(64, 1 << 16)}, piece_bytes=1 << 18)  # 64 pieces
    with pytest.raises(grpc.RpcError) as err:
        call(encoded_ahead(_counting(pieces, pulled)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown tensor 'model.bogus.weight'" in err.value.details() and len(pulled) < 32
    assert _released(server)
    with grpc.insecure_channel(weight_address) as channel:
        raw = channel.stream_unary("/rollout.v1.Rollout/UpdateWeights", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            raw(iter([b"\xff" * 16]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a WeightChunk message" in err.value.details()
    with RolloutClient(server.address, timeout=60) as c:
        assert c.server_info()["policy_version"] == v0


def test_a_weight_port_that_does_not_connect_leaves_updates_on_the_main_port(server, original, monkeypatch, caplog):
    import trainer_client.client as client_module

    monkeypatch.setattr(client_module, "WEIGHT_PORT_CONNECT_S", 0.5)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = closed.getsockname()[1]
    with RolloutClient(server.address, timeout=120) as c:
        learn = c._learn_weight_target
        monkeypatch.setattr(c, "_learn_weight_target", lambda info: learn(info) and f"127.0.0.1:{nowhere}")
        v0 = c.server_info()["policy_version"]
        with caplog.at_level("WARNING", logger="trainer_client"):
            assert c.update_weights(original, streams=2) == v0 + 1
        assert c._weight_address == server.address and "did not connect" in caplog.text


def test_the_weight_port_can_be_fixed_or_turned_off(tiny_random_qwen3, original):
    """--weight-port: out of range or taken is refused naming it; -1 = none (ServerInfo says 0 and
    the client's updates go to the main port)."""
    with pytest.raises(InvalidArgument, match="weight_port"):
        ServeConfig(weight_port=-2)
    engine = functools.partial(LLMEngine, EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=64))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidArgument, match=f"weight_port: 127.0.0.1:{port} is already in use"):
            BackgroundServer(engine, ServeConfig(port=0, engine_process=False, weight_port=port)).__enter__()
    with BackgroundServer(engine, ServeConfig(port=0, engine_process=False, weight_port=-1)) as srv:
        with RolloutClient(srv.address, timeout=60) as c:
            info = c.server_info()
            assert info["weight_port"] == 0
            assert c.update_weights(original, streams=2) == info["policy_version"] + 1
            assert c._weight_address == srv.address
