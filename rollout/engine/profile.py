"""The largest steps a configuration admits, run at startup on dummy sequences through the engine's
own step path (drafter, forward, logits, the policy, verification, mask capture) before
the KV pool exists, to measure their memory on CUDA (rollout/engine/memory.py sizes the pool from
it), the way vLLM and SGLang profile a dummy forward.

The steps: `max_rows` = min(max_num_batched_tokens, max_num_seqs x (num_spec + 1)) logits rows
(the scheduler's bound) as decode items carrying all their drafts (a drafter that proposes fewer,
a history drafter for sequences it never saw, has them padded: `_full_blocks`); and, when those leave part of
the token budget, max_num_seqs - 1 of them next to prefill chunks that use it all (the forward's
largest activations; the torch attention path pads every sequence to the longest chunk). The
items end at context max_model_len (the torch path and a drafter gather each sequence's context
to the longest), but for the second and later prefill chunks, which would only add attention work.
The sampling rows are as costly as a request can make them: after one forward the policy runs once
per kind of row (top_k at max_mask_tokens with top_p, min_p, penalties, a logit bias, min_tokens, a
grammar bitmask and support masks; top_p alone; no truncation; the three mixed), on flat logits,
which make every top-p row need the whole vocabulary. Whatever `policy` allocates for them is
measured, not assumed. The dummy block tables cycle through a few scratch blocks: the kernels'
shapes, not the cache's contents, set the memory.

CUDA graphs: each graph set (the target's, the drafter's) runs its static-buffer path eagerly at its
largest key; that peak, plus its buffers, is what its pool will hold (see rollout/engine/graphs.py).
"""

from __future__ import annotations

import contextlib
import math

import torch

from rollout.engine.batch import build_step, padded_block_table
from rollout.engine.block_manager import BlockManager
from rollout.engine.drafter import Drafts
from rollout.engine.graphs import graph_shape
from rollout.engine.intake import new_sequence
from rollout.engine.kv import allocate_kv
from rollout.engine.memory import DeviceMemory
from rollout.engine.params import SamplingParams
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.verify import Proposal
from rollout.errors import InvalidArgument

PROFILE_BLOCKS = 4  # the dummy sequences' blocks (and one scratch block after them)
ROWS, TOKENS, GRAPHS, DRAFT_GRAPHS = "max_num_seqs", "max_num_batched_tokens", "cuda_graphs", "draft_graphs"
KINDS = ("masked", "top_p", "plain", "mixed")  # the policy's runs on the largest rows step (row_kinds)

Shape = tuple[int, int]  # an item's (tokens this step, of which drafts); drafts 0 and tokens > 1: a prefill chunk


def step_shapes(max_num_seqs: int, max_tokens: int, num_spec: int, max_model_len: int) -> dict[str, list[Shape]]:
    """The largest steps: {ROWS: decode items with all their drafts up to max_rows rows, TOKENS (when
    those leave tokens over): as many of them as leave room for prefill chunks of the rest}."""
    q = num_spec + 1
    rows, left = [], min(max_tokens, max_num_seqs * q)
    while left > 0:
        rows.append((min(q, left), min(q, left) - 1))
        left -= rows[-1][0]
    shapes = {ROWS: rows}
    if max_num_seqs * q < max_tokens:
        decode = max_num_seqs - 1
        while decode > 0 and (max_num_seqs - decode) * max_model_len < max_tokens - decode * q:
            decode -= 1  # the prefill chunks (each at most max_model_len) need more sequences
        chunks, left = [], max_tokens - decode * q
        while left > 0 and decode + len(chunks) < max_num_seqs:
            chunks.append((min(left, max_model_len), 0))
            left -= chunks[-1][0]
        shapes[TOKENS] = [(q, num_spec)] * decode + chunks
    return shapes


def row_kinds(vocab_size: int, max_mask_tokens: int) -> dict[str, list[tuple[SamplingParams, str | None, bool]]]:
    """The policy's runs: per kind of row, its (params, mask, grammar) cycled over the entries."""
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
    masked = (SamplingParams(top_k=min(max_mask_tokens, vocab_size), top_p=0.95, min_p=0.05, logit_bias={0: 1.0},
                             min_tokens=1, stop_token_ids=[0], **penalties), "support", True)
    top_p = (SamplingParams(top_p=0.95, **penalties), None, True)
    plain = (SamplingParams(), None, False)
    return dict(zip(KINDS, ([masked], [top_p], [plain], [masked, top_p, plain]), strict=True))


class AllowAll:
    """A grammar state that allows every token: the bitmask is built and applied at full size."""

    def fill_verify_bitmask(self, draft_tokens, bitmask, first_row) -> None:
        return None


class PeakMeter:
    """torch.cuda's one peak counter shared out: per section name, the most allocated above what was
    allocated when the section began (the largest of its runs)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def section(self, name: str):
        torch.cuda.synchronize(self.device)
        start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        except torch.cuda.OutOfMemoryError as exc:
            setting = GRAPHS if name == DRAFT_GRAPHS else name
            raise InvalidArgument(setting, f"the largest step it admits ran out of device memory next to the "
                                           f"weights while it was profiled ({exc}): lower {setting}") from None
        torch.cuda.synchronize(self.device)
        self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated(self.device) - start)


def measure(engine, max_model_len: int) -> DeviceMemory:
    """Runs the profile on the engine's CUDA device and reads what it needs (see the module)."""
    meter = PeakMeter(engine.device)
    run_largest_steps(engine, max_model_len, meter, graphs=engine.config.cuda_graphs)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(engine.device)
    peaks = meter.peaks
    setting = max((s for s in (ROWS, TOKENS) if s in peaks), key=peaks.get)
    graphs = sum(peaks.get(s, 0) for s in (GRAPHS, DRAFT_GRAPHS, "graph_buffers"))
    return DeviceMemory(total=total, held=total - free, step=peaks[setting], graphs=graphs, step_setting=setting)


def run_largest_steps(engine, max_model_len: int, meter, graphs: bool) -> None:
    """The profile's steps, each inside `meter.section(name)`, with the graph sets' (`graphs`) on a
    scratch KV pool; the engine is left as it was (before its pool exists, or after: tests)."""
    config, drafter = engine.config, engine.drafter
    num_spec = drafter.num_spec if drafter else 0
    saved = _save(engine)
    engine.graphs = None
    if drafter is not None:
        drafter.graphs = None
    engine.kv_caches = allocate_kv(engine.loaded.config, PROFILE_BLOCKS + 1, config.block_size, engine.device,
                                   engine.model.embed_tokens.weight.dtype)
    if drafter is not None:
        drafter.allocate(PROFILE_BLOCKS + 1, config.block_size)
    try:
        with _flat_logits(engine.model):
            shapes = step_shapes(config.max_num_seqs, config.max_num_batched_tokens, num_spec, max_model_len)
            for name, items in shapes.items():
                with meter.section(name):
                    run_step(engine, items, max_model_len, list(KINDS) if name == ROWS else ["mixed"])
            if graphs:
                _run_graphs(engine, max_model_len, meter)
    finally:
        _restore(engine, saved)


def run_step(engine, shapes: list[Shape], context: int, kinds: list[str]) -> None:
    """One dummy step of items `shapes`, each ending at `context` but prefill chunks after the first
    (they start at 0: every kernel's shapes are the same, the attention work far less): the drafter
    and the forward, then the policy once per kind of row in `kinds` (see row_kinds)."""
    chunks = [i for i, (tokens, drafts) in enumerate(shapes) if tokens > 1 and not drafts]
    items = [_item(engine, i, tokens, drafts, tokens if i in chunks[1:] else context)
             for i, (tokens, drafts) in enumerate(shapes)]
    table = padded_block_table([it.seq.block_table for it in items])
    drafts = _full_blocks(engine._draft(items, table), [it.num_draft for it in items], engine.vocab_size)
    step = build_step(items, drafts.num_per_item, engine.config.block_size, engine.device, table,
                      engine.prefix_planner)
    every = row_kinds(engine.vocab_size, engine.config.max_mask_tokens)
    with torch.inference_mode():
        hidden = engine._forward_step(step, drafts)
        for name in kinds:
            cycle = every[name]
            for e, seq in enumerate(step.rows.entries):
                seq.params, seq.mask, grammar = cycle[e % len(cycle)]
                seq.grammar = AllowAll() if grammar else None
                seq.mask_bound = seq.params.support_bound if seq.mask else 0
            engine._sample(step, drafts, hidden)
        del hidden, drafts, step


def _full_blocks(drafts: Drafts, wanted: list[int], vocab: int) -> Drafts:
    """The drafter's proposal padded to the drafts each item asked for: a drafter may propose fewer
    (a history drafter without history, a confidence threshold), and the step's peak is that of full
    blocks. Padding drafts are token 0, drawn (when the proposal has distributions) from a uniform q."""
    if drafts.num_per_item == wanted:
        return drafts
    tokens = drafts.tokens.new_zeros(sum(wanted))  # [D]
    own = torch.zeros(sum(wanted), dtype=torch.bool, device=tokens.device)  # [D] the drafter's drafts
    at, start = 0, 0
    for got, want in zip(drafts.num_per_item, wanted):
        own[at:at + got] = True
        tokens[at:at + got] = drafts.tokens[start:start + got]
        at, start = at + want, start + got
    q = drafts.q
    if q is not None:
        z = q.z.new_zeros(len(tokens), vocab)  # [D, V] uniform
        z[own] = q.z
        lse = torch.full((len(tokens),), math.log(vocab), dtype=q.lse.dtype, device=tokens.device)  # [D]
        lse[own] = q.lse
        one_hot = torch.zeros_like(own)
        one_hot[own] = q.one_hot
        q = Proposal(z, lse, one_hot, tokens)
    return Drafts(tokens, wanted, q, drafts.proposers)


def _item(engine, i: int, tokens: int, drafts: int, context: int) -> ScheduledSeq:
    """A dummy sequence whose step computes `tokens` (`drafts` of them drafts) ending at `context`."""
    decode = drafts > 0 or tokens == 1
    prompt = [1] * (context - tokens + 1 if decode else context)
    params, mask, _ = row_kinds(engine.vocab_size, engine.config.max_mask_tokens)["mixed"][0]
    seq = new_sequence(i + 1, engine.eos_token_ids, request_id="profile", prompt_index=0, sample_index=i,
                       prompt_token_ids=prompt, params=params, seed=i, mask=mask, grammar=None)
    seq.num_computed_tokens = context - tokens
    bs = engine.config.block_size
    seq.block_table = [b % PROFILE_BLOCKS for b in range(-(-context // bs))]
    return ScheduledSeq(seq, 1 if decode else tokens, drafts)


def _run_graphs(engine, max_model_len: int, meter) -> None:
    """Each graph set's static path at its largest key (eagerly: its peak is what its pool holds)."""
    config = engine.config
    engine.max_model_len = max_model_len
    engine.block_manager = BlockManager(PROFILE_BLOCKS, config.block_size)  # the scratch block's id
    with meter.section("graph_buffers"):
        engine.graphs = engine.make_step_graphs(capture=False)
    graphs, draft_graphs = engine.graphs, getattr(engine.drafter, "graphs", None)
    width = graphs.block_tables.shape[1] * config.block_size
    context = min(max_model_len, 1 << (width.bit_length() - 1))  # the largest context bucket a graph takes
    s, q = graph_shape(config.max_num_seqs, config.max_num_batched_tokens, graphs.max_q, graphs.buckets)
    steps = [[(q, q - 1)] * s]
    _metered(meter, GRAPHS, graphs)
    if draft_graphs is not None:  # the drafter's largest batch: one draft each
        steps.append([(2, 1)] * min(config.max_num_seqs, draft_graphs.buckets[-1],
                                    config.max_num_batched_tokens // 2))
        _metered(meter, DRAFT_GRAPHS, draft_graphs)
    for shapes in steps:  # the forwards only: the policy's memory is the largest steps' above
        if shapes and context > q:
            run_step(engine, shapes, context, kinds=[])


def _metered(meter, name: str, graphs) -> None:
    """The set's replays (`run`, and a drafter's `run_choice`) inside `meter.section(name)`."""
    for method in ("run", "run_choice"):
        run = getattr(graphs, method, None)
        if run is not None:
            setattr(graphs, method, _in_section(meter, name, run))


def _in_section(meter, name: str, run):
    def metered(*args):
        with meter.section(name):
            return run(*args)

    return metered


@contextlib.contextmanager
def _flat_logits(model):
    """Every logits row flat: the policy's worst case (a top-p row needs the whole vocabulary)."""
    real = model.compute_logits
    model.compute_logits = lambda hidden: real(hidden).zero_()
    try:
        yield
    finally:
        del model.compute_logits


_ENGINE_STATE = ("kv_caches", "graphs", "block_manager", "max_model_len")
_DRAFTER_STATE = ("caches", "graphs", "num_proposals", "num_drafted")


def _save(engine) -> dict:
    """What the profile replaces or counts on the engine and its drafter (absent: None)."""
    parts = engine.drafter.parts() if engine.drafter is not None else []
    return dict(engine={k: getattr(engine, k, None) for k in _ENGINE_STATE},
                drafters=[(d, {k: getattr(d, k) for k in _DRAFTER_STATE if hasattr(d, k)}) for d in parts],
                captures=engine.capture.num_captures)


def _restore(engine, saved: dict) -> None:
    for k, v in saved["engine"].items():
        setattr(engine, k, v)
    for drafter, state in saved["drafters"]:
        for k, v in state.items():
            setattr(drafter, k, v)
    engine.capture.num_captures = saved["captures"]
