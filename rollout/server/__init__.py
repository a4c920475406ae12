"""The gRPC server: `rollout serve` (app.py, configured by config.py's ServeConfig) runs the
Rollout service (service.py; the methods' raw request bytes parsed in wire.py, prompts measured
and tokenised in admission.py, wire messages <-> engine types in convert.py, errors -> status
codes in status.py, weight streams in weights.py) over an engine loop, on a thread (loop.py) or
in a child process of its own (engine_process.py; the child's side in engine_child.py, its
large messages through pipe.py); results cross those boundaries through one outbox (outbox.py).
liveness.py turns health NOT_SERVING while the engine stalls; engine_stats.py, metrics.py and
stats_log.py count and report. demo.py is `rollout demo`, process.py runs `rollout serve` as a
subprocess. The server calls the engine and never a drafter: the engine factory it is given
(rollout.build_engine) brings the drafter. The wire contract is docs/wire.md.
"""
