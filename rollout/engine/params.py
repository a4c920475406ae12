"""Sampling parameters of one request, validated where they enter (docs/sampling.md).

Pure Python, no torch: the scheduler and the server import it. Every range check raises
`InvalidArgument` naming the field and the allowed range.

The ranges are those the engine can compute in float32 (rollout/engine/sampler.py): a value
that is finite here but not there (`top_p=1e-46` rounds to 0, `temperature=1e39` to inf) or
that overflows a step of the sampling distribution (`logits / 1e-39`,
`logits / repetition_penalty=1e-38`) is refused here, by name, instead of failing
mid-request. With temperature >= 1e-5 and repetition_penalty in [1e-3, 1e3], |logits| up to
~1e30 stay finite through every step. A nonzero float below float32's smallest normal number
(~1.18e-38) is refused: on the device it is 0 or a subnormal that fast-math kernels flush to 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rollout.errors import InvalidArgument
from rollout.masks import MASK_MODES

FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number
TEMPERATURE_RANGE = (1e-5, 1e5)  # besides 0 (greedy)
REPETITION_PENALTY_RANGE = (1e-3, 1e3)


@dataclass
class SamplingParams:
    """The sampling distribution's parameters (docs/sampling.md). `top_k <= 0` disables top-k;
    `top_p == 1` and `min_p == 0` disable theirs; penalties of 1 / 0 / 0 are off.
    `temperature == 0` is greedy.

    Ranges (`validate`): temperature 0 or [1e-5, 1e5]; top_p (0, 1]; min_p [0, 1];
    repetition_penalty [1e-3, 1e3]; frequency / presence penalties [-2, 2]; logit_bias values
    [-100, 100]; nonzero floats at least float32's smallest normal number in magnitude."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def support_bound(self) -> int:
        """The most tokens a mask of these parameters may hold (docs/masks.md): top_k, 1 when greedy."""
        return 1 if self.greedy else self.top_k

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> SamplingParams:
        """Check every field; returns self so calls chain. Raises InvalidArgument."""
        _temperature(self.temperature)
        if not isinstance(self.top_k, int) or self.top_k > vocab_size:
            raise InvalidArgument("top_k", f"must be an integer <= vocab size {vocab_size} (<= 0 = off)")
        _in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _in_range("min_p", self.min_p, 0.0, 1.0)
        _in_range("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        for tok, bias in self.logit_bias.items():
            _token_id("logit_bias", tok, vocab_size)
            _in_range("logit_bias", bias, -100.0, 100.0, subject=f"the bias for token {tok} must be")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be an integer >= 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for tok in self.stop_token_ids:
            _token_id("stop_token_ids", tok, vocab_size)
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidArgument("seed", f"must be an integer in [0, 2^63), got {self.seed}")
        return self


def validate_mask_request(mask: str | None, params: SamplingParams, max_mask_tokens: int) -> None:
    """The mask bounds (docs/masks.md): a mask request needs temperature 0 or 1 <= top_k <= max_mask_tokens."""
    if mask is None or mask == "":
        return
    if mask not in MASK_MODES:
        raise InvalidArgument("mask", f"must be one of {MASK_MODES} or unset, got {mask!r}")
    if params.greedy:
        return
    if not 1 <= params.top_k <= max_mask_tokens:
        raise InvalidArgument(
            "top_k",
            f"a mask request at temperature > 0 needs 1 <= top_k <= max_mask_tokens={max_mask_tokens}, "
            f"got {params.top_k}",
        )


def _temperature(value: float) -> None:
    lo, hi = TEMPERATURE_RANGE
    if not _is_number(value) or not (value == 0.0 or lo <= value <= hi):
        raise InvalidArgument("temperature", f"must be 0 (greedy) or in [{lo:g}, {hi:g}] (the engine divides "
                                             f"float32 logits by it), got {value!r}")


def _in_range(name: str, value: float, lo: float, hi: float, low_open: bool = False, subject: str = "") -> None:
    """lo <= value <= hi (lo < value if low_open), and a nonzero value must be a normal float32."""
    allowed = f"{'(' if low_open else '['}{lo:g}, {hi:g}]"
    if not _is_number(value) or not lo <= value <= hi or (low_open and value == lo):
        raise InvalidArgument(name, f"{subject or 'must be'} in {allowed}, got {value!r}")
    if value != 0.0 and abs(value) < FLOAT32_TINY:
        raise InvalidArgument(name, f"{subject or 'must be'} in {allowed} and, unless 0, at least float32's "
                                    f"smallest normal number {FLOAT32_TINY:.8g} in magnitude (the engine computes "
                                    f"in float32), got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _token_id(name: str, tok: int, vocab_size: int) -> None:
    if not isinstance(tok, int) or not 0 <= tok < vocab_size:
        raise InvalidArgument(name, f"token id {tok!r} is outside the vocabulary [0, {vocab_size})")
