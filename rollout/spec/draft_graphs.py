"""CUDA graphs of a block drafter's forward: context gather, block layers and head, replayed for a
(batch bucket, context bucket) instead of launching its many small kernels one by one every step.

The block forward of S sequences is a function of three small inputs: each block's anchor token,
the anchor's position (= the sequence's context length) and the block table. They are copied into
static buffers; the context is gathered up to the bucket's length, and keys at or past each
sequence's anchor position are masked by the forward itself, so a longer bucket changes nothing.
Rows past the real batch are padding: anchor position 0 (no context) and the scratch block that
no sequence owns. With `capture=False` the same static-buffer path runs eagerly, which is how it
is tested on CPU (rollout.engine.graphs.capture_graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.engine.graphs import BATCH_BUCKETS, StaticOutputs, bucket, capture_graph, context_bucket

MIN_CONTEXT_BUCKET = 64


class DraftGraphs:
    def __init__(self, forward: Callable, max_batch: int, max_blocks_per_seq: int, block_size: int,
                 scratch_block: int, device: torch.device, capture: bool = True):
        # forward(anchors [S], anchor_pos [S], table [S, W], ctx_len: int) -> (hidden [S, B-1, H], logits)
        self.forward = forward
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture = capture
        self.buckets = tuple(b for b in BATCH_BUCKETS if b <= max_batch) or (BATCH_BUCKETS[0],)
        s = self.buckets[-1]
        self.anchors = torch.zeros(s, dtype=torch.int64, device=device)
        self.anchor_pos = torch.zeros(s, dtype=torch.int64, device=device)
        self.table = torch.full((s, max_blocks_per_seq), scratch_block, dtype=torch.int64, device=device)
        self.outputs = StaticOutputs(s)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None
        self.num_replays = 0

    def key(self, num_seqs: int, ctx_len: int) -> tuple[int, int] | None:
        """(batch bucket, context bucket), or None when the step does not fit (run it eagerly)."""
        batch = bucket(num_seqs, self.buckets)
        ctx = context_bucket(ctx_len, MIN_CONTEXT_BUCKET)
        if batch is None or -(-ctx // self.block_size) > self.table.shape[1]:
            return None
        return batch, ctx

    @torch.inference_mode()
    def run(self, key, anchors: torch.Tensor, anchor_pos: torch.Tensor, table: torch.Tensor):
        """anchors, anchor_pos: [S]; table: [S, W] on the device. Returns the forward's outputs
        for the S real rows (views of the graph's output buffers, valid until the next replay)."""
        s_pad, _ = key
        s, width = anchors.shape[0], table.shape[1]
        self.anchors[:s].copy_(anchors)
        self.anchor_pos[:s].copy_(anchor_pos)
        self.anchor_pos[s:s_pad].fill_(0)
        self.table[:s, :width].copy_(table)
        self.table[s:s_pad].fill_(self.scratch_block)
        if key not in self.graphs:
            self.graphs[key] = self._build(key)
        replay, *outputs = self.graphs[key]
        replay()
        self.num_replays += 1
        return tuple(o[:s] for o in outputs)

    def _build(self, key):
        s_pad, ctx = key
        run = lambda: self.forward(self.anchors[:s_pad], self.anchor_pos[:s_pad], self.table[:s_pad], ctx)  # noqa: E731
        replay, outputs, self.pool = capture_graph(run, self.capture, self.outputs, self.pool)
        return replay, *outputs
