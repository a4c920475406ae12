"""A `rollout serve` child process: start it on a free local port, learn its address from the
`rollout serving on HOST:PORT` line, stop it with SIGTERM (drain) and collect its exit status.
Used by `rollout demo`, the service benchmark and the tests that need a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

READY_PREFIX = "rollout serving on "


class ServerStartError(RuntimeError):
    """`rollout serve` exited or stayed silent instead of serving; the message ends with its log tail."""


class ServerProcess:
    """`with ServerProcess(["--spec", "dflash"]) as proc: RolloutClient(proc.address)`.
    Its JSON logs go to `proc.log_path`."""

    def __init__(self, serve_args: list[str], startup_timeout: float = 180.0, host: str = "127.0.0.1"):
        self.args = [sys.executable, "-m", "rollout.cli", "serve", "--host", host, "--port", "0", *serve_args]
        self.startup_timeout = startup_timeout
        self.log = tempfile.NamedTemporaryFile("w+", prefix="rollout-serve-", suffix=".log", delete=False)
        self.log_path = self.log.name
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> ServerProcess:
        """Starts the child and waits for its ready line; raises RuntimeError with its log tail."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        ready = threading.Event()
        threading.Thread(target=self._watch_stdout, args=(ready,), daemon=True).start()
        if not ready.wait(self.startup_timeout) or not self.address:
            self.proc.kill()
            self.proc.wait()
            raise ServerStartError(f"rollout serve did not start: {self.log_tail()}")
        return self

    def _watch_stdout(self, ready: threading.Event) -> None:
        for line in self.proc.stdout:
            if line.startswith(READY_PREFIX) and not ready.is_set():
                self.address = line[len(READY_PREFIX) :].strip()
                ready.set()
        ready.set()  # stdout closed: the process ended

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the drain; returns the exit status (kills it after `timeout`)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_tail(self, chars: int = 2000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()
