"""`rollout validate`'s rules for the sampling settings each row carries (rollout.schema), checked
against the row's tokens and masks.

* the settings are ones a request could have had: temperature 0 or in the engine's range,
  top_p in (0, 1], min_p in [0, 1], seed >= 0, grammar_kind and mask_mode known;
* mask_mode says which mask columns the row has (rollout.masks.check reads it per row), and a
  masked row at temperature > 0 had a finite top_k (the mask bound of docs/masks.md);
* a greedy row (temperature 0) has log-prob 0 at every token, and a support of one token;
* a support is never wider than the row's top_k (the width rule of rollout.masks.check, with
  the row's own bound);
* in support mode, min_p: every token of a support has at least min_p times the probability of
  its most likely one (min-p drops the others, and renormalising keeps the ratios);
* stop_reason is set only on a row that finished with "stop".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rollout.masks import GRAMMAR_KINDS, MASK_MODES, TEMPERATURE_RANGE
from rollout.schema import NO_MASK

_COLUMNS = ("finish_reason", "temperature", "top_k", "top_p", "min_p", "seed", "grammar_kind", "mask_mode",
            "stop_reason")
_REQUIRED = ("temperature", "top_k", "top_p", "min_p", "mask_mode")  # never null in a valid row


@dataclass(frozen=True)
class RowSettings:
    """One row's finish reason and sampling settings."""

    finish_reason: str
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    grammar_kind: str | None
    mask_mode: str
    stop_reason: str | None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def width_bound(self, other: int | None) -> int | None:
        """The widest support the row may have: 1 when greedy, else top_k (if on), and `other`."""
        own = 1 if self.greedy else self.top_k if self.top_k is not None and self.top_k > 0 else None
        bounds = [b for b in (own, other) if b]
        return min(bounds) if bounds else None


def row_settings(table: pa.Table) -> Iterator[RowSettings]:
    """Each row's settings, in row order."""
    columns = [table.column(name).to_pylist() for name in _COLUMNS]
    for values in zip(*columns):
        yield RowSettings(*values)


def check_settings(row: RowSettings, token_logp: np.ndarray, widths: np.ndarray | None,
                   sup_logp: np.ndarray | None, tol: float) -> list[tuple]:
    """The rules of the module docstring for one row -> [(position | None, rule, message)]."""
    null = [name for name in _REQUIRED if getattr(row, name) is None]
    if null:
        return [(None, "settings", f"{', '.join(null)} null")]
    out = _check_values(row)
    if row.mask_mode in MASK_MODES and not row.greedy and row.top_k <= 0:
        out.append((None, "settings", f"a {row.mask_mode!r} mask row at temperature {row.temperature} needs "
                                      f"top_k >= 1, got {row.top_k}"))
    if row.greedy:
        for j in np.flatnonzero(~(np.abs(token_logp) <= tol)):
            out.append((int(j), "greedy", f"temperature 0 but token logprob {token_logp[j]}, not 0"))
    if row.stop_reason is not None and row.finish_reason != "stop":
        out.append((None, "stop_reason", f"{row.stop_reason!r} set on a row that finished with "
                                         f"{row.finish_reason!r}"))
    if row.min_p > 0 and widths is not None and sup_logp is not None and len(sup_logp) == widths.sum():
        out += _check_min_p(row.min_p, widths, sup_logp, tol)
    return out


def _check_values(row: RowSettings) -> list[tuple]:
    lo, hi = TEMPERATURE_RANGE
    checks = [
        ("temperature", row.greedy or lo <= row.temperature <= hi, f"0 or in [{lo:g}, {hi:g}]"),
        ("top_p", 0.0 < row.top_p <= 1.0, "in (0, 1]"),
        ("min_p", 0.0 <= row.min_p <= 1.0, "in [0, 1]"),
        ("seed", row.seed is None or row.seed >= 0, ">= 0 or null"),
        ("grammar_kind", row.grammar_kind is None or row.grammar_kind in GRAMMAR_KINDS,
         f"one of {GRAMMAR_KINDS} or null"),
        ("mask_mode", row.mask_mode in (*MASK_MODES, NO_MASK), f"one of {(*MASK_MODES, NO_MASK)}"),
    ]
    return [(None, "settings", f"{name} {getattr(row, name)!r} is not {allowed}")
            for name, ok, allowed in checks if not ok]


def _check_min_p(min_p: float, widths: np.ndarray, sup_logp: np.ndarray, tol: float) -> list[tuple]:
    """Every support log-prob at least log(min_p) below its support's largest."""
    seg = np.repeat(np.arange(len(widths)), widths)  # [sum(widths)] token index of each entry
    peak = np.full(len(widths), -np.inf)
    np.maximum.at(peak, seg, sup_logp)
    low = ~(sup_logp - peak[seg] >= math.log(min_p) - tol)
    return [(int(j), "min_p", f"a support token has less than min_p={min_p:g} times its most likely one's "
                              f"probability") for j in np.unique(seg[low])]
