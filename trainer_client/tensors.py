"""Arrow rollout table -> padded torch tensors, and the trainer-side replay of the sampling mask.

`to_torch` turns a table in the one rollout schema into a `RolloutBatch` of right-padded
tensors built with numpy from the Arrow offsets (no per-token Python loop). `masked_logprobs`
is the replay that removes the truncation mismatch (docs/masks.md): the trainer's
log-probability of each rollout token renormalised over the support the token was sampled
from, so the importance ratio compares the same action space on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

PROMPT_PAD = -1
TOKEN_PAD = 0
SUPPORT_PAD = -1


@dataclass
class RolloutBatch:
    """One row per sample, right-padded. Prompt ids pad with -1 (they are not meant to be
    embedded as they are: concatenate `prompt_ids[b, :prompt_lens[b]]` with the output);
    output tokens pad with 0 and `loss_mask` marks the real ones. `support_ids` is None when
    the rollout has no masks, `support_logprobs` None unless its mask mode was "support"."""

    prompt_ids: Tensor  # [B, P] int64, -1 pad
    prompt_lens: Tensor  # [B] int64
    token_ids: Tensor  # [B, L] int64, 0 pad
    token_logprobs: Tensor  # [B, L] float32, 0 pad
    loss_mask: Tensor  # [B, L] bool
    support_ids: Tensor | None  # [B, L, W] int64, -1 pad
    support_logprobs: Tensor | None  # [B, L, W] float32, -inf pad
    policy_version: Tensor  # [B] int64
    request_id: list[str]
    prompt_index: list[int]
    sample_index: list[int]
    finish_reason: list[str]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on `device`; the lists are shared."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})


def to_torch(table: pa.Table) -> RolloutBatch:
    """Collate a rollout table (rollout.schema.ROLLOUT_SCHEMA) into padded tensors.

    Raises ValueError when masks are present for some rows but not others, or when a row's
    masks are not aligned one per output token.
    """
    table = table.combine_chunks()
    prompt_ids, prompt_lens = _pad_lists(_column(table, "prompt_token_ids"), PROMPT_PAD, np.int64)
    token_ids, token_lens = _pad_lists(_column(table, "token_ids"), TOKEN_PAD, np.int64)
    token_logprobs, _ = _pad_lists(_column(table, "token_logprobs"), 0.0, np.float32)
    loss_mask = np.arange(token_ids.shape[1])[None, :] < token_lens[:, None]
    support_ids = _pad_nested(table, "support_ids", SUPPORT_PAD, np.int64, token_ids.shape[1], token_lens)
    support_logprobs = _pad_nested(
        table, "support_logprobs", -np.inf, np.float32, token_ids.shape[1], token_lens
    )
    return RolloutBatch(
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_lens=torch.from_numpy(prompt_lens),
        token_ids=torch.from_numpy(token_ids),
        token_logprobs=torch.from_numpy(token_logprobs),
        loss_mask=torch.from_numpy(loss_mask),
        support_ids=None if support_ids is None else torch.from_numpy(support_ids),
        support_logprobs=None if support_logprobs is None else torch.from_numpy(support_logprobs),
        policy_version=torch.from_numpy(table.column("policy_version").to_numpy().astype(np.int64)),
        request_id=table.column("request_id").to_pylist(),
        prompt_index=table.column("prompt_index").to_pylist(),
        sample_index=table.column("sample_index").to_pylist(),
        finish_reason=table.column("finish_reason").to_pylist(),
    )


def masked_logprobs(logits: Tensor, batch: RolloutBatch, temperature: float = 1.0) -> Tensor:
    """The trainer's log-probs of the rollout tokens, renormalised over the rollout's supports.

    logits: [B, L, V], `logits[b, j]` being the trainer's logits that predict
    `batch.token_ids[b, j]` (already shifted). Computes log_softmax(logits / temperature)
    restricted to `support_ids[b, j]` at the token, by gathering the support instead of
    masking the vocabulary (no [B, L, V] copy). Singleton (greedy) supports give exactly 0;
    padding gives 0; without masks it is the plain log-softmax. Differentiable w.r.t. logits.
    Raises ValueError when a token or support id is outside the logits' vocabulary [0, V) (on
    CUDA such a gather is a device-side assert that kills the process). Returns [B, L] float32.
    """
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 (greedy rollouts have singleton supports), got {temperature}"
        )
    if logits.shape[:2] != batch.token_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match token_ids {tuple(batch.token_ids.shape)}"
        )
    _check_ids(batch, logits.shape[-1])
    device = logits.device
    tokens = batch.token_ids.to(device, non_blocking=True)  # [B, L]
    loss_mask = batch.loss_mask.to(device, non_blocking=True)  # [B, L]
    z_tok = logits.gather(-1, tokens[..., None]).squeeze(-1).float() / temperature  # [B, L]
    if batch.support_ids is None:
        lse = torch.logsumexp(logits.float() / temperature, dim=-1)  # [B, L]
    else:
        support = batch.support_ids.to(device, non_blocking=True)  # [B, L, W]
        valid = support >= 0
        valid[..., 0] |= ~loss_mask  # padding rows keep one finite entry: no NaN gradients
        z_sup = logits.gather(-1, support.clamp(min=0)).float() / temperature  # [B, L, W]
        lse = torch.logsumexp(z_sup.masked_fill(~valid, float("-inf")), dim=-1)  # [B, L]
    return torch.where(loss_mask, z_tok - lse, torch.zeros_like(lse))


def _check_ids(batch: RolloutBatch, vocab_size: int) -> None:
    """Token ids in [0, V), support ids in [0, V) or the -1 pad: one reduction and one read back
    per batch, on the device the batch is on (none on the host)."""
    named = [("token_ids", batch.token_ids, 0)]
    if batch.support_ids is not None:
        named.append(("support_ids", batch.support_ids, SUPPORT_PAD))
    named = [(name, ids, lowest) for name, ids, lowest in named if ids.numel()]
    if not named:
        return
    bounds = torch.stack([b for _, ids, _ in named for b in torch.aminmax(ids)]).tolist()  # [min, max, ...]
    for (name, _, lowest), lo, hi in zip(named, bounds[0::2], bounds[1::2]):
        if lo < lowest or hi >= vocab_size:
            bad = lo if lo < lowest else hi
            raise ValueError(f"{name} holds id {bad}, outside the logits' vocabulary [0, {vocab_size})"
                             + (" (-1 pads supports)" if lowest < 0 else ""))


def _column(table: pa.Table, name: str) -> pa.ListArray:
    col = table.column(name)
    return col.chunk(0) if col.num_chunks else pa.array([], type=col.type)


def _ranges(offsets: np.ndarray, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expand the child ranges of `owners`: for every child element, (owner slot, index in its
    list, index into the child array). `offsets` are the list array's absolute offsets."""
    starts, lens = offsets[owners], offsets[owners + 1] - offsets[owners]
    slot = np.repeat(np.arange(len(owners)), lens)
    k = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    return slot, k, np.repeat(starts, lens) + k


def _pad_lists(arr: pa.ListArray, pad, dtype) -> tuple[np.ndarray, np.ndarray]:
    """list<scalar> -> ([B, max len] padded, [B] lengths)."""
    offsets = arr.offsets.to_numpy().astype(np.int64)
    lens = np.diff(offsets)
    out = np.full((len(arr), int(lens.max(initial=0))), pad, dtype=dtype)
    slot, k, src = _ranges(offsets, np.arange(len(arr)))
    out[slot, k] = arr.values.to_numpy(zero_copy_only=False)[src]
    return out, lens


def _pad_nested(table: pa.Table, name: str, pad, dtype, width_l: int, token_lens: np.ndarray):
    """list<list<scalar>> -> [B, L, W] padded, or None when the column is null for every row."""
    outer = _column(table, name)
    if outer.null_count == len(outer):
        return None
    if outer.null_count:
        raise ValueError(f"{name} is null for some samples but not others: collate them separately")
    outer_offsets = outer.offsets.to_numpy().astype(np.int64)
    if not np.array_equal(np.diff(outer_offsets), token_lens):
        raise ValueError(f"{name} is not aligned one per output token")
    row, pos, token_src = _ranges(outer_offsets, np.arange(len(outer)))
    inner_offsets = outer.values.offsets.to_numpy().astype(np.int64)
    widths = inner_offsets[token_src + 1] - inner_offsets[token_src]
    out = np.full((len(outer), width_l, int(widths.max(initial=0))), pad, dtype=dtype)
    slot, k, src = _ranges(inner_offsets, token_src)
    out[row[slot], pos[slot], k] = outer.values.values.to_numpy(zero_copy_only=False)[src]
    return out
