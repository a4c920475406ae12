"""The engine: requests in, finished samples out. `step()` is the table of contents.

    schedule -> draft -> forward -> policy -> verify -> capture -> (last step's masks) -> sync -> commit/emit

With a drafter, the schedule's draft budget (spec_budget.py, `--spec-adaptive`) decides each step
how many drafts of each sample to verify, from the acceptance each sample has shown and what steps
cost here (step_cost.py: profiled at startup, then each step's wall time).

One step is one target forward over a ragged batch (prefill chunks, decode anchors and
draft blocks mixed), one Contract-1 policy over the rows that sample, one verification, one
host synchronisation. The engine is single-threaded: the server calls it from one loop.
"""

from __future__ import annotations

import logging
import random
import time

import torch

from rollout.engine import triton_ops, triton_prefix_attention
from rollout.engine.batch import StepBatch, build_step, padded_block_table
from rollout.engine.block_manager import BlockManager
from rollout.engine.commit import Committer
from rollout.engine.config import EngineConfig
from rollout.engine.graphs import StepGraphs
from rollout.engine.intake import Intake
from rollout.engine.kv import allocate_kv, copy_blocks, size_kv_blocks
from rollout.engine.loader import load_model
from rollout.engine.outputs import SampleOutput
from rollout.engine.prefix_plan import SharedPrefixPlanner
from rollout.engine.rows import build_row_params
from rollout.engine.sampler import policy
from rollout.engine.scheduler import Scheduler
from rollout.engine.spec_budget import SpecBudget
from rollout.engine.step_cost import StepCost, profile_step_cost
from rollout.engine.weights import WeightUpdater
from rollout.errors import InvalidArgument
from rollout.masks.capture import MaskCapture
from rollout.spec.proposer import Drafter, Drafts
from rollout.spec.verify import VerifyResult, verify

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, drafter: Drafter | None = None, step_cost: StepCost | None = None):
        """`drafter` plugs in a custom `Drafter` instead of the one `config.spec` names; `step_cost`
        gives the draft budget its cost model instead of the startup profile (tests)."""
        self.config = config
        self.device = torch.device(config.device)
        self.loaded = load_model(config.model_path, self.device, load_format=config.load_format)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.config.vocab_size
        self.eos_token_ids = self.loaded.eos_token_ids
        self.model_name = self.loaded.name
        self.kernel_backend = _kernel_backend(config, self.loaded.config, self.model.embed_tokens.weight)
        self.model.set_kernel_backend(self.kernel_backend)
        if drafter is not None:
            self.drafter, self.drafter_name = drafter, type(drafter).__name__
        else:
            self.drafter, self.drafter_name = _build_drafter(config, self.loaded)
        num_blocks = size_kv_blocks(config, self.loaded.config, self.drafter, self.device)
        # one more block than the manager hands out: the scratch block of padded graph rows
        self.kv_caches = allocate_kv(self.loaded.config, num_blocks + 1, config.block_size, self.device,
                                     self.model.embed_tokens.weight.dtype)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks + 1, config.block_size)  # + the graphs' scratch block
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        limits = [config.max_model_len or self.loaded.config.max_position_embeddings,
                  (num_blocks - 1) * config.block_size, self.drafter and self.drafter.max_model_len()]
        self.max_model_len = min(x for x in limits if x)
        self.intake = Intake(self, random.Random())
        self.capture = MaskCapture()
        self.weights = WeightUpdater(self)
        self.committer = Committer(self)
        self.pending_copies: list[tuple[int, int]] = []
        self.layer_ids = self.drafter.target_layer_ids if self.drafter else ()
        self._no_drafts = torch.zeros(0, dtype=torch.int64, device=self.device)  # [0]
        self.prefix_planner = _prefix_planner(config, self.loaded.config, self.kernel_backend)
        use_graphs = self.device.type == "cuda" and config.cuda_graphs
        self.graphs = self.make_step_graphs(capture=True) if use_graphs else None
        self._graphed = False  # the last target forward replayed a CUDA graph
        self.spec_budget = self._spec_budget(step_cost) if self.drafter and config.spec_adaptive else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.drafter.num_spec if self.drafter else 0, self.spec_budget)

    # -- public API (see rollout.server) --------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.weights.version

    def add_request(self, request_id: str, prompts: list[list[int]], params, n: int = 1,
                    mask: str | None = None, grammar=None) -> None:
        """Validate everything, then queue n samples of every prompt. Raises InvalidArgument
        (naming the field) or ResourceExhausted before any work is done."""
        self.intake.add(request_id, prompts, params, n, mask, grammar)

    def abort(self, request_id: str) -> list[SampleOutput]:
        """Stop a request now and free its KV blocks; returns its unfinished samples."""
        self.committer.hand_over_masks()
        return [self.committer.finish(s, "abort") for s in self.intake.pop_unfinished(request_id)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.weights.pending

    def kv_blocks(self) -> tuple[int, int]:
        return self.block_manager.num_free_blocks, self.block_manager.num_blocks

    def compiled(self) -> dict[str, int]:
        """What steps have had to build so far, each inside the step that first needed it, which
        made that step slow: `graphs`, the CUDA graphs held (target steps and the drafter's block
        forward), and `kernels`, the Triton kernel variants of this process."""
        drafter = getattr(self.drafter, "graphs", None)
        graphs = sum(len(g.graphs) for g in (self.graphs, drafter) if g is not None)
        kernels = triton_ops.compiled_variants() + triton_prefix_attention.compiled_variants()
        return dict(graphs=graphs, kernels=kernels)

    def update_weights(self, state: dict[str, torch.Tensor], draft_state: dict | None = None) -> None:
        """Validate now; apply once running samples drained (see WeightUpdater)."""
        self.weights.submit(state, draft_state)

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
                    kv_blocks_free=free, kv_blocks_total=total, block_size=self.config.block_size)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[SampleOutput]:
        start = time.perf_counter()
        self.weights.apply_if_drained()
        plan = self.scheduler.schedule()
        if not plan:
            self.committer.hand_over_masks()
            return []
        self._copy_pending_blocks()  # forked samples' partial blocks, before anyone reads them
        table = padded_block_table([it.seq.block_table for it in plan])  # [S, W] host, for both below
        drafts = self._draft(plan, table)
        step = build_step(plan, drafts.num_per_item, self.config.block_size, self.device, table,
                          self.prefix_planner)
        result, captured = self._run(step, drafts)
        masks = None if captured is None else self.capture.to_host(captured)
        self.committer.hand_over_masks()  # the last step's masks, while the device computes this step
        host = _to_host(result, masks)
        outputs = self.committer.commit(step, host, captured)
        if self.spec_budget is not None:  # what the step's verification and wall time teach the budget
            self.spec_budget.record(step, host[2] if host else None, time.perf_counter() - start,
                                    self._graphed)
        return outputs

    def _draft(self, plan, table) -> Drafts:
        if self.drafter is None:
            return Drafts(self._no_drafts, [0] * len(plan))
        return self.drafter.propose(plan, table)

    @torch.inference_mode()
    def _run(self, step: StepBatch, drafts: Drafts):
        input_ids = step.input_ids.index_put((step.draft_token_index,), drafts.tokens)
        hidden, _ = self._forward(input_ids, step.meta)  # the drafter's context is updated in there
        if not step.entries:
            return None, None
        logits = self.model.compute_logits(hidden[step.logits_index])  # [R, V]
        bitmask = self.intake.grammar_bitmask(step, drafts)
        rows = build_row_params(step, drafts.tokens, self.vocab_size, bitmask, self.device)
        pol = policy(logits, rows, overwrite=True)  # logits are not read again
        result = verify(pol, drafts.tokens, drafts.q, step)
        return result, self.capture.capture(pol, step)

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
        """Static-buffer replay of uniform steps; `capture=False` runs it eagerly (tests)."""
        forward = self._target_forward
        max_q = (self.drafter.num_spec + 1) if self.drafter else 1
        max_blocks = -(-self.max_model_len // self.config.block_size) + 1
        max_batch = min(256, self.config.max_num_seqs)
        if self.drafter is not None:
            self.drafter.use_graphs(max_batch, max_blocks, self.config.block_size, self.block_manager.num_blocks,
                                    capture)
        return StepGraphs(forward, scratch_block=self.block_manager.num_blocks, block_size=self.config.block_size,
                          max_blocks_per_seq=max_blocks, max_q=max_q, device=self.device, capture=capture,
                          max_batch=max_batch, prefix_planner=self.prefix_planner)

    def _spec_budget(self, step_cost: StepCost | None) -> SpecBudget:
        """The draft budget, its cost model profiled here unless given (a few seconds at most on a
        GPU, half a second on CPU)."""
        num_spec = self.drafter.num_spec
        if step_cost is None:
            draft = getattr(self.drafter, "profile_forward", None)
            scratch, block_size = self.block_manager.num_blocks, self.config.block_size
            with torch.inference_mode():
                step_cost = profile_step_cost(
                    self._target_forward, self.model.compute_logits, self.graphs,
                    draft and (lambda rows: draft(rows, scratch, block_size)), num_spec + 1, scratch, block_size,
                    self.device, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                    max_seconds=3.0 if self.device.type == "cuda" else 0.5)
            log.info("step cost profile: %s", step_cost.describe())
        max_graph_rows = self.graphs.buckets[-1] if self.graphs is not None else 0
        return SpecBudget(num_spec, step_cost, self.graphs is not None, max_graph_rows)

    def spec_budget_summary(self) -> dict | None:
        """The draft budget's summary since the last call (server logs), None without one."""
        return self.spec_budget.summary() if self.spec_budget is not None else None

    def _copy_pending_blocks(self) -> None:
        if not self.pending_copies:
            return
        copy_blocks(self.kv_caches, self.pending_copies)
        if self.drafter is not None:
            self.drafter.copy_blocks(self.pending_copies)
        self.pending_copies = []


def _to_host(result: VerifyResult | None, masks):
    """The step's one device -> host synchronisation: committed tokens, logprobs and
    acceptance counts, plus the packed masks' host array (its copy already started: see
    `MaskCapture.to_host`) when the batch has mask requests."""
    if result is None:
        return None
    tensors = [result.tokens, result.logprobs, result.num_accepted, result.has_support]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    if masks is not None:
        host.append(masks)
    if tensors[0].is_cuda:
        torch.cuda.current_stream().synchronize()
    return host


def _kernel_backend(config: EngineConfig, model_config, weight: torch.Tensor) -> str:
    """The configured backend; "auto" is the Triton kernel on CUDA when it supports the shape."""
    from rollout.engine import triton_attention

    fits = triton_attention.supported(model_config.head_dim, weight.dtype, weight.device)
    if config.kernel_backend == "auto":
        return "triton" if fits and weight.device.type == "cuda" else "torch"
    if config.kernel_backend == "triton" and not fits:
        raise InvalidArgument("kernel_backend", f"triton does not run head_dim {model_config.head_dim} "
                              f"{weight.dtype} on {weight.device} here (needs CUDA or TRITON_INTERPRET=1)")
    return config.kernel_backend


def _prefix_planner(config: EngineConfig, model_config, backend: str) -> SharedPrefixPlanner | None:
    """Shared-prefix attention runs on the Triton backend only: the torch path gathers every
    sequence's keys into a dense copy anyway, so reading a shared block once would not save that."""
    if not config.shared_prefix_attention or backend != "triton":
        return None
    groups = model_config.num_attention_heads // model_config.num_key_value_heads
    return SharedPrefixPlanner(config.block_size, groups, model_config.num_key_value_heads)


def _build_drafter(config: EngineConfig, loaded):
    if config.spec == "none":
        return None, ""
    from rollout.spec.draft_loader import load_drafter
    from rollout.spec.proposer import BlockDrafter

    path = config.draft_path
    model = load_drafter(path, loaded, kind=config.spec, block_size=config.spec_block_size,
                         device=loaded.model.embed_tokens.weight.device,
                         dtype=loaded.model.embed_tokens.weight.dtype)
    return BlockDrafter(model, config.spec_block_size, config.spec_confidence_threshold), path.name
