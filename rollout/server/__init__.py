"""The gRPC server: `rollout serve` (app.py) runs the Rollout service (service.py; wire
messages <-> engine types in convert.py, errors -> status codes in status.py, weight streams in
weights.py) over an engine loop, on a thread (loop.py) or in a child process of its own
(engine_process.py); results cross those boundaries through one outbox (outbox.py). demo.py is
`rollout demo`, process.py runs `rollout serve` as a subprocess. The server calls the engine
and never a drafter: the engine factory it is given (rollout.build_engine) brings the drafter.
The wire contract is docs/wire.md.
"""
