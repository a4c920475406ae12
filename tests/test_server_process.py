"""`rollout serve` as a real process: it prints its address, reports SERVING on gRPC health, and
on SIGTERM during generation delivers the in-flight samples, then exits 0; killed outright, it
leaves no engine process behind. Its edges: a port another server holds is refused by name; a
signal during start-up is handled (it starts, then stops cleanly); a second signal cuts a drain
short (exit 1); a drain that times out leaves a clean log, and so does one that ends an upload
stalled on the weight port; a stopped engine process turns health NOT_SERVING until it moves again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.server.process import READY_PREFIX, ServerProcess
from trainer_client import RolloutClient

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_random_qwen3):
    sampling = dict(temperature=1.0, top_k=8, max_tokens=48, ignore_eos=True, seed=0)
    server = ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "256"]).start()
    try:
        assert server.address.startswith("127.0.0.1:")
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        client = RolloutClient(server.address, timeout=120)
        result = {}
        worker = threading.Thread(
            target=lambda: result.update(t=client.generate([[1, 2, 3]], n=4, sampling=sampling))
        )
        worker.start()
        _wait_for(lambda: client.server_info()["kv_blocks_free"] < 256)
        server.proc.send_signal(15)
        worker.join(120)
        table = result["t"]
        assert table.num_rows == 4
        assert table.column("finish_reason").to_pylist() == ["length"] * 4
        assert all(len(t) == 48 for t in table.column("token_ids").to_pylist())
        assert server.proc.wait(60) == 0
        log = server.log_tail(100_000)
        assert '"event": "draining"' in log and '"event": "server_stopped"' in log
    finally:
        server.stop()


def test_a_killed_server_leaves_no_engine_process_behind(tiny_random_qwen3):
    """`rollout serve` killed outright (no drain): its engine process sees the pipe close and
    exits, so no orphan keeps the GPU."""
    server = ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "64"]).start()
    children = _children(server.proc.pid)
    assert children, "rollout serve runs its engine in a child process"
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)
    _wait_for(lambda: not any(_running(pid) for pid in children), timeout=30)


def test_a_port_in_use_is_refused_with_one_line_naming_it(tiny_random_qwen3):
    """(gRPC's default SO_REUSEPORT let a second server start on the same port and take part of
    its connections.)"""
    with ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "64"]) as first:
        host, port = first.address.rsplit(":", 1)
        args = [sys.executable, "-m", "rollout.cli", "serve", "--model", str(tiny_random_qwen3), "--host", host,
                "--port", port]  # fmt: skip
        second = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and second.stdout == ""
        assert second.stderr.splitlines() == [
            f"rollout serve: port: {first.address} is already in use (another server listens there)"
        ]
        assert RolloutClient(first.address, timeout=30).server_info()["instance_id"]


def test_a_signal_during_start_up_is_handled(tiny_random_qwen3):
    """SIGTERM once the server is starting (before its engine is built) does not kill it: it
    starts, then stops cleanly with 0. (A SIGTERM right after "serving on" killed it with -15.)"""
    server = ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "64"])
    proc = subprocess.Popen(server.args, stdout=subprocess.PIPE, stderr=server.log, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_for(lambda: '"event": "server_starting"' in server.log_tail(100_000), timeout=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert proc.stdout.read().startswith(READY_PREFIX)
        assert '"event": "server_stopped"' in server.log_tail(100_000)
    finally:
        proc.kill()
        proc.wait()


def test_a_second_signal_cuts_the_drain_short(tiny_random_qwen3):
    """A drain of minutes of work: the second SIGTERM cancels the in-flight requests at once and the
    server exits 1. (A second signal did nothing; the drain ran its course.)"""
    server = ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "256", "--max-num-seqs", "1"])
    with server:
        requests = _long_requests(server.address, count=4)
        server.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: '"event": "draining"' in server.log_tail(100_000))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 1
        codes = _finished(requests)
        assert codes and all(code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) for code in codes)
        assert '"event": "drain_cut_short"' in server.log_tail(100_000)


def test_a_drain_that_times_out_leaves_a_clean_log(tiny_random_qwen3):
    """(It logged ERROR engine_process_died with exit code 0, and "Future exception was never
    retrieved" once per request: commands sent before the stop were dropped by the engine process.)"""
    server = ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "256", "--max-num-seqs", "1",
                            "--drain-seconds", "1"])  # fmt: skip
    with server:
        requests = _long_requests(server.address, count=4)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert len(_finished(requests)) == 4
        log = server.log_tail(100_000)
    assert '"event": "server_stopped"' in log and '"level": "error"' not in log
    assert "never retrieved" not in log and "Traceback" not in log


def test_a_stopped_engine_turns_health_not_serving_until_it_moves_again(tiny_random_qwen3):
    server = ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "256", "--liveness-seconds", "1"])
    with server, grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        engine = _engine_process(server.proc.pid)
        client = RolloutClient(server.address, timeout=120)
        os.kill(engine, signal.SIGSTOP)
        try:
            result = {}
            worker = threading.Thread(
                target=lambda: result.update(t=client.generate([[1, 2, 3]], n=2, sampling=dict(max_tokens=8)))
            )
            worker.start()
            _wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING)
            assert worker.is_alive()
        finally:
            os.kill(engine, signal.SIGCONT)
        _wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING)
        worker.join(60)
        assert result["t"].num_rows == 2
        log = server.log_tail(100_000)
        assert '"event": "engine_stalled"' in log and '"event": "engine_progressing"' in log


def _long_requests(address: str, count: int) -> tuple[list, list[threading.Thread]]:
    """`count` requests of minutes of work with --max-num-seqs 1; returns once the server runs them:
    a list that fills with each request's status code when it ends, and their threads."""
    client = RolloutClient(address, timeout=300)
    sampling = dict(temperature=1.0, top_k=8, max_tokens=400, ignore_eos=True, seed=0)
    codes: list = []

    def run(i: int) -> None:
        try:
            client.generate([[1, 2, 3]] * 8, n=4, sampling=sampling, request_id=f"long-{i}")
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for worker in workers:
        worker.start()
    _wait_for(lambda: client.server_info()["kv_blocks_free"] < 256)
    return codes, workers


def _finished(requests: tuple[list, list[threading.Thread]]) -> list:
    codes, workers = requests
    for worker in workers:
        worker.join(60)
    return codes


def _engine_process(server_pid: int) -> int:
    """The engine process among the server's children (the other is multiprocessing's resource tracker)."""
    engines = [pid for pid in _children(server_pid) if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(engines) == 1, engines
    return engines[0]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(predicate, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def test_a_drain_ends_a_stalled_upload_on_the_weight_port(tiny_random_qwen3):
    """An update half sent to the weight port when SIGTERM comes (its sender stalls): the drain gives
    it --drain-seconds, then cancels it; nothing applies, the server exits 0 with a clean log (the
    weight port's threads, blocked on the update, do not hold the process)."""
    import torch
    from safetensors.torch import load_file

    from rollout.weight_wire import encode_piece, tensor_piece

    server = ServerProcess(["--model", str(tiny_random_qwen3), "--num-kv-blocks", "64", "--drain-seconds", "1"])
    with server, RolloutClient(server.address, timeout=60) as client:
        port = client.server_info()["weight_port"]
        norm = load_file(str(tiny_random_qwen3 / "model.safetensors"))["model.norm.weight"]
        stalled = threading.Event()

        def pieces():
            yield encode_piece(tensor_piece("model.norm.weight", "float32", (64,),
                                            memoryview(norm.view(torch.uint8).numpy())[:128]))
            stalled.wait(60)  # the rest never comes while the server drains

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_unary("/rollout.v1.Rollout/UpdateWeights", response_deserializer=lambda raw: raw)
            upload = call.future(pieces(), timeout=60)
            time.sleep(0.5)  # (the call is open, its first piece most likely in)
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(30) == 0
            stalled.set()
            assert upload.exception(30).code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        log = server.log_tail(100_000)
    assert '"event": "server_stopped"' in log and '"weights_applied"' not in log
    assert '"level": "error"' not in log and "Traceback" not in log
