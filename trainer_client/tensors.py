"""Arrow rollout table -> padded torch tensors, and the trainer-side replay of the sampling mask.

`to_torch` turns a table in the one rollout schema into a `RolloutBatch` of right-padded
tensors built with numpy from the Arrow offsets (no per-token Python loop), with each row's
sampling settings. `RolloutBatch.model_inputs()` / `output_logits()` run the batch through a
causal LM in one forward; `masked_logprobs` is the replay that removes the truncation mismatch
(docs/masks.md): the trainer's log-probability of each rollout token at the row's own
temperature, renormalised over the support the token was sampled from, so the importance ratio
compares the same action space on both sides:

    batch = to_torch(table)
    logits = model(**batch.model_inputs()).logits      # [B, T, V]
    logp = masked_logprobs(batch.output_logits(logits), batch)   # [B, L]
"""

from __future__ import annotations

from collections import Counter
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
    embedded as they are: `model_inputs()` joins each prompt with its output); output tokens pad
    with 0 and `loss_mask` marks the real ones. `support_ids` is None when the rollout has no
    masks, `support_logprobs` None unless its mask mode was "support". The sampling settings are
    each row's own (rollout.schema): top_k 0 is off, temperature 0 greedy."""

    prompt_ids: Tensor  # [B, P] int64, -1 pad
    prompt_lens: Tensor  # [B] int64
    token_ids: Tensor  # [B, L] int64, 0 pad
    token_logprobs: Tensor  # [B, L] float32, 0 pad
    loss_mask: Tensor  # [B, L] bool
    support_ids: Tensor | None  # [B, L, W] int64, -1 pad
    support_logprobs: Tensor | None  # [B, L, W] float32, -inf pad
    policy_version: Tensor  # [B] int64
    temperature: Tensor  # [B] float32
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32
    min_p: Tensor  # [B] float32
    request_id: list[str]
    prompt_index: list[int]
    sample_index: list[int]
    finish_reason: list[str]
    seed: list[int | None]
    grammar_kind: list[str | None]
    mask_mode: list[str]
    stop_reason: list[str | None]
    text: list[str | None]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on `device`; the lists are shared."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})

    def model_inputs(self, pad_token_id: int = 0) -> dict[str, Tensor]:
        """The batch as one forward of a causal LM (transformers' keyword names), on the batch's
        device: `input_ids` [B, T] int64, each row's prompt then its output tokens, right-padded
        with `pad_token_id`; `attention_mask` [B, T] int64, 1 on real tokens; `position_ids` [B, T]
        int64, 0.. along each row (0 on padding). T = the longest prompt + output."""
        lens = self.prompt_lens + self.loss_mask.sum(1)  # [B]
        width = int(lens.max()) if len(lens) else 0
        cols = torch.arange(width, device=lens.device)  # [T]
        ids = torch.full((len(lens), width), pad_token_id, dtype=torch.int64, device=lens.device)  # [B, T]
        in_prompt = self.prompt_ids >= 0  # [B, P]
        ids[:, : self.prompt_ids.shape[1]][in_prompt] = self.prompt_ids[in_prompt]
        rows = torch.arange(len(lens), device=lens.device)[:, None].expand_as(self.token_ids)  # [B, L]
        out_cols = self.prompt_lens[:, None] + torch.arange(self.token_ids.shape[1], device=lens.device)  # [B, L]
        ids[rows[self.loss_mask], out_cols[self.loss_mask]] = self.token_ids[self.loss_mask]
        attention = (cols[None, :] < lens[:, None]).long()  # [B, T]
        return dict(input_ids=ids, attention_mask=attention, position_ids=cols[None, :] * attention)

    def output_logits_index(self) -> Tensor:
        """[B, L] int64: the position in `model_inputs()` whose logits predict output token j of
        row b, `prompt_lens[b] - 1 + j` (padding positions point at the row's last position)."""
        last = self.prompt_lens + self.loss_mask.sum(1) - 1  # [B]
        index = self.prompt_lens[:, None] - 1 + torch.arange(self.token_ids.shape[1], device=last.device)
        return torch.minimum(index, last[:, None])

    def output_logits(self, logits: Tensor) -> Tensor:
        """A causal LM's logits over `model_inputs()` ([B, T, V]) -> the logits predicting each output
        token, [B, L, V] (what `masked_logprobs` takes). Differentiable."""
        index = self.output_logits_index().to(logits.device)  # [B, L]
        needed = int(index.max()) + 1 if index.numel() else 0
        if logits.dim() != 3 or logits.shape[0] != index.shape[0] or logits.shape[1] < needed:
            raise ValueError(f"logits {tuple(logits.shape)} are not [B, T, V] over model_inputs() "
                             f"({index.shape[0]} rows)")
        return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))

    def __repr__(self) -> str:
        out_lens = self.loss_mask.sum(1).tolist()
        masks = self.mask_mode[0] if len(set(self.mask_mode)) == 1 else "/".join(sorted(set(self.mask_mode)))
        if self.support_ids is not None:
            masks += f" (width <= {self.support_ids.shape[-1]})"
        settings = ", ".join(f"{name} {_values(getattr(self, name).tolist())}"
                             for name in ("temperature", "top_k", "top_p", "min_p"))
        finish = ", ".join(f"{k} {v}" for k, v in sorted(Counter(self.finish_reason).items()))
        return (f"RolloutBatch({len(out_lens)} samples, prompts {_span(self.prompt_lens.tolist())} tokens, "
                f"outputs {_span(out_lens)} tokens ({sum(out_lens)} in all), masks {masks}, {settings}, "
                f"finish {finish or '-'}, policy_version {_values(self.policy_version.tolist())})")


def _span(values: list[int]) -> str:
    return "-" if not values else f"{min(values)}" if min(values) == max(values) else f"{min(values)}..{max(values)}"


def _values(values: list) -> str:
    distinct = sorted(set(round(v, 4) if isinstance(v, float) else v for v in values))
    return "-" if not distinct else "/".join(map(str, distinct[:4])) + ("/..." if len(distinct) > 4 else "")


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
    numbers = {name: torch.from_numpy(table.column(name).to_numpy().astype(dtype)) for name, dtype in
               (("policy_version", np.int64), ("temperature", np.float32), ("top_k", np.int64),
                ("top_p", np.float32), ("min_p", np.float32))}
    lists = {name: table.column(name).to_pylist() for name in
             ("request_id", "prompt_index", "sample_index", "finish_reason", "seed", "grammar_kind", "mask_mode",
              "stop_reason", "text")}
    return RolloutBatch(
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_lens=torch.from_numpy(prompt_lens),
        token_ids=torch.from_numpy(token_ids),
        token_logprobs=torch.from_numpy(token_logprobs),
        loss_mask=torch.from_numpy(loss_mask),
        support_ids=None if support_ids is None else torch.from_numpy(support_ids),
        support_logprobs=None if support_logprobs is None else torch.from_numpy(support_logprobs),
        **numbers,
        **lists,
    )


def masked_logprobs(logits: Tensor, batch: RolloutBatch, temperature: float | None = None) -> Tensor:
    """The trainer's log-probs of the rollout tokens, renormalised over the rollout's supports.

    logits: [B, L, V], `logits[b, j]` being the trainer's logits that predict
    `batch.token_ids[b, j]` (already shifted: `batch.output_logits`). Computes
    log_softmax(logits / t_b) restricted to `support_ids[b, j]` at the token, t_b being row b's
    own temperature (`batch.temperature`; a greedy row, t_b = 0, is scaled by 1: with masks its
    singleton support gives exactly 0), by gathering the support instead of masking the
    vocabulary (no [B, L, V] copy with masks). Padding gives 0; without masks it is the plain
    log-softmax. Differentiable w.r.t. logits. `temperature`, when given, is checked, never used:
    it must equal every row's temperature (ValueError otherwise), so a trainer that states the
    temperature it expects learns when the rollout used another. Raises ValueError when a token or
    support id is outside the logits' vocabulary [0, V) (on CUDA such a gather is a device-side
    assert that kills the process). Returns [B, L] float32.
    """
    if logits.shape[:2] != batch.token_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match token_ids {tuple(batch.token_ids.shape)}"
        )
    _check_temperature(batch, temperature)
    _check_ids(batch, logits.shape[-1])
    device = logits.device
    tokens = batch.token_ids.to(device, non_blocking=True)  # [B, L]
    loss_mask = batch.loss_mask.to(device, non_blocking=True)  # [B, L]
    temps = batch.temperature.to(device, non_blocking=True)  # [B]
    scale = torch.where(temps > 0, temps, torch.ones_like(temps))[:, None]  # [B, 1]
    z_tok = logits.gather(-1, tokens[..., None]).squeeze(-1).float() / scale  # [B, L]
    if batch.support_ids is None:
        lse = torch.logsumexp(logits.float() / scale[..., None], dim=-1)  # [B, L]
    else:
        support = batch.support_ids.to(device, non_blocking=True)  # [B, L, W]
        valid = support >= 0
        valid[..., 0] |= ~loss_mask  # padding rows keep one finite entry: no NaN gradients
        z_sup = logits.gather(-1, support.clamp(min=0)).float() / scale[..., None]  # [B, L, W]
        lse = torch.logsumexp(z_sup.masked_fill(~valid, float("-inf")), dim=-1)  # [B, L]
    return torch.where(loss_mask, z_tok - lse, torch.zeros_like(lse))


def _check_temperature(batch: RolloutBatch, temperature: float | None) -> None:
    """An explicit temperature must be every row's (compared in float32, the column's type)."""
    if temperature is None:
        return
    rows = batch.temperature.cpu()
    if not bool((rows == torch.tensor(float(temperature), dtype=rows.dtype)).all()):
        seen = sorted(set(rows.tolist()))
        raise ValueError(f"temperature={temperature} disagrees with the rollout's rows (temperature "
                         f"{'/'.join(f'{t:g}' for t in seen[:6])}); omit it to use each row's own")


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
