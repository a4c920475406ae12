"""The `rollout` command: `serve` (the gRPC server), `generate` (prompts -> Arrow IPC file through
a running server), `validate` (Contract 3 checks on such a file) and `demo` (a local server with
the embedded models, one GRPO group with support masks, a readable summary).

Each subcommand is a small function from parsed arguments to an exit status; `main(argv)` is
the console entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.errors import InvalidArgument, RolloutError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: embedded tiny Qwen3)")
    p.add_argument("--draft", default=None, help="drafter directory (default: the embedded one for --spec)")
    p.add_argument("--spec", choices=("none", "dflash", "dspark"), default="none")
    p.add_argument("--spec-block-size", type=int, default=None)
    p.add_argument("--spec-confidence-threshold", type=float, default=0.0)
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="verify per step only the drafts expected to pay, from measured acceptance and step "
                        "costs (--no-spec-adaptive: always full draft blocks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from memory")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.85)
    p.add_argument("--cpu-kv-bytes", type=int, default=256 << 20, help="KV budget on --device cpu")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode / verify steps eagerly on CUDA")
    p.add_argument("--kernel-backend", choices=("auto", "torch", "triton"), default="auto",
                   help="layer kernels: triton (fused; the CUDA default) or the torch reference")
    p.add_argument("--no-shared-prefix-attention", dest="shared_prefix_attention", action="store_false",
                   help="triton backend: read shared prompt blocks once per sequence, not once per group")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse KV blocks of identical prompt prefixes across requests")
    p.add_argument("--load-format", choices=("safetensors", "random"), default="safetensors",
                   help="random: seeded random weights from config.json alone (benchmarks)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-mask-tokens", type=int, default=4096, help="largest top_k a mask request may use")
    p.add_argument("--max-queued-samples", type=int, default=4096, help="beyond: RESOURCE_EXHAUSTED")


def engine_factory(args: argparse.Namespace) -> Callable[[], Any]:
    """Validates the engine configuration now; the engine itself is built on the engine thread."""
    from rollout.engine.config import EngineConfig
    from rollout.engine.engine import LLMEngine

    names = [f.name for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)]
    config = EngineConfig(**{name: getattr(args, name) for name in names})
    return functools.partial(LLMEngine, config)  # picklable: it may be built in the engine process


def cmd_serve(args: argparse.Namespace) -> int:
    from rollout.server import logs
    from rollout.server.app import ServeConfig, serve
    from rollout.server.service import FlushPolicy

    logs.configure(args.log_level)
    if args.gil_switch_ms is not None:
        if args.gil_switch_ms <= 0:
            raise InvalidArgument("gil_switch_ms", f"must be > 0, got {args.gil_switch_ms}")
        sys.setswitchinterval(args.gil_switch_ms / 1e3)
    flush = FlushPolicy(rows=args.flush_rows, seconds=args.flush_ms / 1e3)
    config = ServeConfig(host=args.host, port=args.port, drain_seconds=args.drain_seconds, flush=flush,
                         engine_process=not args.engine_thread, max_request_bytes=args.max_request_bytes,
                         liveness_seconds=args.liveness_seconds)
    return asyncio.run(serve(engine_factory(args), config))


def read_prompts(texts: list[str], jsonl: str | None) -> list[str | list[int]]:
    """Prompts from arguments, then from a JSONL file whose lines are a string, a list of token
    ids, or an object with "prompt" (text) or "token_ids"."""
    prompts: list[str | list[int]] = list(texts)
    if jsonl:
        for lineno, line in enumerate(Path(jsonl).read_text().splitlines(), 1):
            if line.strip():
                prompts.append(_jsonl_prompt(json.loads(line), f"{jsonl}:{lineno}"))
    if not prompts:
        raise InvalidArgument("prompts", "give prompts as arguments or with --prompts-file")
    return prompts


def _jsonl_prompt(item: Any, where: str) -> str | list[int]:
    if isinstance(item, dict):
        item = item.get("token_ids", item.get("prompt"))
    if isinstance(item, str) or (isinstance(item, list) and all(isinstance(t, int) for t in item)):
        return item
    raise InvalidArgument(
        "prompts", f"{where}: expected a string, a list of token ids, or an object with them"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    import pyarrow as pa
    from tqdm import tqdm

    from trainer_client import RolloutClient

    prompts = read_prompts(args.prompt, args.prompts_file)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    max_tokens=args.max_tokens, min_tokens=args.min_tokens, seed=args.seed)  # fmt: skip
    grammar = (args.grammar_kind, args.grammar) if args.grammar else None
    writer, rows = None, 0
    with RolloutClient(args.address, timeout=args.timeout) as client:
        stream = client.stream(prompts, args.n, sampling, args.mask, grammar, args.request_id)
        with tqdm(total=len(prompts) * args.n, unit="sample", disable=args.quiet) as bar:
            for batch in stream:
                writer = writer or pa.ipc.new_file(args.out, batch.schema)
                writer.write_batch(batch)
                rows += batch.num_rows
                bar.update(batch.num_rows)
    if writer is not None:
        writer.close()
    print(f"wrote {rows} samples to {args.out}")
    return 0


def cmd_validate(argv: list[str]) -> int:
    """`rollout validate FILE [--max-width K] [--tol T]`: rollout.masks.check decides."""
    from rollout.masks.check import main as check_main

    return check_main(argv)


def cmd_demo(args: argparse.Namespace) -> int:
    from rollout.server.demo import run_demo

    return run_demo(args.spec, args.n, args.max_tokens, args.prompt, args.seed, args.model, args.draft)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="rollout: RL rollouts over gRPC + Arrow.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC server")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051, help="0 = pick a free port (printed)")
    serve.add_argument(
        "--drain-seconds", type=float, default=300.0,
        help="SIGTERM / SIGINT: wait this long for in-flight requests (a second signal: stop now, exit 1)",
    )
    serve.add_argument(
        "--max-request-bytes", type=int, default=64 << 20,
        help="largest message a client may send: a GenerateRequest, or one WeightChunk of UpdateWeights "
             "(trainer_client sends 8 MiB ones); larger: RESOURCE_EXHAUSTED (default 64 MiB, at least 16 MiB)",
    )
    serve.add_argument(
        "--liveness-seconds", type=float, default=60.0,
        help="health turns NOT_SERVING while requests wait on an engine that has not moved for this long "
             "(longer than the slowest first step, which may compile kernels); 0 = never",
    )
    serve.add_argument("--flush-rows", type=int, default=32, help="samples per streamed batch, at most")
    serve.add_argument(
        "--flush-ms", type=float, default=20.0, help="longest a finished sample waits to be sent"
    )
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--gil-switch-ms", type=float, default=None,
        help="Python's thread switch interval (default 5), in the server's and the engine's process: "
             "how long a thread may wait for the GIL while another holds it (with --engine-thread, "
             "the engine thread and the gRPC event loop share one)",
    )
    serve.add_argument(
        "--engine-thread", action="store_true",
        help="run the engine on a thread of the server's process instead of in its own process "
             "(which keeps the gRPC front end off the engine's GIL)",
    )

    gen = sub.add_parser("generate", help="prompts -> Arrow IPC file through a running server")
    gen.add_argument("prompt", nargs="*", help="prompt texts")
    gen.add_argument("--prompts-file", help="JSONL: strings, token-id lists, or {prompt|token_ids}")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--out", required=True, help="Arrow IPC file to write")
    gen.add_argument("-n", "--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--min-tokens", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--mask", choices=("selected", "support"), default=None)
    gen.add_argument("--grammar", default=None, help="grammar text (see --grammar-kind)")
    gen.add_argument("--grammar-kind", choices=("json_schema", "regex", "ebnf"), default="regex")
    gen.add_argument("--request-id", default=None)
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")

    sub.add_parser("validate", help="check an Arrow IPC rollout file (Contract 3)", add_help=False)

    demo = sub.add_parser("demo", help="local server + one GRPO group with support masks")
    demo.add_argument("--spec", choices=("none", "dflash", "dspark"), default="dflash")
    demo.add_argument("-n", "--n", type=int, default=8)
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--prompt", default="def fibonacci(n):\n")
    demo.add_argument("--seed", type=int, default=7)
    demo.add_argument("--model", default=None, help="default: the embedded tiny Qwen3")
    demo.add_argument("--draft", default=None, help="default: the embedded drafter for --spec")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate"]:
        return cmd_validate(argv[1:])
    args = build_parser().parse_args(argv)
    commands = {"serve": cmd_serve, "generate": cmd_generate, "demo": cmd_demo}
    try:
        return commands[args.command](args)
    except RolloutError as exc:
        print(f"rollout {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
