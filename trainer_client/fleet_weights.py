"""The weight and memory operations of `RolloutFleet` (a mixin of it): updates to every routed
replica at once, through the Ray object store or by broadcast, and release / resume of every
server's device memory between rollouts.

`update_weights(..., broadcast=False)`: each actor pushes the payload it reads from the object
store to its server over gRPC, all replicas at the same time. With `broadcast=True` the trainer
(this process, rank 0) and every routed server form a weight group (`FleetConfig.broadcast_backend`:
by default NCCL where the fleet runs on GPUs and this process has one, which must not be one of the
servers' GPUs, gloo otherwise; made on first use and again when the replica set changes) and the
bytes go by broadcast (trainer_client.broadcast). Either way the payload is also
put in the object store once: a restarted replica replays it (see `RolloutFleet`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import load_file

from trainer_client.broadcast import BroadcastGroup
from trainer_client.weights import Weights, safetensors_files


class FleetWeights:
    """Needs the fleet's `_weights_lock`, `_history`, `_version`, `replicas`, `_loop`, `client`,
    `replica_failed`, `config` and `_weight_group` (None until a broadcast)."""

    def update_weights(self, weights: Weights | None, draft: bool = False, *, draft_weights: Weights | None = None,
                       timeout: float | None = None, broadcast: bool = False) -> int:  # fmt: skip
        """Pushes a state dict or safetensors file(s) (read here) to every routed replica at once;
        returns the new fleet policy_version once every one applied it. A replica that is
        restarting gets it before it rejoins. An update the servers refuse (wrong name, shape or
        dtype, values that are not finite) changes nothing and raises the server's error."""
        payload = {"weights": _state(weights), "draft": draft, "draft_weights": _state(draft_weights)}
        names = {(draft, k) for k in payload["weights"] or {}} | {(True, k) for k in payload["draft_weights"] or {}}
        ref = ray.put(payload)
        with self._weights_lock:
            snapshot = self._history.snapshot()
            self._history.add(ref, names)
            self._version += 1
            targets = [r for r in self.replicas if r.state == "healthy"]
            try:
                versions = (self._broadcast(targets, payload, timeout) if broadcast
                            else self._push(targets, ref, timeout))  # fmt: skip
            except Exception:
                self._history.restore(snapshot)
                self._version -= 1
                raise
            for replica, server_version in versions:
                replica.offset = self._version - server_version
        return self._version

    def _push(self, targets: list, ref, timeout: float | None) -> list[tuple[Any, int]]:
        """Every actor pushes the payload to its server; a dead actor leaves the routing."""
        calls = [(replica, replica.actor.push_weights.remote(ref, timeout=timeout)) for replica in targets]
        versions = []
        for replica, call in calls:
            try:
                versions.append((replica, ray.get(call)))
            except ray.exceptions.RayActorError:
                self.replica_failed(replica)
        return versions

    def _broadcast(self, targets: list, payload: dict, timeout: float | None) -> list[tuple[Any, int]]:
        group = self._group_of(targets)
        try:
            versions = group.update_weights(payload["weights"], payload["draft"],
                                            draft_weights=payload["draft_weights"], timeout=timeout)  # fmt: skip
        finally:
            if group.broken:
                self._close_group()
        return list(zip(targets, versions))

    def _group_of(self, targets: list) -> BroadcastGroup:
        """The weight group of exactly these replicas' servers (made anew if they changed)."""
        members = tuple((r.index, r.incarnation) for r in targets)
        if self._weight_group is not None and self._weight_group[0] != members:
            self._close_group()
        if self._weight_group is None:
            backend = self.config.broadcast_backend
            if backend == "auto":
                backend = "nccl" if self.config.device != "cpu" and torch.cuda.is_available() else "gloo"
            group = BroadcastGroup([r.address for r in targets], backend=backend, host=ray.util.get_node_ip_address(),
                                   timeout=self.config.startup_timeout)  # fmt: skip
            self._weight_group = (members, group)
        return self._weight_group[1]

    def _close_group(self) -> None:
        if self._weight_group is not None:
            self._weight_group[1].close()
            self._weight_group = None

    def release_memory(self, weights: bool = False, hold_requests: bool = False) -> list[dict[str, Any]]:
        """`RolloutClient.release_memory` on every routed replica at once; their MemoryStates."""
        return self._on_all(lambda client: client.release_memory(weights, hold_requests))

    def resume_memory(self) -> list[dict[str, Any]]:
        return self._on_all(lambda client: client.resume_memory())

    def _on_all(self, call) -> list[dict[str, Any]]:
        async def run():
            routed = [r for r in self.replicas if r.state == "healthy"]
            return await asyncio.gather(*(call(self.client(r)) for r in routed))

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()


def _state(weights: Weights | None) -> Mapping | None:
    """A state dict on the host; a safetensors file or directory read into one (here, once)."""
    if weights is None:
        return None
    if isinstance(weights, Mapping):
        return {name: tensor.detach().cpu() for name, tensor in weights.items()}
    return {name: tensor for file in safetensors_files(Path(weights)) for name, tensor in load_file(file).items()}
