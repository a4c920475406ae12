"""The engine in its own process (`rollout.server.engine_process`, what `rollout serve` runs): what
only a process can get wrong. The protocol itself runs through every test of tests/test_server.py
in both front ends; here: a child that dies mid-request fails its requests with UNAVAILABLE and
the server keeps answering (health NOT_SERVING), an engine that cannot be built fails the start
with its own error, a factory that cannot cross the process boundary is refused at once, and the
errors that do cross it keep their type and field."""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.errors import InvalidArgument, LoadError
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.server.engine_process import EngineProcess
from trainer_client import RolloutClient


def _engine_pid(engine) -> int:
    return os.getpid()


def test_a_dead_engine_process_fails_requests_with_unavailable(tiny_random_qwen3):
    """(On the way: a second request with a running request's id is refused, the first runs on.)"""
    factory = functools.partial(build_engine, EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=256))
    with BackgroundServer(factory, ServeConfig(port=0, engine_process=True)) as server:
        pid = server.engine_call(_engine_pid)
        assert pid != os.getpid()
        with RolloutClient(server.address, timeout=60) as client:
            long = dict(temperature=1.0, top_k=8, max_tokens=500, ignore_eos=True, seed=0)
            outcome = {}

            def doomed():
                try:
                    outcome["batches"] = list(client.stream([[1, 2, 3]], sampling=long, request_id="doomed"))
                except grpc.RpcError as exc:
                    outcome["error"] = exc

            worker = threading.Thread(target=doomed)
            worker.start()
            deadline = time.monotonic() + 60
            while client.server_info()["kv_blocks_free"] == 256:  # until it generates
                assert time.monotonic() < deadline and worker.is_alive(), outcome
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as dup:  # the running request's id: refused, it runs on
                client.generate([[4, 5]], sampling=dict(max_tokens=2), request_id="doomed")
            assert dup.value.code() == grpc.StatusCode.ABORTED and "request_id" in dup.value.details()
            assert worker.is_alive() and client.server_info()["kv_blocks_free"] < 256
            os.kill(pid, signal.SIGKILL)
            worker.join(60)
            err = outcome["error"]
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "exit code -9" in err.details()
            for call in (lambda: client.generate([[1, 2]], sampling=dict(max_tokens=2)), client.server_info):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with grpc.insecure_channel(server.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                deadline = time.monotonic() + 10
                while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != \
                        health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)


def _unfinished(engine) -> bool:
    return engine.has_unfinished()


def test_a_request_whose_admission_is_cancelled_is_aborted_in_the_child(tiny_random_qwen3):
    """The caller of `add` goes away after the command left: the child has admitted (or will
    admit) the request, and must not generate it for nobody."""
    from rollout.engine.params import SamplingParams
    from rollout.server.convert import GenerateCall

    factory = functools.partial(build_engine, EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=256))

    async def main():
        engine = EngineProcess(factory, asyncio.get_running_loop())
        await engine.start()
        try:
            params = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True, seed=0)
            add = asyncio.ensure_future(engine.add(GenerateCall("gone", [[1, 2, 3]], params, 1, None, None),
                                                   lambda delivery: None))
            await asyncio.sleep(0)  # the add command is sent
            add.cancel()
            with pytest.raises(asyncio.CancelledError):
                await add
            assert engine.num_requests() == 0
            assert await engine.call(_unfinished) is False  # queued after the abort
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(main(), 120))


def _answer(engine) -> int:
    return 42


def test_commands_of_one_iteration_go_together_and_one_that_cannot_be_sent_fails_alone(tiny_random_qwen3):
    """Commands issued in one event-loop iteration cross the pipe as one batch; a command that does
    not pickle fails with its own error, and the others of its batch still run."""
    factory = functools.partial(build_engine, EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=256))

    async def main():
        engine = EngineProcess(factory, asyncio.get_running_loop())
        await engine.start()
        sent = []
        real = engine._send
        engine._send = lambda batch: sent.append(len(batch)) or real(batch)
        try:
            futures = [engine.call(_answer), engine.call(lambda e: 0), engine.call(_answer)]
            results = await asyncio.gather(*futures, return_exceptions=True)
            assert results[0] == results[2] == 42
            assert isinstance(results[1], (pickle.PicklingError, AttributeError, TypeError))
            assert sent[0] == 3  # one batch first (it would not pickle), then one command at a time
            assert await asyncio.gather(*(engine.call(_answer) for _ in range(5))) == [42] * 5
            assert sent[-1] == 5
        finally:
            engine._send = real
            await engine.stop()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_an_engine_that_cannot_be_built_fails_the_start_with_its_error(tmp_path):
    factory = functools.partial(build_engine, EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(LoadError, match="missing"):
        BackgroundServer(factory, ServeConfig(port=0, engine_process=True)).__enter__()


def test_a_factory_that_cannot_cross_the_process_boundary_is_refused_at_once():
    async def main():
        with pytest.raises(InvalidArgument, match="engine_process: the engine factory cannot be sent"):
            await EngineProcess(lambda: None, asyncio.get_running_loop()).start()

    asyncio.run(asyncio.wait_for(main(), 10))  # refused before any child starts


def test_errors_keep_their_type_and_field_across_the_process_boundary():
    err = pickle.loads(pickle.dumps(InvalidArgument("top_k", "must be >= 1")))
    assert isinstance(err, InvalidArgument) and err.field == "top_k" and str(err) == "top_k: must be >= 1"


def test_the_childs_messages_carry_large_arrays_out_of_band():
    """send_message / recv_message (the child's deliveries): large arrays (a sample's masks) travel
    as pipe messages of their own and arrive read-only on the received bytes, not copied out of the
    pickle; small ones stay inside it; everything arrives equal."""
    import multiprocessing

    import numpy as np

    from rollout.server.pipe import IN_BAND_BYTES, recv_message, send_message

    big = np.arange(IN_BAND_BYTES // 4 + 7, dtype=np.int32)
    small = np.arange(5, dtype=np.float32)
    ours, theirs = multiprocessing.Pipe()
    got = []
    reader = threading.Thread(target=lambda: got.append(recv_message(theirs)))
    reader.start()
    send_message(ours, [("delivery", "r", {"big": big, "small": small, "n": 3}, None)])
    reader.join(10)
    (kind, key, value, error), = got[0]
    assert (kind, key, value["n"], error) == ("delivery", "r", 3, None)
    assert np.array_equal(value["big"], big) and np.array_equal(value["small"], small)
    assert not value["big"].flags.writeable and value["small"].flags.writeable
