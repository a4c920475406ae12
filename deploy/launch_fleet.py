"""Starts a fleet of `rollout serve` replicas on a running Ray cluster and prints their addresses.

    python deploy/launch_fleet.py --replicas 8 -- --spec dflash --model /ckpt/policy

Everything after `--` goes to `rollout serve`. The replicas are detached named Ray actors
(`{name}-0`, `{name}-1`, ... in `--namespace`), so they outlive this script: it exits once
every replica is healthy. A trainer picks them up with
`RolloutFleet.attach(name, namespace=...)`; `--stop` stops them. With `--foreground` the fleet
instead lives as long as this script and stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

import ray

from trainer_client.fleet import RolloutFleet, named_actors, stop_actors


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, serve_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=1, help="number of rollout servers")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: the local node's)")
    parser.add_argument("--name", default="rollout", help="actor name prefix")
    parser.add_argument("--namespace", default="rollout", help="Ray namespace of the actors")
    parser.add_argument("--gpus-per-replica", type=float, default=1.0)
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per server")
    parser.add_argument("--foreground", action="store_true", help="stop the fleet when this script ends")
    parser.add_argument("--stop", action="store_true", help="stop the fleet named --name and exit")
    parser.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    return parser.parse_args(ours), serve_args


def stop(name: str, namespace: str) -> int:
    actors = named_actors(name, namespace)
    stop_actors(actors)
    print(f"stopped {len(actors)} replica(s) of {name!r} in namespace {namespace!r}")
    return 0


def connect(address: str, namespace: str) -> bool:
    """ray.init on an existing cluster; False (with a message saying what to do) when there is none."""
    try:
        ray.init(address=address, namespace=namespace)
    except ConnectionError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"launch_fleet: no Ray cluster at --address {address} ({reason}). Start one with "
              f"`ray start --head` (deploy/README.md) or pass --address HEAD_IP:6379.", file=sys.stderr)
        return False
    return True


def report_progress() -> None:
    """The fleet's lines (a replica serving, with its address and start time) on stderr as they come."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    fleet_log = logging.getLogger("trainer_client.fleet")
    fleet_log.addHandler(handler)
    fleet_log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    if not connect(args.address, args.namespace):
        return 1
    if args.stop:
        return stop(args.name, args.namespace)
    if named_actors(args.name, args.namespace):
        print(f"a fleet named {args.name!r} already runs in {args.namespace!r}; use --stop first", file=sys.stderr)
        return 1
    report_progress()
    print(f"starting {args.replicas} replica(s) of {args.name!r}...", file=sys.stderr, flush=True)
    try:
        fleet = RolloutFleet(
            args.replicas, serve_args, args.gpus_per_replica, num_cpus_per_replica=args.cpus_per_replica,
            device=args.device, startup_timeout=args.startup_timeout, name=args.name, namespace=args.namespace,
            detached=not args.foreground,
        )  # fmt: skip
    except RuntimeError as exc:  # a replica that did not start: its own log tail, the others stopped
        print(f"launch_fleet: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"name": args.name, "namespace": args.namespace, "addresses": fleet.addresses}))
    else:
        for replica in fleet.replica_stats():
            print(f"replica {replica['index']}: {replica['address']}")
        print(f"attach with RolloutFleet.attach({args.name!r}, namespace={args.namespace!r})")
    sys.stdout.flush()
    if args.foreground:
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        try:
            done.wait()
        except KeyboardInterrupt:
            pass
        fleet.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
