"""The mask contract's validator (docs/masks.md): checks a rollout table's tokens, log-probs and masks, for CI.

`check_table` walks a `pyarrow.Table` in the one rollout schema, one sample at a time, with
numpy over the sample's flattened supports (no per-token Python loop), and returns a
`CheckReport` whose violations name the sample (request_id, prompt_index, sample_index) and
the output position. Token ids (prompt, output, support) are checked against the vocabulary
size the schema metadata carries (`vocab_size`; without it only that they are >= 0).
`main` is `rollout validate FILE`: it reads an Arrow IPC file or stream, prints a summary, and
exits 0 when clean, 1 on any violation, 2 when the input cannot be checked (unreadable, not
Arrow, corrupted buffers such as list offsets, or malformed schema metadata), with a one-line
reason. Every "within tolerance" test is written so that NaN fails it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from rollout.errors import InvalidArgument
from rollout.masks import MASK_MODES
from rollout.schema import MASK_TOP_K_KEY, ROLLOUT_SCHEMA, VOCAB_SIZE_KEY

FINISH_REASONS = ("stop", "length", "abort")
WIDTH_KEYS = (b"max_mask_tokens", MASK_TOP_K_KEY.encode())
MASK_MODE_KEY = b"mask_mode"
NO_MASK_MODES = ("none", "")


@dataclass(frozen=True)
class Violation:
    """One broken rule. `position` is the output token index, None for a whole-sample rule."""

    rule: str
    message: str
    request_id: str | None = None
    prompt_index: int | None = None
    sample_index: int | None = None
    position: int | None = None

    def __str__(self) -> str:
        where = f"{self.request_id}[prompt {self.prompt_index}, sample {self.sample_index}]"
        if self.position is not None:
            where += f" position {self.position}"
        return f"{where}: {self.rule}: {self.message}"


@dataclass
class CheckReport:
    """Totals over the table and the violations found (the first `max_kept` are kept)."""

    samples: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    support_total: int = 0
    max_support_width: int = 0
    num_violations: int = 0
    violations: list[Violation] = field(default_factory=list)
    max_kept: int = 1000
    vocab_size: int | None = None  # token ids were checked against it (None: only that they are >= 0)

    @property
    def ok(self) -> bool:
        return self.num_violations == 0

    @property
    def mean_support_width(self) -> float:
        return self.support_total / self.masked_tokens if self.masked_tokens else 0.0

    def add(self, violation: Violation) -> None:
        self.num_violations += 1
        if len(self.violations) < self.max_kept:
            self.violations.append(violation)

    def summary(self, shown: int = 20) -> str:
        unchecked = "" if self.vocab_size is not None else (
            "; token ids not checked against a vocabulary size: no vocab_size in the schema metadata")
        head = (
            f"{self.samples} samples, {self.tokens} tokens, {self.masked_tokens} masked "
            f"(support width mean {self.mean_support_width:.2f}, max {self.max_support_width}{unchecked}): "
        )
        if self.ok:
            return head + "OK"
        lines = [head + f"{self.num_violations} violations"]
        lines += [f"  {v}" for v in self.violations[:shown]]
        if self.num_violations > shown:
            lines.append(f"  ... and {self.num_violations - shown} more")
        return "\n".join(lines)


@dataclass
class _Sample:
    """One row as numpy: supports flattened, `widths[j]` entries for token j."""

    prompt: np.ndarray  # [P] int64
    tokens: np.ndarray  # [L] int64
    token_logp: np.ndarray  # [L] float64
    widths: np.ndarray | None  # [M] int64, M = number of masks (None: no masks)
    sup_ids: np.ndarray | None  # [sum(widths)] int64
    lp_widths: np.ndarray | None  # [M'] int64 (None: no support logprobs)
    sup_logp: np.ndarray | None  # [sum(lp_widths)] float64


@dataclass(frozen=True)
class _Meta:
    """What the schema metadata says about the rows."""

    mode: str  # "none", "selected" or "support"
    bound: int | None  # the support width bound
    vocab_size: int | None


def check_table(table: pa.Table, tol: float = 1e-3, max_width: int | None = None) -> CheckReport:
    """Check every sample of `table` against docs/masks.md (see the module docstring).

    max_width bounds the support width (the requests' top_k); the schema metadata key
    "max_mask_tokens" or "mask_top_k" (the server writes the request's top_k), when present, is
    a bound too; the smallest one applies. Raises InvalidArgument (malformed schema metadata)
    or pyarrow.ArrowInvalid (corrupted buffers, e.g. list offsets): the table cannot be checked.
    """
    report = CheckReport()
    if not table.schema.equals(ROLLOUT_SCHEMA, check_metadata=False):
        report.add(
            Violation("schema", f"table schema differs from rollout.schema.ROLLOUT_SCHEMA:\n{table.schema}")
        )
        return report
    meta = _read_metadata(table.schema.metadata or {}, max_width)
    table.validate(full=True)  # offsets, lengths and UTF-8 before any buffer is indexed
    report.vocab_size = meta.vocab_size
    table = table.combine_chunks()
    for r, sample in enumerate(_samples(table)):
        ident = {k: table.column(k)[r].as_py() for k in ("request_id", "prompt_index", "sample_index")}
        finish = table.column("finish_reason")[r].as_py()
        problems = _check_sample(sample, finish, meta, tol)
        for position, rule, message in problems:
            report.add(Violation(rule, message, position=position, **ident))
        _count(report, sample)
    return report


def _read_metadata(meta: dict[bytes, bytes], max_width: int | None) -> _Meta:
    """Parse the schema metadata the checks use; InvalidArgument names a malformed key."""
    mode = _meta_text(meta, MASK_MODE_KEY) or "none"
    if mode not in MASK_MODES + NO_MASK_MODES:
        raise InvalidArgument("schema metadata mask_mode", f"must be one of {MASK_MODES + NO_MASK_MODES}, "
                                                           f"got {mode!r}")
    bounds = [b for b in (max_width, *(_meta_int(meta, k) for k in WIDTH_KEYS)) if b]
    return _Meta(mode, min(bounds) if bounds else None, _meta_int(meta, VOCAB_SIZE_KEY.encode()))


def _meta_text(meta: dict[bytes, bytes], key: bytes) -> str | None:
    if key not in meta:
        return None
    try:
        return meta[key].decode()
    except UnicodeDecodeError:
        raise InvalidArgument(f"schema metadata {key.decode()}", f"is not UTF-8: {meta[key][:40]!r}") from None


def _meta_int(meta: dict[bytes, bytes], key: bytes) -> int | None:
    """A positive integer value, or None when the key is absent."""
    text = _meta_text(meta, key)
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise InvalidArgument(f"schema metadata {key.decode()}", f"must be a positive integer, got {text[:40]!r}")
    return int(text)


def _count(report: CheckReport, s: _Sample) -> None:
    report.samples += 1
    report.tokens += len(s.tokens)
    if s.widths is not None and len(s.widths):
        report.masked_tokens += len(s.widths)
        report.support_total += int(s.widths.sum())
        report.max_support_width = max(report.max_support_width, int(s.widths.max()))


def _check_sample(s: _Sample, finish: str, meta: _Meta, tol: float) -> list[tuple]:
    """All rule checks of one sample -> [(position | None, rule, message)]."""
    out: list[tuple] = []
    n = len(s.tokens)
    if finish not in FINISH_REASONS:
        out.append((None, "finish_reason", f"{finish!r} is not one of {FINISH_REASONS}"))
    out += _check_vocabulary(s, meta.vocab_size)
    if len(s.token_logp) != n:
        out.append((None, "token_logprobs", f"{len(s.token_logp)} logprobs for {n} tokens"))
        return out
    for j in np.flatnonzero(~(np.isfinite(s.token_logp) & (s.token_logp <= tol))):
        out.append((int(j), "token_logprobs", f"logprob {s.token_logp[j]} is not a finite value <= 0"))
    return out + _check_masks(s, meta.mode, meta.bound, tol)


def _check_vocabulary(s: _Sample, vocab_size: int | None) -> list[tuple]:
    """Every prompt, output and support id in [0, vocab_size) ([0, inf) without a size)."""
    hi = np.inf if vocab_size is None else vocab_size
    where = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"

    def outside(ids: np.ndarray) -> np.ndarray:
        return (ids < 0) | (ids >= hi)

    out: list[tuple] = []
    bad_prompt = s.prompt[outside(s.prompt)]
    if len(bad_prompt):
        out.append((None, "vocabulary", f"prompt token id {bad_prompt[0]} is not in {where}"))
    for j in np.flatnonzero(outside(s.tokens)):
        out.append((int(j), "vocabulary", f"token id {s.tokens[j]} is not in {where}"))
    if s.widths is not None:
        seg = np.repeat(np.arange(len(s.widths)), s.widths)  # [sum(widths)] token index of each entry
        bad = outside(s.sup_ids)
        for j in np.unique(seg[bad]):
            first = s.sup_ids[bad & (seg == j)][0]
            out.append((int(j), "vocabulary", f"support id {first} is not in {where}"))
    return out


def _check_masks(s: _Sample, mode: str, bound: int | None, tol: float) -> list[tuple]:
    """Presence and alignment of the mask columns, then the per-support rules."""
    out: list[tuple] = []
    n = len(s.tokens)
    if s.widths is None:
        if mode in MASK_MODES:
            out.append((None, "one mask per token", f"mask_mode is {mode!r} but support_ids is null"))
        if s.lp_widths is not None:
            out.append((None, "support_logprobs", "support_logprobs present without support_ids"))
        return out
    if len(s.widths) != n:
        out.append((None, "one mask per token", f"{len(s.widths)} masks for {n} tokens"))
        return out
    out += _check_supports(s, bound)
    if s.lp_widths is None:
        if mode == "support":
            out.append((None, "support_logprobs", "mask_mode is 'support' but support_logprobs is null"))
    elif not np.array_equal(s.lp_widths, s.widths):
        out.append((None, "support_logprobs", "support_logprobs rows are not aligned with support_ids"))
    else:
        if mode == "selected":
            out.append((None, "support_logprobs", "mask_mode is 'selected' but support_logprobs is set"))
        out += _check_support_logprobs(s, tol)
    for j in np.flatnonzero((s.widths == 1) & ~(np.abs(s.token_logp) <= tol)):
        out.append((int(j), "greedy singleton", f"support of width 1 with logprob {s.token_logp[j]}, not 0"))
    return out


def _check_supports(s: _Sample, bound: int | None) -> list[tuple]:
    """Non-empty, within the bound, token inside, no duplicates."""
    out = []
    seg = np.repeat(np.arange(len(s.widths)), s.widths)  # [sum(widths)] token index of each entry
    for j in np.flatnonzero(s.widths == 0):
        out.append((int(j), "support", "empty support"))
    if bound is not None:
        for j in np.flatnonzero(s.widths > bound):
            out.append((int(j), "support width", f"width {s.widths[j]} exceeds top_k bound {bound}"))
    hits = np.bincount(seg, weights=s.sup_ids == s.tokens[seg], minlength=len(s.widths))
    for j in np.flatnonzero((hits == 0) & (s.widths > 0)):
        out.append((int(j), "token in support", f"token {s.tokens[j]} is not in its support"))
    order = np.lexsort((s.sup_ids, seg))
    ids, segs = s.sup_ids[order], seg[order]
    dup = (segs[1:] == segs[:-1]) & (ids[1:] == ids[:-1])
    for j in np.unique(segs[1:][dup]):
        out.append((int(j), "duplicates", "support lists a token id more than once"))
    return out


def _check_support_logprobs(s: _Sample, tol: float) -> list[tuple]:
    """Sorted by probability desc with ties by id, normalised, agreeing with token_logprobs."""
    out = []
    seg = np.repeat(np.arange(len(s.widths)), s.widths)
    lp, ids = s.sup_logp, s.sup_ids
    same = seg[1:] == seg[:-1]
    unsorted = same & ((lp[1:] > lp[:-1]) | ((lp[1:] == lp[:-1]) & (ids[1:] < ids[:-1])))
    for j in np.unique(seg[1:][unsorted]):
        out.append((int(j), "sorted", "support is not sorted by probability desc, ties by id"))
    lse = _segment_logsumexp(lp, s.widths)
    for j in np.flatnonzero((s.widths > 0) & ~(np.abs(lse) <= tol)):
        out.append((int(j), "normalised", f"support logprobs logsumexp to {lse[j]:.6f}, not 0"))
    match = ids == s.tokens[seg]
    token_lp = np.full(len(s.widths), np.nan)
    token_lp[seg[match]] = lp[match]
    found = np.zeros(len(s.widths), dtype=bool)
    found[seg[match]] = True
    for j in np.flatnonzero(found & ~(np.abs(token_lp - s.token_logp) <= tol)):
        out.append(
            (int(j), "token logprob", f"token_logprobs {s.token_logp[j]} != support logprob {token_lp[j]}")
        )
    return out


def _segment_logsumexp(lp: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """logsumexp of each token's support; NaN for empty supports."""
    out = np.full(len(widths), np.nan)
    nonempty = widths > 0
    if not nonempty.any():
        return out
    starts = (np.cumsum(widths) - widths)[nonempty]
    peak = np.maximum.reduceat(lp, starts)  # [num nonempty]
    with np.errstate(invalid="ignore", divide="ignore"):
        total = np.add.reduceat(np.exp(lp - np.repeat(peak, widths[nonempty])), starts)
        out[nonempty] = peak + np.log(total)
    return out


def _samples(table: pa.Table):
    """Yield each row of a single-chunk rollout table as a `_Sample`."""
    prompt, tokens = _lists(table, "prompt_token_ids", np.int64), _lists(table, "token_ids", np.int64)
    token_logp = _lists(table, "token_logprobs", np.float64)
    supports = _nested(table, "support_ids", np.int64)
    sup_logp = _nested(table, "support_logprobs", np.float64)
    for r in range(table.num_rows):
        widths, ids = supports(r)
        lp_widths, lp = sup_logp(r)
        yield _Sample(prompt(r), tokens(r), token_logp(r), widths, ids, lp_widths, lp)


def _lists(table: pa.Table, name: str, dtype):
    """Row accessor for a list<scalar> column: r -> numpy values (nulls become NaN / -1)."""
    arr = _chunk(table, name)
    offs = arr.offsets.to_numpy()
    vals = _values(arr.values, dtype)
    return lambda r: vals[offs[r] : offs[r + 1]]


def _nested(table: pa.Table, name: str, dtype):
    """Row accessor for a list<list<scalar>> column: r -> (widths [M], flat values) or (None, None)."""
    outer = _chunk(table, name)
    outer_offs = outer.offsets.to_numpy()  # into inner: one entry per token
    inner = outer.values
    inner_offs = inner.offsets.to_numpy()  # into vals: one entry per support element
    widths = np.diff(inner_offs)
    vals = _values(inner.values, dtype)
    valid = outer.is_valid().to_numpy(zero_copy_only=False)

    def row(r: int):
        if not valid[r]:
            return None, None
        a, b = outer_offs[r], outer_offs[r + 1]
        return widths[a:b], vals[inner_offs[a] : inner_offs[b]]

    return row


def _chunk(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.chunk(0) if col.num_chunks else pa.array([], type=col.type)


def _values(arr: pa.Array, dtype) -> np.ndarray:
    fill = np.nan if np.issubdtype(dtype, np.floating) else -1
    return arr.fill_null(fill).to_numpy(zero_copy_only=False).astype(dtype)


def read_table(path: str) -> pa.Table:
    """Read an Arrow IPC file (it starts with the magic "ARROW1"), else an IPC stream."""
    with pa.memory_map(path) as source:
        if source.read(6) == b"ARROW1":
            return pa.ipc.open_file(source).read_all()
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def main(argv: list[str]) -> int:
    """`rollout validate FILE`: 0 clean, 1 violations, 2 the input cannot be checked."""
    parser = argparse.ArgumentParser(
        prog="rollout validate", description="Check a rollout against the mask contract (docs/masks.md)."
    )
    parser.add_argument("file", help="Arrow IPC file or stream in the rollout schema")
    parser.add_argument(
        "--max-width", type=int, default=None, help="support width bound (the requests' top_k)"
    )
    parser.add_argument("--tol", type=float, default=1e-3, help="log-probability tolerance")
    args = parser.parse_args(argv)
    try:
        report = check_table(read_table(args.file), tol=args.tol, max_width=args.max_width)
    except (OSError, pa.ArrowException, InvalidArgument) as e:
        reason = " ".join(str(e).split())  # one line, whatever the library's message holds
        print(f"rollout validate: cannot check {args.file}: {reason}", file=sys.stderr)
        return 2
    print(f"{args.file}: {report.summary()}")
    return 0 if report.ok else 1
