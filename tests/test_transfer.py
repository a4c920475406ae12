"""The pinned staging ring large uploads go through (rollout.engine.transfer.PinnedStage), on CPU
with plain memory and recorded stand-in events: what it hands the copy holds the uploaded bytes, a
chunk is reused only after every copy read from it has completed, and nothing outgrows it."""

from __future__ import annotations

import torch

from rollout.engine.transfer import INLINE_BYTES, PinnedStage, upload


class Events:
    """Stand-in CUDA events: each copy's event, and which were waited for before a chunk's reuse."""

    def __init__(self):
        self.made: list[Event] = []

    def __call__(self):
        event = Event()
        self.made.append(event)
        return event


class Event:
    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


def test_the_ring_stages_every_upload_and_waits_before_reusing_a_chunk():
    """The safety property: bytes staged for a copy that may not have completed yet (its event not
    waited for) are never overwritten; on CPU the staged view is what `upload` returns."""
    events = Events()
    ring = PinnedStage(chunk_bytes=1024, chunks=2, pin=False, event=events)
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    staged = []  # (view in the ring, its source, its copy's event, its chunk)
    for _ in range(12):  # 12 uploads of 200-600 bytes: several passes round both chunks
        n = int(torch.randint(25, 75, (1,), generator=gen))
        host = torch.randint(0, 1 << 40, (n,), generator=gen, dtype=torch.int64)
        out = ring.upload(host, cpu)
        base = ring.chunks[ring.index].data_ptr()
        assert out.data_ptr() % 64 == 0 and base <= out.data_ptr() and out.data_ptr() + 8 * n <= base + 1024
        staged.append((out, host.clone(), events.made[-1], ring.index))
        for view, source, event, _ in staged:
            assert event.waited or torch.equal(view, source)  # a copy still in flight reads its own bytes
    chunks = [c for *_, c in staged]
    assert set(chunks) == {0, 1} and sum(a != b for a, b in zip(chunks, chunks[1:])) >= 3  # round and round
    assert any(e.waited for *_, e, _ in staged) and not staged[-1][2].waited  # old copies waited for, not the last
    big = torch.arange(200, dtype=torch.int64)  # 1600 bytes: more than a chunk goes around the ring
    index, offset = ring.index, ring.offset
    assert torch.equal(ring.upload(big, cpu), big) and (ring.index, ring.offset) == (index, offset)


def test_small_or_cpu_uploads_do_not_touch_a_ring():
    """Below INLINE_BYTES (and whenever the device is the CPU) upload copies directly."""
    data = list(range(INLINE_BYTES // 8 + 10))
    out = upload(data, torch.int64, torch.device("cpu"))
    assert out.tolist() == data and out.dtype == torch.int64
    assert upload([1.5, 2.0], torch.float32, torch.device("cpu")).tolist() == [1.5, 2.0]
