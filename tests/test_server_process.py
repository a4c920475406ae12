"""`rollout serve` as a real process: it prints its address, reports SERVING on gRPC health, and
on SIGTERM during generation delivers the in-flight samples, then exits 0; killed outright, it
leaves no engine process behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.server.process import ServerProcess
from trainer_client import RolloutClient


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
