"""CUDA graphs for decode and verify steps.

A decode or verify step (every sequence computing at most `max_q` tokens: 1 for plain decode, up to
K+1 for a verify block) replays a graph captured for a key (rows, q, context bucket, shared, tokens)
(`padded_shape`), `shared` saying whether the step reads shared prefixes once per group (its plan,
prefix_plan.py, lives in static buffers sized by the padded token count, so the key takes no more of
it). Inputs are copied into static buffers; rows past the real batch are padding rows that read and
write a scratch KV block no sequence owns, so they can never touch real cache entries, and whose
outputs are never returned (so never committed).
* A uniform step (every sequence q tokens) pads its rows to the batch bucket, each padded row q
  tokens: key (bucket, q, ctx, shared, bucket * q).
* A ragged step (sequences of different lengths: the draft budget verifies some drafts of some
  samples, DSpark shortens blocks, a short prefill chunk rides along) pads its tokens to the batch
  bucket times a step of TOKEN_STEPS, the padding tokens going to padding rows of at most q tokens
  each after the real ones (so the real tokens keep their places): a few padding rows more than
  the bucket when the batch fills it. Its q is `max_q` (one graph for every mix of block lengths),
  or with a shared-prefix plan the step's own longest query (the plan's launch depends on it).
So the keys of a (context bucket, shared) pair number at most buckets x (max_q + steps) without a
shared-prefix plan, buckets x max_q x (1 + steps) with one, `steps` being the TOKEN_STEPS up to
max_q (12 buckets, max_q 16, 10 steps: 312 and 2,112; a run meets a few of them).
A padded row is a well-formed sequence of at most q tokens with context q, so each of its queries
sees at least one key (a query seeing none would make a NaN that reaches the drafter's context
through the scratch block). A step with a longer query (a prefill chunk) runs eagerly. With
`capture=False` the same static-buffer path runs eagerly, which is how the padding is tested on CPU.

Every graph of a set writes its outputs into the set's one `StaticOutputs` (a replay's outputs are
read before the next replay): a graph's private memory is then its working set, shared with the
set's other graphs, and not also its outputs, so the pool stays one forward's working set however
many keys get captured, which is what the engine's memory plan reserves
(rollout/engine/profile.py).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import numpy as np
import torch

from rollout.engine.attention import AttentionMetadata
from rollout.engine.prefix_attention import StaticSharedPrefix
from rollout.engine.prefix_plan import SharedPrefixPlanner

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
# a ragged step's padded tokens, in tokens per row of its batch bucket
TOKEN_STEPS = (1, 1.25, 1.5, *(m for k in range(12) for m in (2 << k, 3 << k)))


def bucket(n: int, buckets) -> int | None:
    """The smallest bucket >= n, or None (`buckets` increasing)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def context_bucket(length: int, minimum: int) -> int:
    """A context length rounded up to a power of two, at least `minimum`."""
    return max(minimum, 1 << max(length - 1, 0).bit_length())


@functools.lru_cache(maxsize=256)
def token_marks(batch: int, q: int) -> np.ndarray:
    """[M] the token counts a ragged step of batch bucket `batch` and query length q pads to:
    ceil(batch x step) for the TOKEN_STEPS below q, then batch x q. Read-only (kept per (batch, q):
    every ragged step and every budget choice asks)."""
    marks = np.ceil(batch * np.asarray([m for m in TOKEN_STEPS if m < q] + [q], dtype=np.float64)).astype(np.int64)
    marks.setflags(write=False)
    return marks


def padded_shape(rows: int, tokens: int, q: int, buckets) -> tuple[int, int] | None:
    """(rows, tokens) of the graph that replays a step of `rows` sequences of at most q tokens each,
    `tokens` in all (see the module docstring), or None past the largest bucket. A ragged step's
    padding rows (at most q tokens each) hold the padding tokens of a full batch bucket: a third of
    the bucket at most (TOKEN_STEPS grow by at most a third of a step; the last one, q, likewise)."""
    batch = bucket(rows, buckets)
    if batch is None or rows * q == tokens:
        return None if batch is None else (batch, batch * q)
    marks = token_marks(batch, q)
    i = int(np.searchsorted(marks, tokens))  # the first mark >= tokens
    padded = int(marks[i])
    fewest = int(marks[i - 1]) + 1 if i else padded  # the fewest tokens a full bucket pads to `padded`
    return batch + -(-(padded - fewest) // q), padded


def graph_shape(max_num_seqs: int, max_tokens: int, max_q: int, buckets: tuple[int, ...]) -> tuple[int, int]:
    """(sequences, q) of the uniform step whose graph has the most padded tokens: what the memory
    profile measures (rollout.engine.profile), so no graph may have more (`StepGraphs.max_tokens`)."""
    best = (0, 1, 1)
    for q in range(1, max_q + 1):
        s = min(max_num_seqs, buckets[-1], max_tokens // q)
        if s >= 1 and bucket(s, buckets) * q > best[0]:
            best = (bucket(s, buckets) * q, s, q)
    return best[1], best[2]


class StepGraphs:
    def __init__(self, forward: Callable, scratch_block: int, block_size: int, max_blocks_per_seq: int,
                 max_q: int, device: torch.device, capture: bool = True, max_batch: int = 256,
                 prefix_planner: SharedPrefixPlanner | None = None, max_num_batched_tokens: int | None = None):
        # forward(input_ids [T], meta) -> (hidden [T, H], aux [T, n*H] | None)
        self.forward = forward
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.capture = capture
        self.buckets = tuple(b for b in BATCH_BUCKETS if b <= max_batch)
        t = self.buckets[-1] * max_q
        s = self.buckets[-1] + self.buckets[-1] // 3 + 1  # the largest bucket and its padding rows
        kw = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(t, **kw)  # [T_max]
        self.positions = torch.zeros(t, **kw)
        self.slot_mapping = torch.full((t,), self.scratch_slot, **kw)
        self.cu_seqlens = torch.arange(s + 1, **kw)  # [S_max + 1]
        self.row_index = torch.arange(s + 1, **kw)  # [S_max + 1] constant
        self.context_lens = torch.ones(s, **kw)  # [S_max]
        self.block_tables = torch.full((s, max_blocks_per_seq), scratch_block, **kw)
        self.shared = StaticSharedPrefix(prefix_planner, t, device) if prefix_planner is not None else None
        self.max_q = max_q
        # the most tokens a graph may pad to: the largest uniform graph, which the memory profile measures
        # (a ragged step that would pad past it runs eagerly); None: bounded by the buffers alone
        self.max_tokens = None
        if max_num_batched_tokens is not None:
            rows, q = graph_shape(max_batch, max_num_batched_tokens, max_q, self.buckets)
            self.max_tokens = bucket(rows, self.buckets) * q
        self.outputs = StaticOutputs(t)
        self.graphs: dict[tuple[int, int, int, bool, int], tuple] = {}
        self.pool = None
        self.num_replays = 0

    def key(self, meta: AttentionMetadata) -> tuple[int, int, int, bool, int] | None:
        """(rows, q, context bucket, shared, tokens) of the graph that replays this step, or None
        (a query longer than max_q, a batch or context past the largest bucket, or padding past
        `max_tokens`: run it eagerly)."""
        s, t, q = meta.num_seqs, meta.slot_mapping.shape[0], meta.max_query_len
        shared = meta.shared is not None
        ctx = context_bucket(meta.max_context_len, 256)
        if q > self.max_q or -(-ctx // self.block_size) > self.block_tables.shape[1]:
            return None
        if s * q != t and not shared:  # ragged: one q for every mix of lengths
            q = self.max_q
        shape = padded_shape(s, t, q, self.buckets)
        if shape is None or (self.max_tokens is not None and shape[1] > self.max_tokens):
            return None
        return shape[0], q, ctx, shared, shape[1]

    @torch.inference_mode()
    def run(self, key, input_ids: torch.Tensor, meta: AttentionMetadata):
        rows, q, ctx, shared, t_pad = key
        s, t = meta.num_seqs, input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(meta.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:t_pad].fill_(self.scratch_slot)
        self.positions[t:t_pad].fill_(0)
        self.cu_seqlens[: s + 1].copy_(meta.cu_seqlens_q)
        # padding rows: q tokens each (the last one the rest, any after it none) up to t_pad
        self.cu_seqlens[s + 1: rows + 1] = (self.row_index[1: rows - s + 1] * q + t).clamp_(max=t_pad)
        self.context_lens[:s].copy_(meta.context_lens)
        self.context_lens[s:rows].fill_(q)  # a padded row's queries see keys 0..j of the scratch block
        width = meta.block_tables.shape[1]
        self.block_tables[:s, :width].copy_(meta.block_tables)
        self.block_tables[s:rows].fill_(self.scratch_block)
        if shared:
            self.shared.load(meta.shared, t_pad)
        if key not in self.graphs:
            self.graphs[key] = self._build(key)
        replay, hidden, aux = self.graphs[key]
        replay()
        self.num_replays += 1
        return hidden[:t], (aux[:t] if aux is not None else None)

    def _static_meta(self, key) -> AttentionMetadata:
        rows, q, ctx, shared, t_pad = key
        return AttentionMetadata(
            positions=self.positions[:t_pad], slot_mapping=self.slot_mapping[:t_pad],
            cu_seqlens_q=self.cu_seqlens[: rows + 1], context_lens=self.context_lens[:rows],
            block_tables=self.block_tables[:rows], max_query_len=q, max_context_len=ctx, block_size=self.block_size,
            shared=self.shared.plan(t_pad, q) if shared else None)

    def _build(self, key):
        t_pad = key[4]
        run = lambda: self.forward(self.input_ids[:t_pad], self._static_meta(key))  # noqa: E731
        replay, (hidden, aux), self.pool = capture_graph(run, self.capture, self.outputs, self.pool)
        return replay, hidden, aux


class StaticOutputs:
    """Output buffers shared by the graphs of one set: `store(results)` copies each result ([n, ...]
    or None) into the first n rows of its buffer ([rows, ...], made at the first store, which
    `capture_graph` makes outside any capture) and returns those views."""

    def __init__(self, rows: int):
        self.rows = rows
        self.buffers: tuple | None = None

    def store(self, results: tuple) -> tuple:
        if self.buffers is None:
            self.buffers = tuple(None if r is None else r.new_empty((self.rows, *r.shape[1:])) for r in results)
        return tuple(None if r is None else b[: r.shape[0]].copy_(r)
                     for b, r in zip(self.buffers, results, strict=True))


def capture_graph(run: Callable, capture: bool, outputs: StaticOutputs, pool=None):
    """(replay, outputs, pool) for `run() -> tuple of tensors or None`: a CUDA graph whose replay
    rewrites `outputs` (views of the set's StaticOutputs) in place, or with `capture=False` an
    eager stand-in (CPU tests) that re-runs `run` and stores into the same buffers."""
    if not capture:
        views = outputs.store(run())
        return lambda: outputs.store(run()), views, pool
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outputs.store(run())  # warm-up: lazy tables (RoPE), Triton compilations and the buffers before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a weight update staging on another thread (copies, allocations) must not break
    # a capture in progress (the default "global" mode makes such calls fail the capture)
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        views = outputs.store(run())
    return graph.replay, views, graph.pool()
