"""The settings of a rollout server's front end: `ServeConfig` and the `FlushPolicy` of its streams.

Each field is a flag of `rollout serve` (rollout.options generates them), so its default, help and
choices live here once. Pure Python: `rollout --help` does not import the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.errors import InvalidArgument
from rollout.options import option

LOG_LEVELS = ("debug", "info", "warning", "error")
MIN_REQUEST_BYTES = 32 << 20  # room for trainer_client's 16 MiB weight pieces (one WeightChunk each)


@dataclass(frozen=True)
class FlushPolicy:
    """When a Generate stream sends the samples it holds: at `rows` samples or after `seconds`
    (`rollout serve --flush-rows / --flush-seconds`)."""

    rows: int = option(32, "samples per streamed message, at most")
    seconds: float = option(0.02, "longest a finished sample waits to be sent with others")

    def __post_init__(self):
        if self.rows < 1:
            raise InvalidArgument("flush_rows", f"must be >= 1, got {self.rows}")
        if not self.seconds >= 0:
            raise InvalidArgument("flush_seconds", f"must be >= 0, got {self.seconds}")


@dataclass(frozen=True)
class ServeConfig:
    """The server's own settings (the engine has its own EngineConfig). Each field is a flag of
    `rollout serve` (rollout.options) and its default is the command's; `BackgroundServer` defaults
    to a free port and the engine on a thread instead."""

    host: str = option("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = option(50051, "TCP port; 0 = pick a free one (the bound address is printed)")
    drain_seconds: float = option(300.0, "on SIGTERM / SIGINT: how long running requests may finish before "
                                  "the server stops (a second signal: stop now, exit 1)")
    flush: FlushPolicy = field(default_factory=FlushPolicy)
    # the engine in a child process (EngineProcess; the factory must then be picklable) rather than
    # a thread of this one (EngineLoop), see rollout.server.engine_process
    engine_process: bool = option(True, "run the engine on a thread of the server's process instead of in its "
                                  "own process (which keeps the gRPC front end off the engine's GIL)",
                                  flag="--engine-thread", default_text="its own process")
    log_level: str = option("info", "server log level (JSON lines on stderr)", choices=LOG_LEVELS)
    gil_switch_ms: float | None = option(None, "Python's thread switch interval, in the server's and the engine's "
                                         "process: how long a thread may wait for the GIL while another holds "
                                         "it (with --engine-thread, the engine thread and the gRPC event loop "
                                         "share one)", default_text="Python's, 5")
    metrics_port: int | None = option(None, "serve Prometheus metrics at http://METRICS_HOST:PORT/metrics; 0 = "
                                      "a free port (the address is printed)", default_text="off")
    metrics_host: str = option("127.0.0.1", "address the metrics endpoint listens on")
    stats_interval: float = option(10.0, "seconds between `stats` log lines (requests, queue, KV blocks, "
                                   "tokens/s, acceptance) while there is work; 0 = none")
    max_request_bytes: int = option(64 << 20, "largest message a client may send: a GenerateRequest, or each "
                                    "WeightChunk of an UpdateWeights stream (trainer_client sends 16 MiB pieces); "
                                    "a larger one is refused with RESOURCE_EXHAUSTED before it is read",
                                    default_text="64 MiB")
    liveness_seconds: float = option(60.0, "health turns NOT_SERVING when the engine makes no progress for this "
                                     "long while requests are in flight (make it longer than the slowest first "
                                     "step, which may compile kernels), and back when it moves; 0 = never")
    # keep the weight arena's pages between updates (rollout.server.arena): faster uploads, the arena
    # stays bounded by the model's size
    keep_weight_buffers: bool = option(False, "keep the host memory weight uploads land in between updates (at "
                                       "most the model's size) instead of giving it back after each: faster "
                                       "updates", default_text="given back")
    # UpdateWeights on a thread-pool grpc server of its own (rollout.server.weight_port), on --host
    weight_port: int = option(0, "TCP port of the weight port, where trainer_client sends UpdateWeights (a "
                              "thread-pool gRPC server, faster for large messages than the main port's); 0 = a "
                              "free one, -1 = none (updates go to the main port, which always takes them too)")

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise InvalidArgument("port", f"must be in [0, 65535] (0 = pick a free one), got {self.port}")
        if not -1 <= self.weight_port <= 65535:
            raise InvalidArgument("weight_port", f"must be in [-1, 65535] (0 = pick a free one, -1 = none), got "
                                                 f"{self.weight_port}")
        if not self.drain_seconds >= 0:
            raise InvalidArgument("drain_seconds", f"must be >= 0, got {self.drain_seconds}")
        if self.gil_switch_ms is not None and not self.gil_switch_ms > 0:
            raise InvalidArgument("gil_switch_ms", f"must be > 0, got {self.gil_switch_ms}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument("metrics_port", f"must be in [0, 65535] (0 = pick a free one), got "
                                  f"{self.metrics_port}")
        if not self.stats_interval >= 0:
            raise InvalidArgument("stats_interval", f"must be >= 0 (0 = no stats lines), got {self.stats_interval}")
        if not MIN_REQUEST_BYTES <= self.max_request_bytes < 2**31:
            raise InvalidArgument("max_request_bytes", f"must be in [{MIN_REQUEST_BYTES}, 2**31), "
                                                       f"got {self.max_request_bytes}")
        if not self.liveness_seconds >= 0:
            raise InvalidArgument("liveness_seconds", f"must be >= 0 (0 = no watchdog), got {self.liveness_seconds}")

    def address(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}"

    def grpc_options(self) -> list[tuple[str, Any]]:
        return [("grpc.so_reuseport", 0),  # (grpc's default lets a second server share the port)
                ("grpc.max_receive_message_length", self.max_request_bytes),
                ("grpc.max_send_message_length", -1)]
