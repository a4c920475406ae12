"""Release and resume of the engine's memory for a colocated trainer (rollout.engine.release), on CPU
(the same code path as CUDA: the KV caches are freed and reallocated): refused while requests run,
requests refused with Unavailable or held until resume, weight updates still applied, outputs
unchanged after resume, a resume without room refused with nothing changed; the room check itself
against a scripted device; and through a server whose engine runs in its own process (`rollout
serve`'s): UNAVAILABLE, ServerInfo and the Rollout service's health."""

from __future__ import annotations

import functools
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams
from rollout.engine.release import ReleasedMemory
from rollout.errors import FailedPrecondition, ResourceExhausted, Unavailable
from rollout.server.app import BackgroundServer
from rollout.server.config import ServeConfig
from trainer_client import RolloutClient

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(model, **kw) -> LLMEngine:
    return build_engine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64, **kw))


def _run(eng: LLMEngine, request_id: str) -> list[int]:
    eng.add_request(request_id, [[5, 6, 7, 8, 9]], GREEDY)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs[0].token_ids


def test_release_frees_the_kv_caches_and_resume_gives_the_same_outputs(tiny_random_qwen3, random_drafters):
    eng = _engine(tiny_random_qwen3, spec="dflash", draft=random_drafters["dflash"])
    before = _run(eng, "a")
    shapes = [k.shape for k, _ in eng.kv_caches]
    kv_bytes = sum(t.numel() * t.element_size() for pair in eng.kv_caches + eng.drafter.caches for t in pair)
    report = eng.release_memory(weights=True, hold=False)
    assert report.released and report.bytes == kv_bytes and not report.weights_offloaded  # (CPU: weights stay)
    assert eng.kv_caches == [] and eng.drafter.caches == [] and eng.info()["memory_released"]
    with pytest.raises(Unavailable, match="released"):
        eng.add_request("b", [[1, 2]], GREEDY)
    report = eng.resume_memory()
    assert not report.released and report.bytes == kv_bytes and [k.shape for k, _ in eng.kv_caches] == shapes
    assert _run(eng, "c") == before


def test_release_waits_for_idle_and_held_requests_start_after_resume(tiny_random_qwen3):
    eng = _engine(tiny_random_qwen3)
    before = _run(eng, "a")
    eng.add_request("busy", [[1, 2, 3]], GREEDY)
    with pytest.raises(FailedPrecondition, match="between rollouts"):
        eng.release_memory(weights=False, hold=True)
    while eng.has_unfinished():
        eng.step()
    eng.release_memory(weights=False, hold=True)
    eng.add_request("held", [[5, 6, 7, 8, 9]], GREEDY)
    assert not eng.has_unfinished() and eng.step() == []  # nothing runs while released
    new = {k: v + 0.5 for k, v in [("model.norm.weight", eng.model.norm.weight.detach())]}
    eng.update_weights(new)  # an update still applies while released
    eng.step()
    assert eng.policy_version == 1 and torch.equal(eng.model.norm.weight, new["model.norm.weight"])
    eng.resume_memory()
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].request_id == "held" and outs[0].policy_version == 1 and outs[0].token_ids != before


def test_a_resume_without_room_is_refused_and_stays_released(tiny_random_qwen3, random_drafters, monkeypatch):
    """The engine asks for its weights, its whole KV pool (the planned number of blocks, the target's
    and the drafter's) and the plan's graph pools (none on CPU); refused, nothing is rebuilt."""
    eng = _engine(tiny_random_qwen3, spec="dflash", draft=random_drafters["dflash"])
    kv_bytes = sum(t.numel() * t.element_size() for pair in eng.kv_caches + eng.drafter.caches for t in pair)
    before = _run(eng, "a")
    eng.release_memory(weights=True)
    asked = []

    def no_room(nbytes: int) -> None:
        asked.append(nbytes)
        raise ResourceExhausted("memory: no room")

    monkeypatch.setattr(eng.memory, "check_room", no_room)
    with pytest.raises(ResourceExhausted, match="no room"):
        eng.resume_memory()
    assert asked == [kv_bytes] and eng.memory.released and eng.kv_caches == [] and eng.drafter.caches == []
    monkeypatch.undo()
    assert not eng.resume_memory().released and _run(eng, "b") == before


def test_the_room_check_counts_the_offloaded_weights(monkeypatch):
    weights = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of float32
    memory = ReleasedMemory(torch.device("cuda"), [weights])
    memory._host_weights = {id(weights.weight): weights.weight.data}  # (as an offload leaves them)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (300 << 10, 80 << 30))
    memory.check_room(0)
    with pytest.raises(ResourceExhausted, match=r"^memory: resuming needs .* GiB are free: the trainer must give"):
        memory.check_room(64 << 10)  # 256 + 64 KiB > 300 KiB free


@pytest.fixture(scope="module")
def server(tiny_random_qwen3):
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=64)
    with BackgroundServer(functools.partial(build_engine, config), ServeConfig(port=0, engine_process=True,
                                                                             stats_interval=0)) as srv:
        yield srv


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="rollout.v1.Rollout"), timeout=30).status


def test_server_release_and_resume(server):
    sampling = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    with RolloutClient(server.address, timeout=60) as client:
        before = client.generate([[4, 5, 6]], sampling=sampling).column("token_ids").to_pylist()
        state = client.release_memory(weights=True)
        assert state["released"] and state["bytes"] > 0
        assert client.server_info()["memory_released"]
        assert _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            client.generate([[4, 5, 6]], sampling=sampling)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "ResumeMemory" in err.value.details()
        assert not client.resume_memory()["released"]
        assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING
        assert client.generate([[4, 5, 6]], sampling=sampling).column("token_ids").to_pylist() == before
        client.release_memory(hold_requests=True)
        held = {}
        worker = threading.Thread(target=lambda: held.update(t=client.generate([[4, 5, 6]], sampling=sampling)))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive()  # waiting for resume
        client.resume_memory()
        worker.join()
        assert held["t"].column("token_ids").to_pylist() == before
