"""The engine: requests in, finished samples out. `step()` is the table of contents.

    (a drained weight update) -> schedule (with the draft budget) -> draft -> build -> forward
    -> policy -> verify -> capture (`_launch`) -> [overlap: launch the next step] -> (last step's
    masks) -> sync -> count drafts -> advance (scheduler) -> commit/emit (committer) -> truncate
    drafts (scheduler) -> verified (drafter) -> record (draft budget) (`_finish`)

One step is one target forward over a ragged batch (prefill chunks, decode anchors and draft
blocks mixed), one policy (docs/sampling.md) over the rows that sample, one verification
(docs/verification.md), one host synchronisation. With overlapped scheduling (`overlap`, on by
default; docs/overlap.md, rollout.engine.overlap) step n+1 is scheduled, built and launched before
step n's synchronisation: it assumes each sample of n commits one token, filled into its inputs on
the device (after a drafted step, its positions too move by the drafts accepted there, and DFlash
/ DSpark draft from those anchors on the device); slots of samples that finished meanwhile are
discarded. Steps that need the previous step's tokens on the host (grammar samples, a draining
weight update, drafts of a drafter that needs host anchors) run synchronously or are held until
the sync. The engine
is single-threaded: the server calls it from one loop. Its parts get what they need as arguments
(the scheduler its block manager, the intake and the committer the scheduler, the weight updater
the modules it loads into); the drafter comes from a factory (rollout.engine.drafter), so the
engine imports none.

With a drafter, the scheduler's draft budget (spec_budget.py, `--no-spec-adaptive` turns it off)
decides each step how many drafts of each sample to verify, from the acceptance each sample has
shown and what steps cost here (step_cost.py: profiled at startup, then each step's wall time).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import numpy as np
import torch

from rollout.engine import memory, overlap, triton_ops, triton_prefix_attention
from rollout.engine.batch import StepBatch, build_step, padded_block_table
from rollout.engine.block_manager import BlockManager
from rollout.engine.capture import MaskCapture
from rollout.engine.commit import Committer, HostStep
from rollout.engine.config import EngineConfig
from rollout.engine.drafter import DraftCounts, Drafter, Drafts
from rollout.engine.engine_memory import EngineMemory
from rollout.engine.graphs import StepGraphs
from rollout.engine.intake import Intake, Limits
from rollout.engine.kv import copy_blocks
from rollout.engine.loader import LoadedModel, LoadProgress, load_model
from rollout.engine.overlap import Launched, Pipeline
from rollout.engine.prefix_plan import planner_for
from rollout.engine.release import ReleasedMemory
from rollout.engine.rows import build_row_params, grammar_bitmask
from rollout.engine.sampler import policy
from rollout.engine.scheduler import ScheduledSeq, Scheduler
from rollout.engine.spec_budget import SpecBudget
from rollout.engine.step_cost import StepCost, profile_step_cost
from rollout.engine.verify import verify
from rollout.engine.weights import WeightUpdater
from rollout.errors import InvalidArgument
from rollout.outputs import SampleOutput

log = logging.getLogger(__name__)

# builds the engine's drafter for the loaded target (rollout.spec.proposer.build_drafter, or a test double)
DrafterFactory = Callable[[EngineConfig, LoadedModel], Drafter]


class LLMEngine(EngineMemory):
    def __init__(self, config: EngineConfig, drafter_factory: DrafterFactory | None = None,
                 load_progress: LoadProgress | None = None, step_cost: StepCost | None = None):
        """`drafter_factory(config, target)` builds the drafter. The engine imports no drafter: a
        config whose `spec` names one needs a factory (`rollout.build_engine(config)` passes
        rollout.spec's); one given with `spec="none"` plugs in a custom drafter. `load_progress`
        shows the target's checkpoint reads; `step_cost` gives the draft budget its cost model
        instead of the startup profile (tests)."""
        self.config = config
        self.device = torch.device(config.device)
        self.loaded = load_model(config.model_path, self.device, load_format=config.load_format,
                                 progress=load_progress)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.chat_template = self.loaded.chat_template
        self.vocab_size = self.loaded.config.vocab_size
        self.eos_token_ids = self.loaded.eos_token_ids
        self.model_name = self.loaded.name
        self.kernel_backend = triton_ops.choose_backend(config.kernel_backend, self.loaded.config.head_dim,
                                                        self.model.embed_tokens.weight)
        self.model.set_kernel_backend(self.kernel_backend)
        self.drafter = _build_drafter(config, self.loaded, drafter_factory)
        self.drafter_name = (self.drafter.name or type(self.drafter).__name__) if self.drafter else ""
        self.capture = MaskCapture()
        self.layer_ids = self.drafter.target_layer_ids if self.drafter else ()
        self._no_drafts = torch.zeros(0, dtype=torch.int64, device=self.device)  # [0]
        self.prefix_planner = planner_for(config.shared_prefix_attention, self.kernel_backend, config.block_size,
                                          self.loaded.config)
        self.graphs: StepGraphs | None = None
        self.memory_plan: memory.DeviceMemory | None = None  # what the profile measured (CUDA)
        limits = memory.context_limits(config, self.loaded.config.max_position_embeddings,
                                       self.drafter.max_model_len() if self.drafter else None)
        num_blocks = self._plan_kv_blocks(min(limits.values()))
        self._allocate_kv(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # what bounds a sequence's length, by name (the server reports them); max_model_len is the smallest
        self.context_limits = {**limits, "max_model_len_by_kv_cache": memory.kv_cache_limit(config, num_blocks)}
        self.max_model_len = min(self.context_limits.values())
        num_spec = self.drafter.num_spec if self.drafter else 0
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   num_spec)
        checks = Limits(self.vocab_size, self.max_model_len, config.max_mask_tokens, config.max_queued_samples)
        decode = self.decode if self.tokenizer is not None else None
        self.intake = Intake(self.scheduler, checks, self.eos_token_ids, self.tokenizer, random.Random(), decode)
        draft_model = getattr(self.drafter, "model", None)
        self.weights = WeightUpdater(self.model, draft_model, self.scheduler, self.block_manager, self.device,
                                     config.weight_staging)
        # release / resume for a colocated trainer
        self.memory = ReleasedMemory(self.device, [m for m in (self.model, draft_model) if m is not None])
        self.committer = Committer(self.scheduler, self.intake, self.max_model_len, lambda: self.weights.version,
                                   decode, self.drafter.sample_finished if self.drafter else None)
        self.draft_counts = DraftCounts()  # drafts proposed and accepted, by proposer and policy version
        if self.device.type == "cuda" and config.cuda_graphs:
            self.graphs = self.make_step_graphs(capture=True)
        self._graphed = False  # the last target forward replayed a CUDA graph
        self.spec_budget = self._spec_budget(step_cost) if self.drafter and config.spec_adaptive else None
        self.scheduler.draft_budget = self.spec_budget
        self.pipeline = Pipeline(config.overlap)  # the step launched ahead (rollout.engine.overlap)

    # -- public API (see rollout.server) --------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.weights.version

    def add_request(self, request_id: str, prompts: list[list[int]], params, n: int = 1,
                    mask: str | None = None, grammar=None, return_text: bool = False) -> None:
        """Validate everything, then queue n samples of every prompt. Raises InvalidArgument
        (naming the field) or ResourceExhausted before any work is done, and Unavailable while the
        device memory is released (rollout.engine.release). `return_text`: each sample's decoded
        output comes back in SampleOutput.text."""
        self.memory.check_admission()
        self.intake.add(request_id, prompts, params, n, mask, grammar, return_text)

    def decode(self, token_ids: list[int]) -> str:
        """Output text as stop strings and the `text` column see it: special tokens left out."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def abort(self, request_id: str) -> list[SampleOutput]:
        """Stop a request now and free its KV blocks; returns its unfinished samples."""
        self.committer.hand_over_masks()
        return [self.committer.finish(s, "abort") for s in self.intake.pop_unfinished(request_id)]

    def has_unfinished(self) -> bool:
        """Work a step would do (requests held while the memory is released wait for resume)."""
        return (self.scheduler.has_unfinished() and not self.memory.released) or self.weights.pending

    def idle_work(self) -> bool:
        """Nothing to step: the drafter's background work (its refresh) gets a bounded slice. Returns
        whether it wants more (rollout.engine.drafter.Drafter.idle)."""
        return self.drafter is not None and not self.memory.released and self.drafter.idle()

    def kv_blocks(self) -> tuple[int, int]:
        return self.block_manager.num_free_blocks, self.block_manager.num_blocks

    def compiled(self) -> dict[str, int]:
        """What steps have had to build so far, each inside the step that first needed it, which
        made that step slow: `graphs`, the CUDA graphs held (target steps and the drafter's block
        forward and its choice), and `kernels`, the Triton kernel variants of this process."""
        drafter = getattr(self.drafter, "graphs", None)
        graphs = len(self.graphs.graphs) if self.graphs is not None else 0
        graphs += drafter.num_graphs() if drafter is not None else 0
        kernels = triton_ops.compiled_variants() + triton_prefix_attention.compiled_variants()
        return dict(graphs=graphs, kernels=kernels)

    def update_weights(self, state: dict[str, torch.Tensor], draft_state: dict | None = None) -> None:
        """Stage and check now (InvalidArgument naming the tensor); apply once running samples drained.
        The server stages off the engine thread through `self.weights` (see WeightUpdater)."""
        self.weights.submit(self.weights.stage_state(state, draft_state))

    def weight_update_pending(self) -> bool:
        return self.weights.pending

    def info(self) -> dict:
        free, total = self.kv_blocks()
        return dict(model=self.model_name, drafter=self.drafter_name, vocab_size=self.vocab_size,
                    eos_token_ids=list(self.eos_token_ids), spec_method=self.config.spec,
                    spec_block_size=self.drafter.block if self.drafter else 0,
                    max_model_len=self.max_model_len, max_mask_tokens=self.config.max_mask_tokens,
                    max_queued_samples=self.config.max_queued_samples,
                    max_num_seqs=self.config.max_num_seqs, policy_version=self.policy_version,
                    kv_blocks_free=free, kv_blocks_total=total, block_size=self.config.block_size,
                    memory_released=self.memory.released, **self.context_limits,
                    drafter_stats=self.drafter.stats() if self.drafter else {})

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[SampleOutput]:
        if self.pipeline.idle:
            self._apply_weights()
        if self.memory.released:
            return []
        start = time.perf_counter()
        current = self.pipeline.take() or self._launch(self.pipeline.take_held() or self.scheduler.schedule())
        if current is None:
            self.committer.hand_over_masks()
            return []
        overlaps = self.pipeline.overlaps(current, self.drafter, self.weights.pending)
        after = self._launch_after(current) if overlaps else None
        outputs = self._finish(current, start, after)
        if after is not None and self.scheduler.has_unfinished():  # else every slot of `after` is discarded
            self._copy_blocks(overlap.advance(self.scheduler, after))
            self.pipeline.inflight = after
        return outputs

    def _launch(self, plan: list[ScheduledSeq], prev: Launched | None = None) -> Launched | None:
        """Schedule's plan -> draft -> build -> (pending tokens from `prev`) -> forward, policy, verify,
        capture, the masks' copy started: queued on the device, nothing read back."""
        if not plan:
            return None
        begin = time.perf_counter()
        table = padded_block_table([it.seq.block_table for it in plan])  # [S, W] host, for both below
        pending = None
        if prev is not None:  # (the drafter's anchors: when it drafts from the device)
            anchored = self.drafter is not None and self.drafter.device_anchors()
            pending = overlap.pending(plan, prev, self.device, anchored and any(it.num_draft for it in plan))
        drafts = self._draft(plan, table, pending)
        step = build_step(plan, drafts.num_per_item, self.config.block_size, self.device, table,
                          self.prefix_planner)
        if prev is not None:
            overlap.fill_pending(step, drafts.num_per_item, prev, pending)
        result, captured = self._run(step, drafts)
        masks = None if captured is None else self.capture.to_host(captured)
        choice = self.spec_budget.choices if self.spec_budget is not None else 0
        copy = overlap.start_copy(result)
        return Launched(plan, drafts, step, result, captured, masks, copy, self._graphed, choice,
                        time.perf_counter() - begin)

    def _launch_after(self, current: Launched) -> Launched | None:
        """Step n+1, launched before step n (`current`) syncs (rollout.engine.overlap); held instead
        when the draft budget gives it drafts and the drafter needs their anchors (n's tokens) on the host."""
        if not current.advanced:
            self._copy_blocks(overlap.advance(self.scheduler, current))
        self.committer.hand_over_masks()  # n-1's, before n+1's mask copy reuses their staging buffer
        plan = self.scheduler.schedule()
        if any(item.num_draft for item in plan) and not self.drafter.device_anchors():
            self.pipeline.hold(plan)
            return None
        return self.pipeline.ahead(self._launch(plan, current), current)

    def _finish(self, current: Launched, start: float, after: Launched | None) -> list[SampleOutput]:
        """(last step's masks) -> sync -> count drafts -> advance (or accept) -> commit/emit -> truncate
        drafts -> record. `after`: the step launched before this one's sync, if any (a step held instead
        is `pipeline.held`). The step's recorded time (what the draft budget's cost model learns) runs
        from `start`, the beginning of this call, and holds the host time of its own launch, not of
        `after`'s, whichever call launched each: under overlapped scheduling the call that syncs step n
        also launches n+1, and a drafted step's launch (its proposal, an eager forward) would otherwise
        be billed to the plain step before it."""
        self.committer.hand_over_masks()  # the last step's masks, one step late (rollout.engine.commit)
        host = _to_host(current.copy, current.masks)
        plan, step, drafts = current.plan, current.step, current.drafts
        accepted = step.accepted_per_item(None if host is None else host.num_accepted)
        if host is not None and self.drafter is not None:
            self.draft_counts.record_step(drafts, accepted, self.drafter_name, self.weights.version)
        if not current.advanced:
            copies = self.scheduler.advance(plan, accepted)
            self._copy_blocks(copies)  # forked samples' partial blocks, before the next forward reads them
        else:  # advanced before its results as if it accepted none
            self.scheduler.accept(plan, accepted)
        outputs = self.committer.commit(step.rows, host, current.captured)
        self.scheduler.truncate_drafts(plan, after.plan if after is not None else self.pipeline.held)
        if host is not None and self.drafter is not None:
            self.drafter.verified(plan, drafts, accepted)
        seconds = time.perf_counter() - start + (current.launch_seconds if current.ahead else 0.0)
        seconds -= after.launch_seconds if after is not None else 0.0
        if self.spec_budget is not None:  # what the step's verification and wall time teach the budget
            self.spec_budget.record(step, host and host.num_accepted, seconds, current.graphed, current.choice)
        if self.drafter is not None:
            self.drafter.after_step(seconds)  # (its refresh's training: after the step's time is taken)
        return outputs

    def _apply_weights(self) -> None:
        """A drained weight update applies between steps; the drafter hears of the new version."""
        if self.weights.apply_if_drained() and self.drafter is not None:
            self.drafter.policy_updated(self.weights.version)

    def _draft(self, plan, table, pending: overlap.Pending | None = None) -> Drafts:
        """The drafter's proposal; `pending`: the plan's tokens still on the device (a step launched
        before the one ahead of it syncs), for a drafter that proposes from them."""
        if self.drafter is None:
            return Drafts(self._no_drafts, [0] * len(plan))
        if pending is not None:  # (built only for a drafter with device anchors: a shift follows its drafted step)
            return self.drafter.propose(plan, table, pending=pending)
        return self.drafter.propose(plan, table)

    @torch.inference_mode()
    def _run(self, step: StepBatch, drafts: Drafts):
        hidden = self._forward_step(step, drafts)
        if not step.rows.entries:
            return None, None
        return self._sample(step, drafts, hidden)

    def _forward_step(self, step: StepBatch, drafts: Drafts) -> torch.Tensor:
        """The step's tokens with the drafts in their slots -> hidden [T, H]; the drafter's context is
        updated in there."""
        tokens = step.tokens
        input_ids = tokens.input_ids.index_put((tokens.draft_token_index,), drafts.tokens)
        hidden, _ = self._forward(input_ids, tokens.meta)
        return hidden

    def _sample(self, step: StepBatch, drafts: Drafts, hidden: torch.Tensor):
        """The logits of the step's rows, the policy (docs/sampling.md), verification and mask capture."""
        rows = step.rows
        logits = self.model.compute_logits(hidden[rows.logits_index])  # [R, V]
        bitmask = grammar_bitmask(rows, drafts.tokens, self.vocab_size, self.device)
        params = build_row_params(rows, drafts.tokens, self.vocab_size, bitmask, self.device, step.tokens.input_ids)
        pol = policy(logits, params, overwrite=True)  # logits are not read again
        result = verify(pol, drafts.tokens, drafts.q, rows)
        return result, self.capture.capture(pol, rows)

    def _forward(self, input_ids: torch.Tensor, meta):
        key = self.graphs.key(meta) if self.graphs is not None else None
        self._graphed = key is not None
        if key is not None:
            try:
                return self.graphs.run(key, input_ids, meta)
            except RuntimeError as e:  # a capture the backend refuses: stay correct, run eagerly
                log.warning("CUDA graph capture failed (%s); running eagerly from now on", e)
                self.graphs = None
                self._graphed = False
        return self._target_forward(input_ids, meta)

    def _target_forward(self, input_ids: torch.Tensor, meta):
        """The target forward, then the drafter's context K/V from its hidden states: one unit, so
        that a CUDA graph of a step holds both."""
        hidden, aux = self.model(input_ids, meta, self.kv_caches, self.layer_ids)
        if self.drafter is not None:
            self.drafter.update_context(aux, meta)
        return hidden, aux

    def make_step_graphs(self, capture: bool) -> StepGraphs:
        """Static-buffer replay of decode and verify steps, uniform or ragged; `capture=False` runs it
        eagerly (tests). The graphs keep the hidden states only: the drafter reads the taps inside the
        forward."""
        forward = lambda ids, meta: (self._target_forward(ids, meta)[0], None)  # noqa: E731
        max_q = (self.drafter.num_spec + 1) if self.drafter else 1
        max_blocks = -(-self.max_model_len // self.config.block_size) + 1
        max_batch = min(256, self.config.max_num_seqs)
        if self.drafter is not None:
            self.drafter.use_graphs(max_batch, max_blocks, self.config.block_size, self.block_manager.num_blocks,
                                    capture)
        return StepGraphs(forward, scratch_block=self.block_manager.num_blocks, block_size=self.config.block_size,
                          max_blocks_per_seq=max_blocks, max_q=max_q, device=self.device, capture=capture,
                          max_batch=max_batch, prefix_planner=self.prefix_planner,
                          max_num_batched_tokens=self.config.max_num_batched_tokens)

    def _spec_budget(self, step_cost: StepCost | None) -> SpecBudget:
        """The draft budget, its cost model profiled here unless given (a few seconds at most on a
        GPU, half a second on CPU)."""
        num_spec = self.drafter.num_spec
        if step_cost is None:
            draft = self.drafter.profile_forward
            scratch, block_size = self.block_manager.num_blocks, self.config.block_size
            with torch.inference_mode():
                step_cost = profile_step_cost(
                    self._target_forward, self.model.compute_logits, self.graphs,
                    lambda rows: draft(rows, scratch, block_size), num_spec + 1, scratch, block_size,
                    self.device, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                    max_seconds=3.0 if self.device.type == "cuda" else 0.5)
            log.info("step cost profile: %s", step_cost.describe())
        max_graph_rows = self.graphs.buckets[-1] if self.graphs is not None else 0
        return SpecBudget(num_spec, step_cost, self.graphs is not None, max_graph_rows, self.draft_counts)

    def spec_budget_summary(self) -> dict | None:
        """The draft budget's summary since the last call (server logs), None without one."""
        return self.spec_budget.summary() if self.spec_budget is not None else None

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Whole-block KV copies (src, dst) in the target's and the drafter's caches."""
        if not pairs:
            return
        copy_blocks(self.kv_caches, pairs)
        if self.drafter is not None:
            self.drafter.copy_blocks(pairs)


def _to_host(copy: overlap.StepCopy | None, masks: np.ndarray | None) -> HostStep | None:
    """The step's one device -> host synchronisation: waits for its copies (`overlap.start_copy`; not for a
    step launched after them), with the packed masks' host array (its copy started before them: see
    `MaskCapture.to_host`) when the batch has mask requests."""
    if copy is None:
        return None
    if copy.event is not None:
        copy.event.synchronize()
    return HostStep(*(h.tolist() for h in copy.tensors), masks)


def _build_drafter(config: EngineConfig, loaded: LoadedModel, factory: DrafterFactory | None) -> Drafter | None:
    if factory is not None:
        return factory(config, loaded)
    if config.spec != "none":
        raise InvalidArgument("spec", f"{config.spec!r} needs a drafter factory: build the engine with "
                                      f"rollout.build_engine(config)")
    return None
