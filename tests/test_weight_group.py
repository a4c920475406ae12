"""Broadcast weight updates (UpdateWeightsBroadcast) with gloo on CPU: the bucket layout both ends
compute, and a group of this test process (rank 0) and two `rollout serve` processes on
127.0.0.1: both get the update at once and serve what the gRPC path would have given them, a
refusal on one refuses it on both, and a member that left makes the trainer fail fast instead
of waiting for the group's timeout, with that member's error even when the broken collective ends
first."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.process import ServerProcess
from rollout.weight_group import STREAM_ALIGN, bucket_plan
from trainer_client import RolloutClient
from trainer_client.broadcast import BroadcastGroup

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("sizes, bucket", [([100, 0, 70000, 3], 1 << 16), ([1 << 17], 1 << 16), ([], 1 << 16)])
def test_bucket_plan_covers_every_byte_once_within_buckets(sizes, bucket):
    plan = bucket_plan(sizes, bucket)
    seen = [set() for _ in sizes]
    for length, segments in plan:
        assert 0 < length <= bucket
        used = set()
        for s in segments:
            assert s.at + s.size <= length and not used & set(range(s.at, s.at + s.size))
            used |= set(range(s.at, s.at + s.size))
            seen[s.tensor] |= set(range(s.start, s.start + s.size))
    assert [len(s) for s in seen] == sizes
    starts = [s.at + i * bucket - s.start for i, (_, segs) in enumerate(plan) for s in segs]
    assert all(start % STREAM_ALIGN == 0 for start in starts)
    with pytest.raises(InvalidArgument, match="bucket_bytes"):
        bucket_plan(sizes, 100)


@pytest.fixture(scope="module")
def servers(tiny_random_qwen3):
    args = ["--model", str(tiny_random_qwen3), "--num-kv-blocks", "64"]
    with ServerProcess(args) as a, ServerProcess(args) as b:
        yield a.address, b.address


@pytest.fixture(scope="module")
def original(tiny_random_qwen3):
    return load_file(str(tiny_random_qwen3 / "model.safetensors"))


def _outputs(address: str) -> list:
    with RolloutClient(address, timeout=60) as client:
        return client.generate([[3, 4, 5]], n=2, sampling=GREEDY).column("token_ids").to_pylist()


def _version(address: str) -> int:
    with RolloutClient(address, timeout=60) as client:
        return client.server_info()["policy_version"]


def test_broadcast_updates_every_server_like_the_grpc_path(servers, original):
    a, b = servers
    perturbed = {k: v * 1.5 for k, v in original.items()}
    with RolloutClient(a, timeout=60) as client:
        v0 = client.update_weights(perturbed)
        reference = _outputs(a)
        client.update_weights(original)
    vb = _version(b)
    with BroadcastGroup(servers, timeout=60) as group:
        versions = group.update_weights({k: v.to(torch.bfloat16) for k, v in perturbed.items()}, bucket_bytes=1 << 16)
        assert versions == [v0 + 2, vb + 1]
        assert _outputs(a) == reference == _outputs(b)
        with pytest.raises(grpc.RpcError) as err:  # refused by both servers, applied by neither
            group.update_weights({"model.norm.weight": torch.zeros(3)})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'model.norm.weight'" in err.value.details()
        assert [_version(a), _version(b)] == versions
        assert group.update_weights(original) == [v + 1 for v in versions]


def test_a_member_that_left_fails_the_update_at_once_and_nothing_applies(servers, original):
    a, b = servers
    versions = [_version(a), _version(b)]
    group = BroadcastGroup(servers, timeout=60)
    try:
        with grpc.insecure_channel(b) as channel:
            from rollout.proto.rollout.v1 import rollout_pb2_grpc

            rollout_pb2_grpc.RolloutStub(channel).LeaveWeightGroup(pb.LeaveWeightGroupRequest(group=group.name))
        with pytest.raises(grpc.RpcError) as err:
            group.update_weights(original)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not in weight group" in err.value.details()
        assert group.broken
    finally:
        group.close()
    assert [_version(a), _version(b)] == versions
    with BroadcastGroup(servers, timeout=60) as again:  # a's side of the broken group is gone: it can join anew
        assert again.update_weights(original) == [v + 1 for v in versions]


class _BrokenCollective:
    """A collective a member broke by leaving: it ends first, with the transport's error."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer")


class _Call:
    """A server call that ends `after` seconds from now, with `error` (None: it succeeds)."""

    def __init__(self, error: BaseException | None, after: float):
        self._error, self._at = error, time.monotonic() + after

    def done(self) -> bool:
        return time.monotonic() >= self._at

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None


def test_a_collective_broken_before_the_leaving_member_answers_raises_that_members_error():
    """The race behind a flaky fleet run: gloo reported the closed connection before the member's
    FAILED_PRECONDITION arrived, and the trainer got the transport's error instead of the reason."""
    group, error = SimpleNamespace(broken=False), grpc.RpcError("not in weight group")
    with pytest.raises(grpc.RpcError) as err:
        BroadcastGroup._until(group, _BrokenCollective(), [_Call(None, 0.0), _Call(error, 0.05)])
    assert err.value is error and group.broken
    group = SimpleNamespace(broken=False)  # no call fails: the transport's error, at once
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="closed by peer"):
        BroadcastGroup._until(group, _BrokenCollective(), [_Call(None, 0.0)])
    assert group.broken and time.monotonic() - start < 1.0

