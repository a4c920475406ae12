"""`rollout show FILE`: a rollout to look at, in the terminal or as an HTML page (rollout.show_html).

Per sample: its prompt and output text, finish reason (and stop string), acceptance (verify steps,
tokens per step) and sampling settings; `--tokens` adds a table per token: its text, log-prob and
probability, support width, the most likely other tokens of its support, and the verify step that
committed it. Of a step's tokens, all but the last are accepted drafts and the last is the
target's own sample (the correction of a rejected draft, or the bonus after a fully accepted
block), except where the sample's finish cut its last step short.

Text needs the model's tokenizer: `--tokenizer` (a tokenizer.json or a model directory), else the
embedded model's when the file says it came from it; without one, tokens show as ids (and the
output as the `text` column when the rollout has it).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALTERNATIVES = 3  # other support tokens shown per token


def add_show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="Arrow IPC file or stream in the rollout schema (rollout generate --out)")
    parser.add_argument("--tokens", action="store_true", help="a per-token table under each sample")
    parser.add_argument("--html", metavar="OUT", default=None, help="write a self-contained HTML page to OUT")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or model directory (default: the "
                                                          "embedded model's, for its rollouts)")
    parser.add_argument("--samples", type=int, default=20, help="show at most this many samples")


@dataclass
class TokenView:
    """One output token as shown: `piece` is its text ("" for part of a character the next token
    completes), `alternatives` the other support tokens, most likely first, with their
    probabilities (None in "selected" mode)."""

    token_id: int
    piece: str
    logprob: float
    width: int | None  # support width; None without masks
    alternatives: list[tuple[str, float | None]]
    step: int  # the verify step that committed it, from 0
    target: bool  # the step's last token: the target's own sample (correction or bonus)


@dataclass
class SampleView:
    title: str
    facts: list[str]  # finish, acceptance, settings
    prompt: str
    text: str
    tokens: list[TokenView]


def main(args: argparse.Namespace) -> int:
    from rollout.errors import InvalidArgument

    if args.samples < 1:
        raise InvalidArgument("samples", f"must be >= 1, got {args.samples}")
    table = read_rollout(args.file)
    views = sample_views(table, find_tokenizer(args.tokenizer, table), args.samples)
    if args.html:
        from rollout.show_html import render_page

        Path(args.html).write_text(render_page(views, title=Path(args.file).name, total=table.num_rows))
        print(f"wrote {args.html}: {len(views)} samples, {sum(len(v.tokens) for v in views)} tokens")
        return 0
    for view in views:
        print(format_sample(view, args.tokens))
    if table.num_rows > len(views):
        print(f"... {table.num_rows - len(views)} more samples (--samples)")
    return 0


def read_rollout(path: str):
    """The rollout table in `path`; InvalidArgument naming `file` when it is not one."""
    import pyarrow as pa

    from rollout.errors import InvalidArgument
    from rollout.masks.check import read_table
    from rollout.schema import ROLLOUT_SCHEMA

    try:
        table = read_table(path)
    except OSError as e:
        raise InvalidArgument("file", f"cannot read {path}: {e.strerror or e}") from None
    except pa.ArrowException as e:
        raise InvalidArgument("file", f"{path} is not an Arrow IPC file or stream: {e}") from None
    missing = [f.name for f in ROLLOUT_SCHEMA if f.name not in table.column_names]
    if missing:
        raise InvalidArgument("file", f"{path} is not a rollout in this version's schema: no column(s) {missing}")
    return table


def find_tokenizer(path: str | None, table) -> Any:
    """--tokenizer, else the embedded model's for a rollout of it, else None."""
    from rollout.engine.config import DEFAULT_MODEL
    from trainer_client.text import load_tokenizer

    if path is not None:
        return load_tokenizer(path)
    model = (table.schema.metadata or {}).get(b"model", b"").decode(errors="replace")
    if model == DEFAULT_MODEL.name and (DEFAULT_MODEL / "tokenizer.json").is_file():
        return load_tokenizer(DEFAULT_MODEL)
    return None


def sample_views(table, tokenizer: Any, limit: int) -> list[SampleView]:
    """The first `limit` rows of a rollout table as views."""
    rows = table.slice(0, limit).to_pylist()
    return [_view(row, tokenizer) for row in rows]


def _view(row: dict, tokenizer: Any) -> SampleView:
    tokens, steps = row["token_ids"], _steps(row["accept_lengths"], len(row["token_ids"]))
    pieces = _pieces(tokens, tokenizer)
    supports, support_lp = row["support_ids"], row["support_logprobs"]
    views = []
    for j, token in enumerate(tokens):
        width = None if supports is None else len(supports[j])
        others = [] if supports is None else _alternatives(token, supports[j], support_lp and support_lp[j], tokenizer)
        views.append(TokenView(token, pieces[j], row["token_logprobs"][j], width, others, *steps[j]))
    text = row["text"] if row["text"] is not None else "".join(pieces)
    prompt = _decode(row["prompt_token_ids"], tokenizer)
    return SampleView(f"prompt {row['prompt_index']} · sample {row['sample_index']}", _facts(row, views), prompt,
                      text, views)


def _steps(accept_lengths: list[int], n: int) -> list[tuple[int, bool]]:
    """(step, is the step's last token) per token; one step a token when the lengths do not add up."""
    if sum(accept_lengths) != n:
        return [(j, True) for j in range(n)]
    return [(s, k == length - 1) for s, length in enumerate(accept_lengths) for k in range(length)]


def _pieces(tokens: list[int], tokenizer: Any) -> list[str]:
    if tokenizer is None:
        return [f"⟨{t}⟩" for t in tokens]
    from rollout.engine.stops import IncrementalDecoder

    decoder = IncrementalDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    return [decoder.push(t) for t in tokens]


def _decode(ids: list[int], tokenizer: Any) -> str:
    return " ".join(map(str, ids)) if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=False)


def _alternatives(token: int, ids: list[int], logprobs: list[float] | None,
                  tokenizer: Any) -> list[tuple[str, float | None]]:
    """The most likely support tokens other than `token` (supports are sorted by probability)."""
    out = []
    for k, other in enumerate(ids):
        if other != token and len(out) < ALTERNATIVES:
            prob = None if logprobs is None else math.exp(logprobs[k])
            out.append((_decode([other], tokenizer) if tokenizer is not None else f"⟨{other}⟩", prob))
    return out


def _facts(row: dict, tokens: list[TokenView]) -> list[str]:
    finish = row["finish_reason"] + (f" ({row['stop_reason']!r})" if row["stop_reason"] else "")
    steps = len(row["accept_lengths"])
    facts = [f"finish {finish}", f"{len(tokens)} tokens",
             f"{steps} verify steps, {len(tokens) / max(steps, 1):.2f} tokens/step", f"policy v{row['policy_version']}"]
    settings = [f"temperature {row['temperature']:g}", f"top_k {row['top_k'] or 'off'}", f"top_p {row['top_p']:g}",
                f"min_p {row['min_p']:g}", f"seed {row['seed']}", f"mask {row['mask_mode']}"]
    if row["grammar_kind"]:
        settings.append(f"grammar {row['grammar_kind']}")
    if tokens:
        settings.append(f"mean log-prob {sum(t.logprob for t in tokens) / len(tokens):.3f}")
    return facts + settings


def format_sample(view: SampleView, tokens: bool) -> str:
    """The terminal text of one sample."""
    lines = [f"── {view.title} ── " + " · ".join(view.facts[:4]), "   " + " · ".join(view.facts[4:]),
             f"prompt: {view.prompt!r}", f"output: {view.text!r}"]
    if tokens:
        lines.append(f"  {'pos':>4} {'step':>5} {'token':<14} {'logprob':>8} {'prob':>6} {'width':>5}  alternatives")
        for j, t in enumerate(view.tokens):
            step = f"{t.step}{'*' if t.target else ' '}"
            width = "-" if t.width is None else str(t.width)
            others = ", ".join(f"{p!r}" + ("" if q is None else f" {q:.3f}") for p, q in t.alternatives)
            lines.append(f"  {j:>4} {step:>5} {t.piece!r:<14} {t.logprob:>8.3f} {math.exp(t.logprob):>6.3f} "
                         f"{width:>5}  {others}")
        lines.append("  (step*: the step's last token, the target's own sample: a correction or the bonus)")
    return "\n".join(lines) + "\n"
