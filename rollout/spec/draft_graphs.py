"""CUDA graphs of a block drafter's forward: context gather, block layers and head, replayed for a
(batch bucket, context bucket) instead of launching its many small kernels one by one every step.

The block forward of S sequences is a function of three small inputs: each block's anchor token,
the anchor's position (= the sequence's context length) and the block table. They are copied into
static buffers; the context is gathered up to the bucket's length, and keys at or past each
sequence's anchor position are masked by the forward itself, so a longer bucket changes nothing.
Rows past the real batch are padding: anchor position 0 (no context) and the scratch block that
no sequence owns. With `capture=False` the same static-buffer path runs eagerly, which is how it
is tested on CPU (rollout.engine.graphs.capture_graph).

The choice that follows the forward (rollout.spec.proposer: the drafts drawn from the block's logits;
DSpark walks its block position by position, ~20 small kernels a position) has graphs of its own,
one per (batch bucket, sampled or not): its inputs (the logits, the hidden states the confidence
head reads, anchors, and the sampled rows' temperatures, seeds and first positions) are copied into
static buffers and the choice rewrites the logits buffer into q's tempered logits in place. Padded
rows draw from what their rows of the buffers last held (temperatures start at 1): nothing reads
them. A batch whose float32 logits would exceed CHOICE_GRAPH_BYTES chooses eagerly (its kernels are
large enough that launching them costs little, and the buffer would be held for good).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.engine.graphs import BATCH_BUCKETS, StaticOutputs, bucket, capture_graph, context_bucket

MIN_CONTEXT_BUCKET = 64
CHOICE_GRAPH_BYTES = 256 << 20  # the most a choice graph's static float32 logits take


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
        self.num_replays = 0  # block forwards replayed
        self.num_choice_replays = 0
        self.choices: dict[tuple[int, bool], tuple] = {}  # the choice's graphs (see the module docstring)
        self.choice_inputs: list[torch.Tensor | None] | None = None  # its static inputs, made at the first
        self.choice_outputs = StaticOutputs(s)

    def num_graphs(self) -> int:
        """Graphs held: block forwards and choices."""
        return len(self.graphs) + len(self.choices)

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

    def choice_key(self, num_seqs: int, logits: torch.Tensor, sampled: bool) -> tuple[int, bool] | None:
        """(batch bucket, sampled) of a choice over `logits` [S, B-1, V], or None (choose eagerly)."""
        batch = bucket(num_seqs, self.buckets)
        if batch is None or batch * logits.shape[1] * logits.shape[2] * 4 > CHOICE_GRAPH_BYTES:
            return None
        return batch, sampled

    @torch.inference_mode()
    def run_choice(self, key, choose: Callable, inputs: list[torch.Tensor | None]) -> tuple:
        """`choose(*inputs)` replayed: inputs [S, ...] (the first the logits, in any float dtype; None
        where unused) into the static buffers. Returns choose's outputs for the S real rows and the
        logits buffer's rows (as choose left them), views valid until the next replay."""
        s_pad, _ = key
        s = inputs[0].shape[0]
        if self.choice_inputs is None:
            self.choice_inputs = [None] * len(inputs)
        static = self.choice_inputs
        for i, t in enumerate(inputs):  # (a greedy batch's choice leaves the sampling inputs None)
            if t is not None and static[i] is None:
                # the rows of the largest key a choice graph takes
                rows = max(b for b in self.buckets if self.choice_key(b, inputs[0], False) is not None)
                static[i] = _static_like(t, rows, i == 0)
        if key not in self.choices:  # (before the inputs go in: the capture's warm-up runs the choice, in place)
            used = [t is not None for t in inputs]  # (a key's inputs: the same at every call)
            run = lambda: choose(*(b[:s_pad] if u else None for b, u in zip(static, used)))  # noqa: E731
            replay, outputs, self.pool = capture_graph(run, self.capture, self.choice_outputs, self.pool)
            self.choices[key] = replay, *outputs
        for buf, t in zip(static, inputs, strict=True):
            if t is not None:
                buf[:s].copy_(t)
        replay, *outputs = self.choices[key]
        replay()
        self.num_choice_replays += 1
        return tuple(None if o is None else o[:s] for o in outputs), static[0][:s]


def _static_like(t: torch.Tensor, rows: int, logits: bool) -> torch.Tensor:
    """A static input buffer of `rows` rows shaped like t's (float32 for the logits): zeros, but
    temperatures (a float vector) ones, so that padded rows divide by 1."""
    shape = (rows, *t.shape[1:])
    if logits:
        return torch.zeros(shape, dtype=torch.float32, device=t.device)
    fill = 1 if t.dtype.is_floating_point and t.dim() == 1 else 0
    return torch.full(shape, fill, dtype=t.dtype, device=t.device)
