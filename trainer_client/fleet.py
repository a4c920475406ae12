"""`RolloutFleet`: many `rollout serve` replicas on a Ray cluster, driven like one `RolloutClient`.

Each replica is a Ray actor (`fleet_replica.RolloutReplica`, one GPU each where the cluster has
GPUs) running its own server on its node's address. The trainer talks gRPC to the servers
directly: `generate` / `stream` spread prompts over the replicas by least outstanding work and
return one table in the caller's prompt order (`fleet_requests`). `update_weights` puts the
weights in the Ray object store once and each actor pushes them to its server.

Faults. A replica whose stream fails and whose health check then fails, or which the health
monitor (every `health_interval` s) finds unreachable or NOT_SERVING (e.g. its engine stalled, see
rollout.server.liveness), leaves the routing; its unfinished prompts go to live replicas. Ray
restarts its actor (`max_restarts`), which starts a fresh server; the fleet replays the weight
updates on it and puts it back in the routing. A server that was only NOT_SERVING goes back in
the routing as it is once it is SERVING again.

Versions. `policy_version` is the fleet's: the number of `update_weights` calls it has applied. A
restarted server counts from 0 again, so each replica keeps an offset and the `policy_version`
column of every returned table is rewritten to fleet versions. A fleet object that `attach`es to
running actors starts from the highest server version and has no updates to replay.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from safetensors.torch import load_file

from rollout.errors import InvalidArgument
from trainer_client.aio import AsyncRolloutClient
from trainer_client.client import Prompt, Weights, safetensors_files, sampling_to_proto, to_table
from trainer_client.fleet_replica import RolloutReplica, health_ok
from trainer_client.fleet_requests import FleetRequest
from trainer_client.fleet_routing import Replica, WeightHistory
from trainer_client.fleet_stream import FleetStream

log = logging.getLogger("trainer_client.fleet")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class FleetConfig:
    """How the fleet starts and runs its replicas. `device="auto"` asks for GPUs (and passes
    `--device cuda`) when the cluster has any; `name` makes the actors named (`{name}-{i}`), and
    `detached` lets them outlive this process. `max_outstanding_samples` caps each replica's
    in-flight samples from this fleet; `max_attempts` bounds how often one prompt is resubmitted. A
    replica whose health check gets no SERVING answer within `health_timeout` s leaves the routing."""

    num_replicas: int
    serve_args: tuple[str, ...] = ()
    num_gpus_per_replica: float = 1
    num_cpus_per_replica: float = 1
    device: str = "auto"
    max_restarts: int = -1
    startup_timeout: float = 600.0
    restart_timeout: float = 900.0
    max_outstanding_samples: int = 1024
    max_attempts: int = 3
    health_interval: float = 2.0
    health_timeout: float = 5.0
    server_env: Mapping[str, str] = field(default_factory=dict)
    name: str | None = None
    namespace: str | None = None
    detached: bool = False

    def __post_init__(self):
        checks = {  # field: (valid, what is allowed)
            "num_replicas": (self.num_replicas >= 1, ">= 1"),
            "num_gpus_per_replica": (self.num_gpus_per_replica >= 0, ">= 0"),
            "num_cpus_per_replica": (self.num_cpus_per_replica >= 0, ">= 0"),
            "device": (self.device in DEVICES, f"one of {DEVICES}"),
            "max_restarts": (self.max_restarts >= -1, ">= -1 (-1 = no limit)"),
            "startup_timeout": (self.startup_timeout > 0, "> 0 seconds"),
            "restart_timeout": (self.restart_timeout > 0, "> 0 seconds"),
            "max_outstanding_samples": (self.max_outstanding_samples >= 1, ">= 1"),
            "max_attempts": (self.max_attempts >= 1, ">= 1"),
            "health_interval": (self.health_interval > 0, "> 0 seconds"),
            "health_timeout": (self.health_timeout > 0, "> 0 seconds"),
            "detached": (self.name is not None or not self.detached, "False unless a name is given"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise InvalidArgument(name, f"must be {allowed}, got {getattr(self, name)!r}")


class RolloutFleet:
    """`RolloutFleet(2, serve_args=["--spec", "dflash"])`: starts the replicas and waits until every
    one is healthy and reachable from here; a replica that cannot start raises RuntimeError with
    the tail of its server log. Connect to Ray (`ray.init(address=...)`) first."""

    def __init__(self, num_replicas: int, serve_args: Sequence[str] = (), num_gpus_per_replica: float = 1,
                 **options: Any):  # fmt: skip
        config = FleetConfig(num_replicas, tuple(serve_args), num_gpus_per_replica, **options)
        self._boot(config, _start_actors(config), owned=True)

    @classmethod
    def attach(cls, name: str, namespace: str | None = None, **options: Any) -> RolloutFleet:
        """A fleet object for the named actors `{name}-0..` someone started (deploy/launch_fleet.py).
        It does not stop them if it cannot reach them; `shutdown()` does stop them."""
        actors = named_actors(name, namespace)
        if not actors:
            raise InvalidArgument("name", f"no actor named {name}-0 in namespace {namespace!r}")
        fleet = cls.__new__(cls)
        config = FleetConfig(len(actors), name=name, namespace=namespace, detached=True, **options)
        fleet._boot(config, actors, owned=False)
        return fleet

    def _boot(self, config: FleetConfig, actors: list, owned: bool) -> None:
        self.config = config
        self.window, self.max_attempts = config.max_outstanding_samples, config.max_attempts
        self._closed = self._said_stopped = False
        self._history = WeightHistory()
        self._weights_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._requests: dict[str, tuple[FleetRequest, FleetStream]] = {}
        self.replicas = self._started_replicas(actors, owned)
        servers = [ray.get(r.actor.server_info.remote())["policy_version"] for r in self.replicas]
        self._version = 0 if owned else max(servers)
        for replica, server_version in zip(self.replicas, servers):
            replica.offset = self._version - server_version
        self._loop = asyncio.new_event_loop()
        self._clients: dict[int, AsyncRolloutClient] = {}
        self._closing: set[asyncio.Task] = set()
        self._change: asyncio.Future | None = None
        threading.Thread(target=self._loop.run_forever, name="rollout-fleet", daemon=True).start()
        self._monitor = asyncio.run_coroutine_threadsafe(self._watch_health(), self._loop)

    def _started_replicas(self, actors: list, owned: bool) -> list[Replica]:
        """Waits for every actor's server, logging each as it comes up; on any failure stops them all
        (if `owned`) and raises RuntimeError with the failed server's own log tail."""
        replicas: dict[int, Replica] = {}
        pending = {actor.info.remote(): index for index, actor in enumerate(actors)}
        deadline = time.monotonic() + self.config.startup_timeout + 60
        try:
            while pending:
                done, _ = ray.wait(list(pending), timeout=max(deadline - time.monotonic(), 0))
                if not done:
                    raise RuntimeError(f"replica(s) {sorted(pending.values())} did not start in "
                                       f"{self.config.startup_timeout + 60:.0f} s")
                index = pending.pop(done[0])
                replicas[index] = self._replica(index, actors[index], done[0])
        except BaseException:
            if owned:
                stop_actors(actors)
            raise
        return [replicas[i] for i in range(len(actors))]

    def _replica(self, index: int, actor, info_ref) -> Replica:
        try:
            info = ray.get(info_ref)
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"replica {index} did not start: its actor died ({_first_line(exc)})") from None
        if info["error"]:
            raise RuntimeError(f"replica {index} did not start: {info['error']}")
        if not health_ok(info["address"], timeout=10.0):
            raise RuntimeError(f"replica {index}'s server {info['address']} is not reachable from here")
        log.info("replica %d serving at %s (its server started in %.1f s)", index, info["address"], info["startup_s"])
        return Replica(index, actor, info["address"], info["incarnation"], info["server_pid"])

    # ---- what callers use -------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Addresses of the replicas now in the routing."""
        return [r.address for r in self.replicas if r.state == "healthy"]

    @property
    def actors(self) -> list:
        return [r.actor for r in self.replicas]

    @property
    def policy_version(self) -> int:
        return self._version

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica: address, state, incarnation, server pid, outstanding and served samples."""
        return [r.stats() for r in self.replicas]

    def generate(self, prompts: Prompt | Sequence[Prompt], n: int = 1, sampling: Mapping[str, Any] | None = None,
                 mask: str | None = None, grammar: Any = None, request_id: str | None = None,
                 timeout: float | None = None) -> pa.Table:  # fmt: skip
        """All samples as one table ordered by (prompt_index, sample_index) in the caller's order."""
        with self.stream(prompts, n, sampling, mask, grammar, request_id, timeout) as batches:
            return to_table(list(batches))

    def stream(self, prompts: Prompt | Sequence[Prompt], n: int = 1, sampling: Mapping[str, Any] | None = None,
               mask: str | None = None, grammar: Any = None, request_id: str | None = None,
               timeout: float | None = None) -> FleetStream:  # fmt: skip
        """Record batches, each holding all n samples of one prompt, as prompts finish. `timeout` is
        the deadline of each prompt's sub-request. Closing the stream cancels the request."""
        if self._closed:
            raise RuntimeError("the fleet is shut down")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise InvalidArgument("prompts", "at least one prompt is required")
        if not isinstance(n, int) or n < 1:
            raise InvalidArgument("n", f"must be an integer >= 1, got {n!r}")
        sampling_to_proto(dict(sampling or {}))  # unknown keys fail here, not on a replica
        request_id = request_id or f"fleet-{uuid.uuid4().hex[:12]}"
        stream = FleetStream()
        request = FleetRequest(self, prompts, n, sampling, mask, grammar, request_id, timeout, stream.put)
        self._requests[request_id] = (request, stream)
        future = asyncio.run_coroutine_threadsafe(request.run(), self._loop)
        stream.attach(future, on_close=lambda: self._requests.pop(request_id, None))
        return stream

    def abort(self, request_id: str) -> int:
        """Cancels a running request; returns how many of its samples were not delivered."""
        if request_id not in self._requests:
            return 0
        request, stream = self._requests.pop(request_id)
        stream.close()
        return len(request.prompts) * request.n - request.delivered

    def server_info(self) -> list[dict[str, Any]]:
        """Each routed replica's server_info."""
        return ray.get([r.actor.server_info.remote() for r in self.replicas if r.state == "healthy"])

    def update_weights(self, weights: Weights | None, draft: bool = False, *, draft_weights: Weights | None = None,
                       timeout: float | None = None) -> int:  # fmt: skip
        """Pushes a state dict or safetensors file(s) (read here) to every replica through the object
        store; returns the new fleet policy_version once every routed replica reports it. A replica
        that is restarting gets it before it rejoins. An update the servers refuse (wrong name,
        shape or dtype) changes nothing and raises the server's error."""
        payload = {"weights": _state(weights), "draft": draft, "draft_weights": _state(draft_weights)}
        names = {(draft, k) for k in payload["weights"] or {}} | {(True, k) for k in payload["draft_weights"] or {}}
        ref = ray.put(payload)
        with self._weights_lock:
            snapshot = self._history.snapshot()
            self._history.add(ref, names)
            self._version += 1
            targets = [r for r in self.replicas if r.state == "healthy"]
            calls = [r.actor.push_weights.remote(ref, timeout=timeout) for r in targets]
            for replica, call in zip(targets, calls):
                try:
                    replica.offset = self._version - ray.get(call)
                except ray.exceptions.RayActorError:
                    self.replica_failed(replica)
                except Exception:
                    self._history.restore(snapshot)
                    self._version -= 1
                    raise
        return self._version

    def shutdown(self) -> None:
        """Stops every server and actor (named and detached ones too) and this fleet's threads."""
        if self._closed:
            return
        self._closed = True
        for _, stream in list(self._requests.values()):
            stream.close()
        self._monitor.cancel()
        stop_actors(self.actors)
        asyncio.run_coroutine_threadsafe(self._close_clients(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- FleetCore: called by requests on the event loop -----------------------------------------

    def client(self, replica: Replica) -> AsyncRolloutClient:
        """The replica's client; a restarted replica's new address gets a new channel."""
        old = self._clients.get(replica.index)
        if old is None or old.address != replica.address:
            if old is not None:
                closing = asyncio.ensure_future(old.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            self._clients[replica.index] = AsyncRolloutClient(replica.address)
        return self._clients[replica.index]

    async def alive(self, replica: Replica) -> bool:
        if replica.state != "healthy":
            return False
        return await asyncio.to_thread(health_ok, replica.address, self.config.health_timeout)

    def routing_changed(self) -> asyncio.Future:
        if self._change is None or self._change.done():
            self._change = self._loop.create_future()
        return self._change

    def notify(self) -> None:
        if self._change is not None and not self._change.done():
            self._change.set_result(None)

    def replica_failed(self, replica: Replica) -> None:
        """Takes the replica out of the routing and waits, on a thread, for it to come back."""
        with self._state_lock:
            if replica.state != "healthy" or self._closed:
                return
            replica.state = "recovering"
        self._loop.call_soon_threadsafe(self.notify)
        threading.Thread(target=self._recover, args=(replica,), name=f"recover-{replica.index}", daemon=True).start()

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            routed = [r for r in self.replicas if r.state == "healthy"]
            for replica, ok in zip(routed, await asyncio.gather(*(self.alive(r) for r in routed))):
                if not ok:
                    self.replica_failed(replica)

    async def _close_clients(self) -> None:
        for client in self._clients.values():
            await client.close()

    # ---- recovery, on a thread per failed replica ------------------------------------------------

    def _recover(self, replica: Replica) -> None:
        if self._stopped_elsewhere(replica):
            replica.state = "dead"
            self._loop.call_soon_threadsafe(self.notify)
            return
        log.warning("replica %d at %s failed; waiting for Ray to restart it", replica.index, replica.address)
        deadline = time.monotonic() + self.config.restart_timeout
        while not self._closed and time.monotonic() < deadline:
            try:
                info = ray.get(replica.actor.info.remote(), timeout=10)
                if info["error"]:
                    log.error("replica %d restarted but its server did not start: %s", replica.index, info["error"])
                    break
                same_server = info["incarnation"] == replica.incarnation
                if same_server and not health_ok(info["address"], self.config.health_timeout):
                    time.sleep(0.5)  # dying (Ray will restart it), or NOT_SERVING (its engine stalled)
                    continue
                self._rejoin(replica, info)
                return
            except ray.exceptions.ActorDiedError as exc:
                log.error("replica %d is dead for good: %s", replica.index, exc)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)
            except Exception as exc:  # e.g. the restarted server refused the weight replay
                log.error("replica %d cannot rejoin: %s", replica.index, exc)
                break
        replica.state = "dead"
        self._loop.call_soon_threadsafe(self.notify)

    def _stopped_elsewhere(self, replica: Replica) -> bool:
        """Whether the replica's actor was shut down or killed on purpose (e.g. `launch_fleet.py --stop`
        from another process) rather than failed: said once per fleet, not as a failure."""
        try:
            stopping = ray.get(replica.actor.info.remote(), timeout=10)["stopping"]
        except ray.exceptions.ActorDiedError as exc:
            stopping = "ray.kill" in str(exc)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            stopping = False
        if stopping and not self._said_stopped:
            self._said_stopped = True
            log.warning("replica %d at %s was stopped elsewhere (its actor was shut down or killed, e.g. by "
                        "launch_fleet.py --stop); replicas stopped this way leave the routing", replica.index,
                        replica.address)
        return stopping

    def _rejoin(self, replica: Replica, info: dict[str, Any]) -> None:
        """Brings a restarted server up to the fleet's weights, then routes to it again."""
        with self._weights_lock:
            if info["incarnation"] != replica.incarnation:
                server_version = ray.get(replica.actor.push_weights.remote(*self._history.payloads()))
                replica.restarted(info["address"], info["incarnation"], info["server_pid"])
                replica.offset = self._version - server_version
            replica.state = "healthy"
        log.warning("replica %d is back at %s (restarts: %d)", replica.index, replica.address, replica.restarts)
        self._loop.call_soon_threadsafe(self.notify)


def _start_actors(config: FleetConfig) -> list:
    """One RolloutReplica actor per replica, with a GPU each when the cluster has GPUs."""
    gpus = ray.cluster_resources().get("GPU", 0) > 0 and config.num_gpus_per_replica > 0
    use_gpu = config.device == "cuda" or (config.device == "auto" and gpus)
    options: dict[str, Any] = dict(num_cpus=config.num_cpus_per_replica, max_restarts=config.max_restarts,
                                   num_gpus=config.num_gpus_per_replica if use_gpu else 0, max_concurrency=4)
    if config.detached:
        options["lifetime"] = "detached"
    args = (list(config.serve_args), "cuda" if use_gpu else "cpu", config.startup_timeout, dict(config.server_env))
    actor_class = ray.remote(RolloutReplica)
    if config.name is None:
        return [actor_class.options(**options).remote(*args) for _ in range(config.num_replicas)]
    return [actor_class.options(name=f"{config.name}-{i}", namespace=config.namespace, **options).remote(*args)
            for i in range(config.num_replicas)]


def _state(weights: Weights | None) -> Mapping | None:
    """A state dict on the host; a safetensors file or directory read into one (here, once)."""
    if weights is None:
        return None
    if isinstance(weights, Mapping):
        return {name: tensor.detach().cpu() for name, tensor in weights.items()}
    return {name: tensor for file in safetensors_files(Path(weights)) for name, tensor in load_file(file).items()}


def named_actors(name: str, namespace: str | None = None) -> list:
    """The handles of the actors `{name}-0`, `{name}-1`, ... that exist, in order."""
    actors = []
    while True:
        try:
            actors.append(ray.get_actor(f"{name}-{len(actors)}", namespace=namespace))
        except ValueError:
            return actors


def stop_actors(actors: list) -> None:
    """Stops each actor's server (it drains briefly) and kills the actor without restart."""
    pending = [actor.shutdown.remote() for actor in actors]
    for call in pending:
        try:
            ray.get(call, timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # the actor is dead or stuck: killing it below kills its server (PDEATHSIG)
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
