"""CUDA graphs for uniform decode and verify steps.

A step where every sequence computes the same number of tokens q (1 for plain decode, K+1
for a verify block) replays a graph captured for (batch bucket, q, context bucket, shared),
`shared` saying whether the step reads shared prefixes once per group (its plan, prefix_plan.py,
lives in static buffers sized by the padded token count, so the key takes no more of it). Inputs
are copied into static buffers; rows past the real batch are padding that reads and writes a
scratch KV block no sequence owns, so they can never touch real cache entries. A padded row is a
well-formed sequence of q tokens with context q, so each of its queries sees at least one key (a
query seeing none would make a NaN that reaches the drafter's context through the scratch
block). Prefill and
ragged steps run eagerly. With `capture=False` the same static-buffer path runs eagerly, which
is how the padding is tested on CPU.

Every graph of a set writes its outputs into the set's one `StaticOutputs` (a replay's outputs are
read before the next replay): a graph's private memory is then its working set, shared with the
set's other graphs, and not also its outputs, so the pool stays one forward's working set however
many (batch, q, context) keys get captured, which is what the engine's memory plan reserves
(rollout/engine/profile.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.engine.attention import AttentionMetadata
from rollout.engine.prefix_attention import StaticSharedPrefix
from rollout.engine.prefix_plan import SharedPrefixPlanner

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def bucket(n: int, buckets) -> int | None:
    """The smallest bucket >= n, or None."""
    return next((b for b in buckets if b >= n), None)


def context_bucket(length: int, minimum: int) -> int:
    """A context length rounded up to a power of two, at least `minimum`."""
    return max(minimum, 1 << max(length - 1, 0).bit_length())


class StepGraphs:
    def __init__(self, forward: Callable, scratch_block: int, block_size: int, max_blocks_per_seq: int,
                 max_q: int, device: torch.device, capture: bool = True, max_batch: int = 256,
                 prefix_planner: SharedPrefixPlanner | None = None):
        # forward(input_ids [T], meta) -> (hidden [T, H], aux [T, n*H] | None)
        self.forward = forward
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.capture = capture
        self.buckets = tuple(b for b in BATCH_BUCKETS if b <= max_batch)
        s, t = self.buckets[-1], self.buckets[-1] * max_q
        kw = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(t, **kw)  # [T_max]
        self.positions = torch.zeros(t, **kw)
        self.slot_mapping = torch.full((t,), self.scratch_slot, **kw)
        self.context_lens = torch.ones(s, **kw)  # [S_max]
        self.block_tables = torch.full((s, max_blocks_per_seq), scratch_block, **kw)
        self.shared = StaticSharedPrefix(prefix_planner, t, device) if prefix_planner is not None else None
        self.max_q = max_q
        self.outputs = StaticOutputs(t)
        self.graphs: dict[tuple[int, int, int], tuple] = {}
        self.pool = None
        self.num_replays = 0

    def key(self, meta: AttentionMetadata) -> tuple[int, int, int, bool] | None:
        """(batch bucket, q, context bucket, shared) when the step is uniform and fits, else None."""
        s, t = meta.num_seqs, meta.slot_mapping.shape[0]
        q = meta.max_query_len
        if q > self.max_q or s * q != t:
            return None
        batch = bucket(s, self.buckets)
        ctx = context_bucket(meta.max_context_len, 256)
        if batch is None or -(-ctx // self.block_size) > self.block_tables.shape[1]:
            return None
        return batch, q, ctx, meta.shared is not None

    @torch.inference_mode()
    def run(self, key, input_ids: torch.Tensor, meta: AttentionMetadata):
        s_pad, q, ctx, shared = key
        s, t = meta.num_seqs, input_ids.shape[0]
        t_pad = s_pad * q
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(meta.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:t_pad].fill_(self.scratch_slot)
        self.positions[t:t_pad].fill_(0)
        self.context_lens[:s].copy_(meta.context_lens)
        self.context_lens[s:s_pad].fill_(q)  # a padded row's q queries see keys 0..j of the scratch block
        width = meta.block_tables.shape[1]
        self.block_tables[:s, :width].copy_(meta.block_tables)
        self.block_tables[s:s_pad].fill_(self.scratch_block)
        if shared:
            self.shared.load(meta.shared, t_pad)
        if key not in self.graphs:
            self.graphs[key] = self._build(key)
        replay, hidden, aux = self.graphs[key]
        replay()
        self.num_replays += 1
        return hidden[:t], (aux[:t] if aux is not None else None)

    def _static_meta(self, key) -> AttentionMetadata:
        s_pad, q, ctx, shared = key
        t_pad = s_pad * q
        return AttentionMetadata(
            positions=self.positions[:t_pad], slot_mapping=self.slot_mapping[:t_pad],
            cu_seqlens_q=torch.arange(0, t_pad + 1, q, device=self.positions.device),
            context_lens=self.context_lens[:s_pad], block_tables=self.block_tables[:s_pad],
            max_query_len=q, max_context_len=ctx, block_size=self.block_size,
            shared=self.shared.plan(t_pad, q) if shared else None)

    def _build(self, key):
        t_pad = key[0] * key[1]
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
    with torch.cuda.graph(graph, pool=pool):
        views = outputs.store(run())
    return graph.replay, views, graph.pool()
