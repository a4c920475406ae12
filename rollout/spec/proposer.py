"""The DFlash / DSpark block drafter behind the engine's `Drafter` interface
(rollout.engine.drafter), and `build_drafter`, the factory `rollout.build_engine` hands the engine.

`BlockDrafter` runs a `DraftModel` (DFlash, or DSpark with its Markov and confidence heads).
Its per-layer context K/V live in a paged cache indexed by the target's own block tables
and slots, so prefix sharing, forks and preemption need no extra bookkeeping: after every
target forward the projected K/V of every processed token are written at that token's
slot. Rejected drafts leave K/V past the committed end; they are never read (the next
block's context stops before its anchor) and are overwritten when that position commits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rollout.engine.attention import AttentionMetadata, gather_kv, write_kv
from rollout.engine.config import EngineConfig
from rollout.engine.drafter import Drafter, Drafts
from rollout.engine.kv import bytes_per_block, copy_blocks
from rollout.engine.loader import LoadedModel, LoadProgress
from rollout.engine.overlap import Pending
from rollout.engine.sampler import PURPOSE_DRAFT, draw_index, uniform
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.transfer import upload, upload_packed
from rollout.engine.truncation import chunk_rows, logsumexp_rows
from rollout.engine.verify import Proposal
from rollout.spec.draft_graphs import MIN_CONTEXT_BUCKET, DraftGraphs
from rollout.spec.draft_loader import checkpoint_files, load_drafter
from rollout.spec.draft_model import DraftModel
from rollout.spec.refresh import DrafterRefresh

GATHER_BYTES = 1 << 30  # the most context K (or V) one draft layer gathers at once


def build_drafter(config: EngineConfig, target: LoadedModel, progress: LoadProgress | None = None) -> BlockDrafter:
    """The drafter model `config.spec` names (`config.draft_kind`), loaded from `config.draft_path` for
    `target` (the engine's drafter factory: see rollout.build_engine); `progress` shows its checkpoint
    reads."""
    path = config.draft_path
    weight = target.model.embed_tokens.weight
    model = load_drafter(path, target, kind=config.draft_kind, block_size=config.spec_block_size,
                         device=weight.device, dtype=weight.dtype, progress=progress)
    drafter = BlockDrafter(model, config.spec_block_size, config.spec_confidence_threshold, name=path.name)
    if config.drafter_refresh != "off":
        drafter.refresh = DrafterRefresh(model, config)
    return drafter

class BlockDrafter(Drafter):
    """DFlash / DSpark: one non-causal forward drafts a whole block."""

    def __init__(self, model: DraftModel, block_size: int | None = None, confidence_threshold: float = 0.0,
                 name: str = ""):
        self.model = model
        self.name = name
        self.block = block_size or model.config.block_size
        self.num_spec = self.block - 1
        self.target_layer_ids = tuple(model.config.target_layer_ids)
        self.threshold = confidence_threshold if model.config.kind == "dspark" else 0.0
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_proposals = 0  # batched propose calls
        self.num_drafted = 0  # draft tokens proposed, after confidence shortening
        self.graphs: DraftGraphs | None = None
        self.refresh: DrafterRefresh | None = None  # online training (--drafter-refresh), rollout.spec.refresh

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def max_model_len(self) -> int:
        # the last anchor sits at max_model_len - 2 and its block reaches block - 1 further
        return self.model.rotary.max_positions - self.block + 2

    def bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.model.config.backbone, block_size, self.model.fc.weight.element_size())

    def allocate(self, num_blocks: int, block_size: int) -> None:
        if self.refresh is not None and self.refresh.buffer is None:
            self.refresh.allocate()
        bb = self.model.config.backbone
        shape = (num_blocks, block_size, bb.num_key_value_heads, bb.head_dim)
        kw = dict(dtype=self.model.fc.weight.dtype, device=self.device)
        self.caches = [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in self.model.layers]

    @torch.inference_mode()
    def update_context(self, target_aux: torch.Tensor, meta: AttentionMetadata) -> None:
        # target_aux: [T, n * Ht] -> per-layer K/V written at the tokens' own slots
        ctx = self.model.project_context(target_aux)
        for (k, v), (k_cache, v_cache) in zip(self.model.context_kv(ctx, meta.positions), self.caches):
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.refresh is not None:
            self.refresh.tap(target_aux)

    def free(self) -> None:
        self.caches, self.graphs = [], None
        if self.refresh is not None:
            self.refresh.free()

    def begin_step(self, items: list[ScheduledSeq]) -> None:
        """A step begins (its drafting): refreshed weights go live here, between steps."""
        if self.refresh is not None:
            self.refresh.begin_step(items)

    def verified(self, items: list[ScheduledSeq], drafts: Drafts, accepted: list[int]) -> None:
        if self.refresh is not None:
            self.refresh.committed(items, drafts, accepted)

    def after_step(self, seconds: float) -> None:
        if self.refresh is not None:
            self.refresh.after_step(seconds)

    def overlaps(self) -> bool:
        return True  # the refresh keeps each step's taps until its commit (rollout.spec.refresh)

    def device_anchors(self) -> bool:
        """Proposes from anchors on the device, except with a confidence cut (its block lengths are read
        back) or a refresh (its buffer keeps each step's rows by their host positions)."""
        return self.threshold == 0 and self.refresh is None

    def idle(self) -> bool:
        return self.refresh is not None and self.refresh.idle()

    def policy_updated(self, version: int) -> None:
        if self.refresh is not None:
            self.refresh.policy_updated(version)

    def checkpoint(self) -> tuple[str, bytes]:
        return checkpoint_files(self.model)

    def stats(self) -> dict[str, float]:
        return {} if self.refresh is None else {f"refresh_{k}": v for k, v in self.refresh.stats.as_dict().items()}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        copy_blocks(self.caches, pairs)

    def use_graphs(self, max_batch: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                   capture: bool) -> None:
        self.graphs = DraftGraphs(self._block_forward, max_batch, max_blocks_per_seq, block_size, scratch_block,
                                  self.device, capture)

    def profile_forward(self, rows: int, scratch_block: int, block_size: int) -> Callable[[], object]:
        """The block forward and a greedy choice from it; the cost model's learned corrections cover
        the rest of a proposal. (Pricing a sampled proposal's draws too, dearer for DSpark, which walks
        its block drawing each position, was measured on the H200 and not kept: DSpark's proposal was
        then priced at 5.8-6.9 ms, greedy steps cost a third of that, and DSpark at temperature 1 did
        not gain; BENCHMARKS.md, issue 19.)"""
        ctx = MIN_CONTEXT_BUCKET
        kw = dict(dtype=torch.int64, device=self.device)
        anchors, anchor_pos = torch.zeros(rows, **kw), torch.full((rows,), ctx, **kw)  # [S], [S]
        table = torch.full((rows, -(-(ctx + self.block) // block_size)), scratch_block, **kw)  # [S, W]
        key = self.graphs.key(rows, ctx) if self.graphs is not None else None

        def run():
            if key is not None:
                return self.graphs.run(key, anchors, anchor_pos, table)[1].argmax(dim=-1)
            return self._block_forward(anchors, anchor_pos, table, ctx)[1].argmax(dim=-1)

        return run

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq], block_table: np.ndarray, pending: Pending | None = None) -> Drafts:
        """`pending`: the items' anchors still on the device (rollout.engine.overlap.Pending): a sample
        with a pending token drafts from it, at its position moved by the shift."""
        self.begin_step(items)
        rows = [i for i, it in enumerate(items) if it.num_draft > 0]
        if not rows:
            return Drafts(torch.zeros(0, dtype=torch.int64, device=self.device), [0] * len(items))
        self.num_proposals += 1
        dev = self.device
        seqs = [items[i].seq for i in rows]
        anchor_pos, anchors, table, index = upload_packed([
            np.asarray([s.num_computed_tokens for s in seqs], dtype=np.int64),
            np.asarray([s.last_token for s in seqs], dtype=np.int64),
            block_table[rows],
            np.asarray(rows if pending is not None else [], dtype=np.int64),
        ], dev)  # [S], [S], [S * W], [S] or [0]
        table = table.view(len(rows), -1)  # [S, W]
        ctx_len = max(s.num_computed_tokens + s.pending_drafts for s in seqs)  # (the longest case)
        if pending is not None:
            anchors = torch.where(pending.has[index], pending.anchor[index], anchors)
            if pending.shift is not None:
                anchor_pos = anchor_pos + pending.shift[index]
        key = self.graphs.key(len(rows), ctx_len) if self.graphs is not None else None
        if key is not None:
            hidden, logits = self.graphs.run(key, anchors, anchor_pos, table)
        else:
            hidden, logits = self._block_forward(anchors, anchor_pos, table, ctx_len)
        drafts, q, keep = self._choose(logits, hidden, anchors, seqs, anchor_pos + 1)
        limit = [items[i].num_draft for i in rows]
        counts = self._lengths(keep, limit)
        self.num_drafted += sum(counts)
        flat, flat_q = _flatten(drafts, q, counts)
        per_item = [0] * len(items)
        for j, i in enumerate(rows):
            per_item[i] = counts[j]
        return Drafts(flat, per_item, flat_q)

    def _block_forward(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, table: torch.Tensor, ctx_len: int):
        """The block forward: anchors, anchor_pos [S]; table [S, W]; keys of the first ctx_len
        positions gathered (those at or past a sequence's anchor position are masked). Returns the
        hidden states [S, B-1, H] and the logits [S, B-1, V] (in the head's dtype) of the drafted
        positions. The sequences go in groups whose gathered context stays within GATHER_BYTES per
        tensor: the gather pads every sequence to ctx_len, so a step's memory would otherwise grow
        as S x the longest context (43 GB per layer at 256 x 40,960 for a Qwen3-8B-shaped drafter)."""
        bb = self.model.config.backbone
        row_bytes = max(ctx_len, 1) * bb.num_key_value_heads * bb.head_dim * self.model.fc.weight.element_size()
        group = max(1, GATHER_BYTES // row_bytes)
        if anchors.shape[0] <= group:
            return self._block_group(anchors, anchor_pos, table, ctx_len)
        parts = [self._block_group(anchors[i:i + group], anchor_pos[i:i + group], table[i:i + group], ctx_len)
                 for i in range(0, anchors.shape[0], group)]
        return torch.cat([h for h, _ in parts]), torch.cat([z for _, z in parts])

    def _block_group(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, table: torch.Tensor, ctx_len: int):
        """`_block_forward` of one group of sequences."""
        ctx_k = [gather_kv(k, table, ctx_len) for k, _ in self.caches]  # each [S, C, Hkv, D]
        ctx_v = [gather_kv(v, table, ctx_len) for _, v in self.caches]
        block_ids = torch.full((anchors.shape[0], self.block), self.model.config.mask_token_id,
                               device=anchors.device)
        block_ids[:, 0] = anchors
        positions = anchor_pos[:, None] + torch.arange(self.block, device=anchors.device)  # [S, B]
        hidden = self.model.block_hidden(block_ids, positions, ctx_k, ctx_v, anchor_pos)[:, 1:]
        return hidden, self.model.head_logits(hidden)

    def _choose(self, logits, hidden, anchors, seqs, first_pos):
        """The drafts from the block's logits [S, B-1, V] (in the head's dtype): greedy samples draft
        the argmax (one-hot q), sampled ones draw from q = softmax(logits / temperature) with their own
        seeded uniforms (`_walk`, replayed from a CUDA graph when the drafter has them: see
        rollout.spec.draft_graphs). Returns drafts [S, B-1], q (a Proposal over [S, B-1] rows, its
        logits q's tempered logits) or None (all one-hot), keep [S, B-1] or None."""
        temps = [s.params.temperature for s in seqs]
        sampled = any(t > 0 for t in temps)
        if not sampled and self.model.config.kind != "dspark":
            return logits.argmax(dim=-1), None, None
        inputs = [logits, hidden if self.threshold > 0 else None, anchors, None, None, None]
        if sampled:
            inputs[3:] = (upload(temps, torch.float32, logits.device),
                          upload([s.seed for s in seqs], torch.int64, logits.device), first_pos)
        key = self.graphs.choice_key(len(seqs), logits, sampled) if self.graphs is not None else None
        if key is not None:
            (drafts, lse, one_hot, keep), z = self.graphs.run_choice(key, self._walk, inputs)
        else:
            inputs[0] = z = logits.float()
            drafts, lse, one_hot, keep = self._walk(*inputs)
        return drafts, Proposal(z, lse, one_hot, drafts) if sampled else None, keep

    def _walk(self, z, hidden, anchors, temps=None, seeds=None, first_pos=None):
        """`_choose` on the device, nothing read back: z [S, B-1, V] float32 becomes q's tempered
        logits in place; hidden [S, B-1, H] (None without a confidence threshold); anchors [S]; for
        a batch that samples, temps (0: greedy), seeds and first_pos [S] (else None). DFlash positions
        are independent, so the whole block is chosen at once; DSpark walks the block left to right,
        adding its Markov bias from the previous token and scoring each position's confidence.
        Returns drafts [S, B-1], logsumexp(z) [S, B-1] and one_hot [S, B-1] (None when nothing is
        sampled), keep [S, B-1] or None."""
        if temps is not None:
            greedy = (temps == 0)[:, None]  # [S, 1]
            temp = torch.where(greedy, 1.0, temps[:, None])  # [S, 1]
            width = z.shape[1]
            positions = first_pos[:, None] + torch.arange(width, device=z.device)  # [S, B-1]
            u = uniform(seeds[:, None].expand(-1, width), positions, PURPOSE_DRAFT)  # [S, B-1]
        if self.model.config.kind != "dspark":
            drafts, lse = _draw(z, temp[:, :, None], greedy, u)
            return drafts, lse, greedy.expand_as(drafts), None
        prev, drafts, lses, conf = anchors, [], [], []
        for i in range(z.shape[1]):
            bias, emb = self.model.markov_bias(prev)
            zi = z[:, i].add_(bias)  # [S, V], in place: these are q's logits
            if hidden is not None:
                conf.append(self.model.confidence(hidden[:, i], emb))
            if temps is None:
                prev = zi.argmax(dim=-1)
            else:
                prev, lse = _draw(zi, temp, greedy[:, 0], u[:, i])
                lses.append(lse)
            drafts.append(prev)
        keep = torch.stack(conf, dim=1) >= self.threshold if conf else None
        drafts = torch.stack(drafts, dim=1)
        if temps is None:
            return drafts, None, None, keep
        return drafts, torch.stack(lses, dim=1), greedy.expand_as(drafts), keep

    @staticmethod
    def _lengths(keep: torch.Tensor | None, limit: list[int]) -> list[int]:
        """Draft length per sample: its limit, cut at the first position below the
        confidence threshold (one small host read, only when a threshold is set)."""
        if keep is None:
            return limit
        run = keep.int().cumprod(dim=1).sum(dim=1).tolist()
        return [min(a, b) for a, b in zip(run, limit)]


def _draw(z: torch.Tensor, temp: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor):
    """Drafts from logits z [..., V], divided by temp in place (so z becomes q's logits): the argmax
    where `greedy` (one-hot q), else an inverse-CDF draw with uniforms u [...] from q = softmax(z).
    temp broadcasts against z, greedy against u. Rows are drawn in chunks (rollout.engine.truncation),
    so the temporaries stay bounded. Returns drafts [...] int64 and logsumexp(z) [...]."""
    z.div_(temp)
    flat = z.flatten(0, -2)  # [N, V], a view
    lse = logsumexp_rows(flat)[:, 0]  # [N]
    u = u.expand(z.shape[:-1]).flatten()  # [N]
    step = chunk_rows(flat.shape[1])
    drawn = torch.cat([draw_index((flat[a:a + step] - lse[a:a + step, None]).exp_(), u[a:a + step])
                       for a in range(0, flat.shape[0], step)])
    return torch.where(greedy, z.argmax(dim=-1), drawn.view(z.shape[:-1])), lse.view(z.shape[:-1])


def _flatten(drafts: torch.Tensor, q: Proposal | None, counts: list[int]):
    """The first counts[j] drafts (and q rows) of every block j, flattened in block order.
    drafts: [S, B-1]; q: over [S, B-1] rows, or None. Returns [D] and q over [D] rows, or None."""
    if q is not None:
        q = Proposal(q.z.reshape(-1, q.z.shape[-1]), q.lse.reshape(-1), q.one_hot.reshape(-1), q.tokens.reshape(-1))
    width = drafts.shape[1]
    if all(k == width for k in counts):  # nothing shortened: the blocks as they are
        return drafts.reshape(-1), q
    index = upload([j * width + i for j, k in enumerate(counts) for i in range(k)], torch.int64, drafts.device)
    return drafts.reshape(-1)[index], (q.select(index) if q is not None else None)
