"""`rollout generate`: prompts -> Arrow IPC file through a running server.

The file is written as batches arrive and is always closed valid with what arrived: after the
last sample (exit 0), when the server fails the request midway (the error's one line, exit 1), or
on Ctrl-C (exit 130). A Ctrl-C that comes while a batch is being written takes effect right after
it, so the file never ends in half a batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from rollout.engine.params import SamplingParams
from rollout.errors import InvalidArgument
from rollout.masks import MASK_MODES

MASK_HELP = ("sampling masks, one per output token (needs --top-k between 1 and the server's --max-mask-tokens, "
             "or --temperature 0): 'selected' returns support_ids, the token ids of the finite support each token "
             "was drawn from (what top-k / top-p / min-p kept), sorted by probability; 'support' adds "
             "support_logprobs, the policy's log-probabilities over that support (they sum to 1), so a trainer can "
             "renormalise its own logits over the same action space")
_SERVER_DEFAULTS = SamplingParams()
SAMPLING_FLAGS = {  # flag: (type, help); unset flags take the server's defaults (rollout.engine.params)
    "temperature": (float, "sampling temperature; 0 = greedy"),
    "top_k": (int, "keep the k most likely tokens; <= 0 = off"),
    "top_p": (float, "keep the smallest set of tokens whose probability reaches p; 1 = off"),
    "min_p": (float, "drop tokens below min_p times the most likely one's probability; 0 = off"),
    "max_tokens": (int, "most output tokens per sample"),
    "min_tokens": (int, "no EOS / stop token before this many output tokens"),
    "seed": (int, "seed of the request: its samples depend on (seed, prompt, sample, position) alone"),
}
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", nargs="*", help="prompt texts")
    gen.add_argument("--prompts-file", metavar="JSONL", help="more prompts, one per line: a string, a list of "
                     "token ids, or an object with prompt (text) or token_ids (default: none)")
    gen.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of a rollout server")
    gen.add_argument("--out", required=True, help="Arrow IPC file to write (one row per sample)")
    gen.add_argument("-n", "--n", type=int, default=1, help="samples per prompt")
    for name, (kind, text) in SAMPLING_FLAGS.items():
        default = getattr(_SERVER_DEFAULTS, name)
        gen.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                         help=f"{text} (default: the server's, {'none' if default is None else default})")
    gen.add_argument("--mask", choices=MASK_MODES, default=None, help=f"{MASK_HELP} (default: no masks)")
    gen.add_argument("--grammar", default=None, help="constrain the output: grammar text of --grammar-kind "
                     "(default: none)")
    gen.add_argument("--grammar-kind", choices=("json_schema", "regex", "ebnf"), default="regex",
                     help="what --grammar holds")
    gen.add_argument("--request-id", default=None, help="the request's id in every row (default: the server "
                     "assigns one)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline of the whole request in seconds "
                     "(default: none)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")


def read_prompts(texts: list[str], jsonl: str | None) -> list[str | list[int]]:
    """Prompts from arguments, then from a JSONL file whose lines are a string, a list of token
    ids, or an object with "prompt" (text) or "token_ids"."""
    prompts: list[str | list[int]] = list(texts)
    if jsonl:
        try:
            lines = Path(jsonl).read_text().splitlines()
        except OSError as exc:
            raise InvalidArgument("prompts_file", f"cannot read {jsonl}: {exc.strerror}") from exc
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                prompts.append(_jsonl_prompt(line, f"{jsonl}:{lineno}"))
    if not prompts:
        raise InvalidArgument("prompts", "give prompts as arguments or with --prompts-file")
    return prompts


def _jsonl_prompt(line: str, where: str) -> str | list[int]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidArgument("prompts", f"{where}: not JSON ({exc.msg})") from exc
    if isinstance(item, dict):
        item = item.get("token_ids", item.get("prompt"))
    if isinstance(item, str) or (isinstance(item, list) and all(isinstance(t, int) for t in item)):
        return item
    raise InvalidArgument("prompts", f"{where}: expected a string, a list of token ids, or an object with them")


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc
    from tqdm import tqdm

    from trainer_client import RolloutClient

    prompts = read_prompts(args.prompt, args.prompts_file)
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    grammar = (args.grammar_kind, args.grammar) if args.grammar else None
    total = len(prompts) * args.n
    out = ArrowOut(args.out)
    try:
        with DeferredInterrupt() as interrupts, RolloutClient(args.address, timeout=args.timeout) as client, \
                client.stream(prompts, args.n, sampling, args.mask, grammar, args.request_id) as stream, \
                tqdm(total=total, unit="sample", disable=args.quiet) as bar:  # fmt: skip
            for batch in stream:
                with interrupts.deferred():
                    out.write(batch)
                bar.update(batch.num_rows)
    except KeyboardInterrupt:
        out.close()
        print(f"rollout generate: interrupted; wrote the {out.rows} of {total} samples that had arrived to "
              f"{args.out}", file=sys.stderr)
        return INTERRUPTED
    except grpc.RpcError as exc:
        out.close()
        print(f"rollout generate: {rpc_error_line(exc)}", file=sys.stderr)
        if out.rows:
            print(f"rollout generate: kept the {out.rows} of {total} samples that had arrived in {args.out}",
                  file=sys.stderr)
        return 1
    out.close()
    print(f"wrote {out.rows} samples to {args.out}")
    return 0


def rpc_error_line(exc: Any) -> str:
    """A gRPC error as "STATUS: message" on one line."""
    code, details = exc.code(), exc.details() or ""
    return f"{code.name if code is not None else 'UNKNOWN'}: {' '.join(details.split())}"


class ArrowOut:
    """The output file, opened with the first batch's schema (the empty rollout schema if none came)."""

    def __init__(self, path: str):
        self.path, self.rows = path, 0
        self._writer: Any = None
        self._closed = False

    def write(self, batch) -> None:
        import pyarrow as pa

        if self._writer is None:
            self._writer = pa.ipc.new_file(self.path, batch.schema)
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is None:
            import pyarrow as pa

            from rollout.schema import ROLLOUT_SCHEMA

            self._writer = pa.ipc.new_file(self.path, ROLLOUT_SCHEMA)
        self._writer.close()


class DeferredInterrupt:
    """SIGINT raises KeyboardInterrupt as usual, except inside `deferred()`, where it waits until the
    block is done. On a thread other than the main one (where no signal arrives) it does nothing."""

    def __init__(self):
        self._deferring = self._pending = False
        self._previous: Any = None

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum, frame) -> None:
        if self._deferring:
            self._pending = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self):
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            raise KeyboardInterrupt
