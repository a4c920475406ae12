"""One fleet replica: the Ray actor that owns a `rollout serve` child process.

`RolloutReplica.__init__` starts a fresh server bound to the node address Ray gives the actor
(`ray.util.get_node_ip_address()`) on a free port, reads its `rollout serving on HOST:PORT` line
and waits for gRPC health SERVING. A server that does not come up does not fail the actor's
creation (Ray would bury the reason in its own stack dump): `info()` then reports it as `error`,
with the tail of the server's log, and the fleet stops the actor. Once serving, a server that
exits on its own takes the actor down with it, so Ray restarts the actor and its `__init__` starts
a new server. The child gets SIGKILL when the actor's process dies (Linux PR_SET_PDEATHSIG), so a
killed actor leaves no server behind. `push_weights` is how the fleet's Ray object store payloads
reach the server."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.server.process import READY_PREFIX
from trainer_client.client import RolloutClient

PR_SET_PDEATHSIG = 1


def health_ok(address: str, timeout: float = 2.0) -> bool:
    """Whether the server at `address` answers the gRPC health check with SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the thread that forked it ends (Linux only)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerChild:
    """A `rollout serve` child process, forked and then watched by one thread that lives exactly as
    long as the child: PR_SET_PDEATHSIG fires when the forking *thread* ends, not the process.
    `on_exit(status)` runs on that thread when the child has exited."""

    def __init__(self, args: list[str], env: dict[str, str], on_exit: Callable[[int], None]):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="rollout-replica-", suffix=".log", delete=False)
        self.address = ""
        self._ready = threading.Event()
        started: Future[subprocess.Popen] = Future()
        threading.Thread(target=self._run, args=(args, env, on_exit, started), daemon=True).start()
        self.proc = started.result()

    def _run(self, args, env, on_exit, started: Future) -> None:
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        try:
            proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, preexec_fn=preexec
            )
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(proc)
        for line in proc.stdout:
            if line.startswith(READY_PREFIX) and not self.address:
                self.address = line[len(READY_PREFIX) :].strip()
                self._ready.set()
        self._ready.set()
        on_exit(proc.wait())

    def wait_ready(self, timeout: float) -> str:
        """The server's address once it printed its ready line; RuntimeError with the log tail if it
        exits or stays silent for `timeout` seconds."""
        if self._ready.wait(timeout) and self.address:
            return self.address
        try:
            state = f"exited with status {self.proc.wait(10 if self._ready.is_set() else 0)}"
        except subprocess.TimeoutExpired:
            state = f"printed no address in {timeout:.0f} s"
        self.kill()
        raise RuntimeError(f"rollout serve {state}; log tail:\n{self.log_tail()}")

    def terminate(self, grace: float) -> None:
        """SIGTERM (the server drains), SIGKILL after `grace` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log.name) as f:
            return f.read()[-chars:]


class RolloutReplica:
    """The actor class (the fleet wraps it with `ray.remote` and its resource options).

    `serve_args` go to `rollout serve` after `--host NODE_IP --port 0 --device DEVICE`, so they may
    override those; `env` is added to the server's environment."""

    def __init__(self, serve_args: list[str], device: str, startup_timeout: float, env: dict[str, str]):
        self.node_ip = ray.util.get_node_ip_address()
        self.incarnation = uuid.uuid4().hex
        self._serving = False
        self._stopping = False
        args = [sys.executable, "-m", "rollout.cli", "serve", "--host", self.node_ip, "--port", "0",
                "--device", device, *serve_args]  # fmt: skip
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self.address, self.error, self.startup_s = "", None, None
        started = time.monotonic()
        self.server = ServerChild(args, child_env, self._on_server_exit)
        try:
            self.address = self.server.wait_ready(startup_timeout)
            if not health_ok(self.address, timeout=min(startup_timeout, 30.0)):
                raise RuntimeError(f"rollout serve at {self.address} is not SERVING:\n{self.server.log_tail()}")
        except Exception as exc:
            self._stopping = True
            self.server.kill()
            self.error = str(exc)
            return
        self.startup_s = time.monotonic() - started
        self._serving = True

    def _on_server_exit(self, status: int) -> None:
        if self._serving and not self._stopping:
            print(f"rollout serve exited with status {status}; restarting the replica", file=sys.stderr)
            print(self.server.log_tail(), file=sys.stderr, flush=True)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        """Where the server is; `error` (its start failed, with its log tail) or `stopping` (someone
        called `shutdown`) say why it is not serving."""
        return {"address": self.address, "node_ip": self.node_ip, "incarnation": self.incarnation,
                "server_pid": self.server.proc.pid, "actor_pid": os.getpid(), "error": self.error,
                "stopping": self._stopping and self.error is None, "startup_s": self.startup_s}

    def server_info(self, timeout: float = 30.0) -> dict[str, Any]:
        with RolloutClient(self.address, timeout=timeout) as client:
            return client.server_info()

    def push_weights(self, *payloads: dict[str, Any], timeout: float | None = None) -> int:
        """Applies the payloads (`weights`, `draft`, `draft_weights`, as `update_weights` takes
        them) in order; returns the server's policy_version once its server_info reports it."""
        with RolloutClient(self.address, timeout=timeout) as client:
            for payload in payloads:
                version = client.update_weights(
                    payload["weights"], payload["draft"], draft_weights=payload["draft_weights"]
                )
            reported = client.server_info()["policy_version"]
        if payloads and reported != version:
            raise RuntimeError(f"server at {self.address} reports policy_version {reported}, expected {version}")
        return reported

    def log_tail(self, chars: int = 3000) -> str:
        return self.server.log_tail(chars)

    def kill_server(self) -> None:
        """SIGKILLs the server (as a crash would): the actor then exits and Ray restarts it."""
        self.server.proc.kill()

    def shutdown(self, grace: float = 10.0) -> None:
        """Stops the server (drain, then SIGKILL after `grace` s) without restarting the actor."""
        self._stopping = True
        self.server.terminate(grace)
