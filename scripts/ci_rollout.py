"""CI's end-to-end check (`make test`, after the suite): a fresh rollout through the command line
as a user makes one, then `rollout validate` on it.

Starts `rollout serve` (embedded target and DFlash drafter, 127.0.0.1, a free port) in its own
process, waits for its `rollout serving on HOST:PORT` line, runs `rollout generate` with support
masks (two prompts, three samples each) against it, stops the server (SIGTERM) and validates
the Arrow file. Exits non-zero on any failure. Nothing here depends on the test suite's files.

    python scripts/ci_rollout.py [OUT.arrow]     # default .ci-artifacts/rollout.arrow
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STARTUP_SECONDS = 180


def _start_server() -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rollout.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--spec", "dflash",
           "--num-kv-blocks", "256", "--log-level", "warning"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + STARTUP_SECONDS
    for line in server.stdout:  # ends when the server exits
        if line.startswith("rollout serving on "):
            return server, line.split()[-1]
        if time.monotonic() > deadline:
            break
    server.kill()
    raise SystemExit(f"ci_rollout: `rollout serve` did not come up (exit {server.wait()})")


def main(out: Path) -> int:
    from rollout.cli import main as rollout

    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # a fresh rollout or none
    server, address = _start_server()
    try:
        code = rollout(["generate", "def fibonacci(n):\n", "class Stack:\n", "--address", address, "--out", str(out),
                        "-n", "3", "--mask", "support", "--temperature", "1.0", "--top-k", "16", "--top-p", "0.95",
                        "--max-tokens", "24", "--seed", "7", "--quiet"])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    if code != 0:
        return code
    return rollout(["validate", str(out)])


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / ".ci-artifacts" / "rollout.arrow"))
