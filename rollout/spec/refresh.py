"""Online refresh of a DFlash / DSpark drafter from the server's own rollouts (`--drafter-refresh`).

The drafter (rollout.spec.proposer.BlockDrafter) hands its `DrafterRefresh` what it sees anyway:

* `begin_step(items)` at the start of every step's drafting: which sequences the step computes,
  from which position, with how many new tokens. This is also the one place where refreshed
  weights enter the live drafter: between two steps, never while a step uses it.
* `tap(aux)` inside the target forward (`update_context`): the step's target-layer outputs are
  copied into a static buffer (one device copy, recorded into the step's CUDA graph like the rest
  of `update_context`).
* `committed(items, drafts, accepted)` after verification: the rows of the committed tokens (a
  prefill chunk's, a decode item's anchor and its accepted drafts) go into the `TapBuffer`
  (rollout.spec.refresh_buffer) with their token ids; rejected drafts never do. Prompt rows are kept
  as context for the last WINDOW prompt positions only.
* `after_step(seconds)` once the step's wall time is recorded (so the draft budget's cost model
  never counts training as step time): a training slice may follow (below).
* `idle()` when the engine loop has nothing to run: a training slice.
* `policy_updated(version)` after a weight update: the buffer is cleared, the shadow reloaded from
  the live drafter (an update may carry drafter weights) and the optimizer's moments reset, so
  training restarts on the new policy's data.

Overlapped steps (rollout.engine.overlap): step n+1 may begin and run its forward before step n is
committed (only when n verified no drafts). Each sampling step's layout is kept until its commit
(`_StepTaps`; a commit drops those begun before it, never committed), and when a step begins while
the one before is still uncommitted, that step's rows of the static tap buffer are copied into a
second one allocated beside it (a device copy queued behind its forward, before the new step's
forward overwrites them; one step at a time is in flight). No row is stored at or past a sample's
last committed token: a slot of step n+1 whose sample finished in step n (discarded; the synchronous
loop never schedules it) stores nothing, nor do accepted drafts that a stop token before them cut.
So the buffer holds what the synchronous loop would store.

Training: a shadow copy of the drafter's trainable weights (float32; DSpark's own embeddings and
LM head stay frozen and shared with the live drafter, DFlash borrows the target's), AdamW at
`--drafter-refresh-lr`, its memory (weights, gradients, both moments: 16 bytes per trainable
parameter) allocated at startup. A training step draws WINDOWS windows of up to WINDOW consecutive
committed positions of one sequence and ANCHORS blocks per window, and applies the drafter's own
block objective (the one scripts/train_drafters.py trains with) towards the committed tokens, which
are exact samples of the policy: cross-entropy on them, weighted down along the block; DSpark's
Markov head teacher-forced on the committed tokens and its confidence head on "the draft equals the
committed token". Only output tokens are labels.

When: `always` after every step; `idle` while the engine loop is idle and after steps of at most
max(1, max_num_seqs // 8) sequences (the long tail of a rollout). A slice runs on the engine thread
between steps and starts a training step only while the time spent so far plus the last training
step's measured duration stays within its bound (the first two training steps are the exceptions:
the first is a warm-up whose duration does not count, the second not yet measured); an idle slice
runs one step at least. An idle slice's bound is `--drafter-refresh-ms`. A slice after a step spends
credit: every step earns `--drafter-refresh-share` of its wall time (kept up to CREDIT_SLICES slices
of `--drafter-refresh-ms`), and the slice's bound is the smaller of the credit and
`--drafter-refresh-ms`; its time is taken from the credit. So training between steps costs a rollout
at most that share of its time (the warm-up step excepted, which the credit then repays), and no
step waits more than `--drafter-refresh-ms`. Idle slices stop once the buffer's output tokens have
been trained on IDLE_PASSES times since the last new data.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rollout.engine.config import EngineConfig
from rollout.engine.drafter import Drafts
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence
from rollout.engine.transfer import upload
from rollout.spec.draft_model import DraftModel, TargetHeads
from rollout.spec.refresh_buffer import TapBuffer

log = logging.getLogger(__name__)

WINDOWS, WINDOW, ANCHORS = 8, 64, 8  # windows per training step, positions per window, blocks per window
IDLE_PASSES = 4  # idle training stops after this many passes over the buffer's output tokens
POSITION_DECAY, CONFIDENCE_WEIGHT = 4.0, 0.2  # as scripts/train_drafters.py
CREDIT_SLICES = 10  # earned training credit is kept up to this many --drafter-refresh-ms slices
LOG_EVERY = 100  # a log line every this many training steps
FROZEN = ("embed_tokens.", "lm_head.")  # DSpark's own heads: not trained here (shared with the live drafter)


@dataclass
class _StepTaps:
    """A sampling step begun and not yet committed: its layout, and its tapped rows once a later step
    began (before that they are the first rows of DrafterRefresh.taps)."""

    layout: list[tuple[Sequence, int, int]]  # (sequence, first position, new tokens) per item, in item order
    taps: torch.Tensor | None = None  # [T, n*Ht] its rows copied aside (DrafterRefresh.aside)


@dataclass
class RefreshStats:
    """What the server reports of the refresh (GetServerInfo, the stats log)."""

    steps: int = 0  # optimizer steps since startup
    loss: float = 0.0  # the last step's loss
    tokens: int = 0  # output tokens in the buffer now
    trained_tokens: int = 0  # label tokens trained on since startup
    swaps: int = 0  # refreshed weights copied into the live drafter
    version: int = 0  # the policy version the buffer holds
    seconds: float = 0.0  # spent in training steps since startup

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in vars(self).items()}


def block_loss(logits: torch.Tensor, confidence: torch.Tensor | None, labels: torch.Tensor,
               decay: float = POSITION_DECAY, confidence_weight: float = CONFIDENCE_WEIGHT) -> torch.Tensor:
    """The block objective: cross-entropy on labels [..., B-1] (-1: no label) of logits [..., B-1, V],
    position j weighted by exp(-j / decay) (mean 1), plus DSpark's confidence BCE (confidence logits
    [..., B-1]) on whether the argmax is the label."""
    width = labels.shape[-1]
    weight = torch.exp(-torch.arange(width, device=labels.device) / decay)
    weight = weight / weight.mean()  # [B-1]
    valid = labels >= 0
    ce = F.cross_entropy(logits.flatten(0, -2), labels.clamp(min=0).flatten(), reduction="none").view_as(labels)
    count = valid.sum().clamp(min=1)
    loss = (ce * weight * valid).sum() / count
    if confidence is not None:
        hit = (logits.argmax(-1) == labels).float()
        bce = F.binary_cross_entropy_with_logits(confidence, hit, reduction="none")
        loss = loss + confidence_weight * (bce * valid).sum() / count
    return loss


class DrafterRefresh:
    """The capture, the buffer and the trainer of one live drafter model (see module docstring)."""

    def __init__(self, model: DraftModel, config: EngineConfig, seed: int = 0):
        self.live, self.mode = model, config.drafter_refresh
        self.lr, self.budget_s = config.drafter_refresh_lr, config.drafter_refresh_ms / 1000
        self.small_batch = max(1, config.max_num_seqs // 8)
        self.block = model.config.block_size
        # the most rows of a step: eager, or a graph's padded verify step (256 rows of a draft block each)
        self.max_rows = max(config.max_num_batched_tokens, 256 * (config.spec_block_size or self.block))
        self.capacity = config.drafter_refresh_tokens
        self.rng = np.random.default_rng(seed)
        self.stats = RefreshStats()
        self.pending: list[_StepTaps] = []  # sampling steps begun, not committed yet (oldest first)
        self.step_s = 0.0  # the last training step's duration
        self.share = config.drafter_refresh_share
        self.credit = 0.0  # seconds of training after steps still earned (after_step)
        self.step_rows = 0  # the last committed step's items
        self.idle_labels = 0  # labels trained on since the buffer last grew
        self.dirty = False  # the shadow has changed since the last swap
        self.allocate()

    @property
    def device(self) -> torch.device:
        return self.live.fc.weight.device

    def allocate(self) -> None:
        """The buffer, the step's tap buffer, the shadow and its optimizer (startup, and after `free`)."""
        width = self.live.config.context_size
        dtype = self.live.fc.weight.dtype
        self.buffer = TapBuffer(self.capacity, width, dtype, self.device)
        self.taps = torch.zeros(self.max_rows, width, dtype=dtype, device=self.device)  # [R, n*Ht]
        self.aside = torch.zeros_like(self.taps)  # [R, n*Ht] the taps of a step in flight when the next begins
        self.shadow = _shadow(self.live)
        self.params = [p for n, p in self.shadow.named_parameters() if not n.startswith(FROZEN)]
        self._reset_optimizer()
        log.info("drafter refresh %s: buffer of %d tokens, %.1f MB on %s; %d trainable parameters", self.mode,
                 self.capacity, self.buffer.nbytes / 1e6, self.device, sum(p.numel() for p in self.params))

    def free(self) -> None:
        """Drops the device memory (rollout.engine.release); `allocate` rebuilds it from the live drafter."""
        self.buffer = self.taps = self.aside = self.shadow = self.optimizer = None
        self.params, self.pending = [], []

    def _reset_optimizer(self) -> None:
        for p in self.params:
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.AdamW(self.params, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.01)
        for group in self.optimizer.param_groups:  # the moments' memory now, not at the first step
            group["lr"] = 0.0
        self.optimizer.step()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    # ---- what the drafter hands over --------------------------------------------------------

    def begin_step(self, items: list[ScheduledSeq]) -> None:
        """Between steps: refreshed weights go live (queued behind a step in flight, which has read
        them by then); the taps of a step still uncommitted are copied aside; a sampling step's layout
        is noted."""
        if self.buffer is None:
            return
        if self.dirty:
            _copy_into(self.live, self.shadow)
            self.dirty = False
            self.stats.swaps += 1
        if self.pending and self.pending[-1].taps is None:  # in flight: this step's forward reuses self.taps
            last = self.pending[-1]  # (one at a time: it is committed before the step after this one begins;
            rows = sum(new for _, _, new in last.layout)  # it verified no drafts, so its tokens are its rows)
            last.taps = self.aside[:rows].copy_(self.taps[:rows])
        if any(it.samples for it in items):  # (a step that samples nothing is never committed)
            self.pending.append(_StepTaps([(it.seq, it.seq.num_computed_tokens, it.num_new_tokens) for it in items]))

    def tap(self, aux: torch.Tensor) -> None:
        """aux: [T, n*Ht], the step's target-layer outputs (copied: a graph's buffers are reused)."""
        if self.taps is not None and aux.shape[0] <= self.max_rows:
            self.taps[: aux.shape[0]].copy_(aux)

    def committed(self, items: list[ScheduledSeq], drafts: Drafts, accepted: list[int]) -> None:
        """The step's committed rows into the buffer (`accepted[i]` of item i's drafts)."""
        if self.buffer is None:
            return
        self.step_rows = len(drafts.num_per_item)  # (after_step: is this the long tail?)
        entry = self._pending_of(items)
        if entry is None:
            return
        taps = self.taps if entry.taps is None else entry.taps
        rows, key, position, token, output = [], [], [], [], []
        offset = 0
        for (seq, start, new), k, a in zip(entry.layout, drafts.num_per_item, accepted):
            end = min(start + new + a, seq.num_tokens - 1)  # (a discarded slot, drafts a stop cut: module doc)
            first = max(start, min(end, seq.num_prompt_tokens - WINDOW))  # prompt rows: the last WINDOW only
            if end > first:
                rows += range(offset + first - start, offset + end - start)
                key += [seq.seq_id] * (end - first)
                position += range(first, end)
                token += seq.tokens(first, end)
                output += [p >= seq.num_prompt_tokens for p in range(first, end)]
            offset += new + k
        if rows and offset <= taps.shape[0]:
            chosen = taps[upload(rows, torch.int64, self.device)]  # [n, n*Ht]
            self.buffer.append(*(np.asarray(a, dtype=np.int64) for a in (key, position, token)),
                               np.asarray(output, dtype=bool), chosen)
            self.idle_labels = 0

    def _pending_of(self, items: list[ScheduledSeq]) -> _StepTaps | None:
        """The pending step whose sequences `items` are (steps commit in order: those begun before
        it, launched ahead and then discarded, were never committed, and go)."""
        for i, entry in enumerate(self.pending):
            if len(entry.layout) == len(items) and all(s is it.seq for (s, _, _), it in zip(entry.layout, items)):
                del self.pending[: i + 1]
                return entry
        return None

    def after_step(self, seconds: float) -> None:
        """A step has ended, `seconds` its wall time (already recorded by the draft budget, so
        training never counts in the cost model's step times): it earns `--drafter-refresh-share` of
        them as training credit, and a slice runs where the mode asks for one, within the credit and
        `--drafter-refresh-ms`."""
        if self.buffer is None or self.mode == "off":
            return
        self.credit = min(self.credit + self.share * seconds, CREDIT_SLICES * self.budget_s)
        if self.mode == "always" or self.step_rows <= self.small_batch:
            self.train_slice(bound=min(self.budget_s, self.credit))

    def idle(self) -> bool:
        """The engine loop is idle: a training slice (`idle` and `always`). Returns whether more
        training is wanted (the loop then polls for commands instead of waiting for them)."""
        if self.mode == "off" or not self._wants_idle():
            return False
        self.train_slice(idle=True)
        return self._wants_idle()

    def _wants_idle(self) -> bool:
        return self.buffer is not None and self.idle_labels < IDLE_PASSES * self.buffer.num_outputs()

    def policy_updated(self, version: int) -> None:
        """A weight update applied: the new policy's data only; the shadow restarts from the live weights."""
        self.stats.version = version
        if self.buffer is None:
            return
        self.buffer.clear()
        self.stats.tokens = self.idle_labels = 0
        self.pending, self.dirty = [], False
        _copy_into(self.shadow, self.live)
        self._reset_optimizer()

    # ---- training ---------------------------------------------------------------------------

    def train_slice(self, idle: bool = False, bound: float | None = None) -> None:
        """Training steps while they fit in the slice's time bound (module docstring): `bound`
        seconds, --drafter-refresh-ms by default; a slice after a step spends its time from the
        credit. `idle`: at least one step (nothing else waits for the engine thread but the commands
        the loop polls for between slices)."""
        if self.buffer is None or self.buffer.num_outputs() == 0:
            return
        start, first = time.perf_counter(), idle or self.stats.steps == 0
        bound = self.budget_s if bound is None else bound
        while first or time.perf_counter() - start + self.step_s <= bound:
            first = False
            began = time.perf_counter()
            if not self.train_step():
                break
            self.stats.seconds += time.perf_counter() - began
            self.step_s = time.perf_counter() - began if self.stats.steps > 1 else 0.0  # (not the warm-up)
            if self.step_s > self.budget_s and self.stats.steps == 2:
                log.warning("drafter refresh: a training step takes %.1f ms, over --drafter-refresh-ms %.1f: it "
                            "trains only while idle", self.step_s * 1e3, self.budget_s * 1e3)
        if not idle:
            self.credit -= time.perf_counter() - start

    def train_step(self) -> bool:
        """One optimizer step on a batch of windows; False when the batch holds no label."""
        batch = self._batch()
        if batch is None:
            return False
        taps, ids, anchors, labels, prev = batch
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits, confidence = self.shadow.train_logits(taps, ids, anchors, prev)
        loss = block_loss(logits.float(), confidence, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        stats = self.stats
        stats.steps += 1
        stats.loss = float(loss.detach())  # (the slice's clock needs the step finished anyway)
        labelled = int((labels >= 0).sum())
        stats.trained_tokens += labelled
        stats.tokens = self.buffer.num_outputs()
        self.idle_labels += labelled
        self.dirty = True
        if stats.steps % LOG_EVERY == 0:
            log.info("drafter refresh: step %d loss %.4f, %d tokens in the buffer (policy version %d), %d swaps",
                     stats.steps, stats.loss, stats.tokens, stats.version, stats.swaps)
        return True

    def _batch(self):
        """Windows of the buffer as the dense training layout: taps [W, L, n*Ht], ids [W, L], anchors
        [W, A], labels [W, A, B-1] (-1: none), prev [W, A, B-1] (the token before each position)."""
        windows = [w for w in self.buffer.windows(self.rng, WINDOWS, WINDOW) if len(w) >= 2]
        if not windows:
            return None
        B, L = self.block, max(len(w) for w in windows) + self.block
        rows = np.zeros((len(windows), L), dtype=np.int64)
        lens = np.asarray([len(w) for w in windows])
        for j, w in enumerate(windows):
            rows[j, : len(w)] = w
        ids = np.where(np.arange(L) < lens[:, None], self.buffer.token[rows], self.live.config.mask_token_id)
        output = (np.arange(L) < lens[:, None]) & self.buffer.output[rows]  # [W, L]
        anchors = (self.rng.random((len(windows), ANCHORS)) * (lens[:, None] - 1)).astype(np.int64)  # [W, A]
        at = anchors[:, :, None] + np.arange(1, B)  # [W, A, B-1] label positions
        picked = np.take_along_axis(ids[:, None, :].repeat(ANCHORS, 1), at, axis=2)
        labels = np.where(np.take_along_axis(output[:, None, :].repeat(ANCHORS, 1), at, axis=2), picked, -1)
        if not (labels >= 0).any():
            return None
        prev = np.take_along_axis(ids[:, None, :].repeat(ANCHORS, 1), at - 1, axis=2)
        dev = self.device
        taps = self.buffer.taps[upload(rows, torch.int64, dev)]  # [W, L, n*Ht]
        return (taps, *(upload(a, torch.int64, dev) for a in (ids, anchors, labels, prev)))


def _shadow(live: DraftModel) -> DraftModel:
    """A float32 copy of the live drafter's trainable weights, reading the same (frozen) embeddings and
    LM head."""
    with torch.device("meta"):
        shadow = DraftModel(live.config, TargetHeads(live.shared.embed_tokens, live.shared.lm_head))
    if live.config.kind == "dspark":
        del shadow.embed_tokens, shadow.lm_head  # the live drafter's, through `shared`
    shadow.shared = TargetHeads(live.shared.embed_tokens, live.shared.lm_head)
    shadow.to_empty(device=live.fc.weight.device).float()
    _copy_into(shadow, live)
    return shadow.train()


@torch.inference_mode()
def _copy_into(dst: DraftModel, src: DraftModel) -> None:
    """dst's own parameters from src's of the same names (in place: a CUDA graph keeps reading them;
    in inference mode: the live drafter's may be inference tensors)."""
    params = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        if not name.startswith(FROZEN):
            p.copy_(params[name])
