"""The `rollout` command: `serve` (the gRPC server), `generate` (prompts -> Arrow IPC file through
a running server), `validate` (the mask contract's checks on such a file, docs/masks.md), `show` (a
rollout file in the terminal or as an HTML page: rollout.show) and `demo` (a local server with the
embedded models, one GRPO group with support masks, a readable summary).

Each subcommand is a small function from parsed arguments to an exit status; `main(argv)` is
the console entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

from rollout.cli_generate import INTERRUPTED, add_generate_args, cmd_generate, read_prompts, rpc_error_line
from rollout.engine.config import SPEC_METHODS
from rollout.errors import RolloutError
from rollout.options import add_options, from_options
from rollout.show import add_show_arguments

__all__ = ["build_parser", "main", "read_prompts"]


def engine_factory(args: argparse.Namespace) -> Callable[[], Any]:
    """Validates the engine configuration now; the engine itself is built on the engine thread
    (or in the engine process: the factory pickles)."""
    from rollout import build_engine
    from rollout.engine.config import EngineConfig

    return functools.partial(build_engine, from_options(EngineConfig, args), load_progress=weights_progress)


def weights_progress(items: list, description: str, file: Any = None) -> Iterable:
    """A progress bar over the tensors a checkpoint load reads, on a terminal only: with stderr
    redirected (a log file, `ServerProcess`, a fleet replica) there is none."""
    from tqdm import tqdm

    return tqdm(items, desc=description, unit="tensor", disable=None, leave=False, file=file or sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    from rollout.server import logs
    from rollout.server.app import serve
    from rollout.server.config import ServeConfig

    config, factory = from_options(ServeConfig, args), engine_factory(args)  # (bad options: before any logging)
    logs.configure(config.log_level)
    if config.gil_switch_ms is not None:
        sys.setswitchinterval(config.gil_switch_ms / 1e3)
    return asyncio.run(serve(factory, config))


def cmd_validate(argv: list[str]) -> int:
    """`rollout validate FILE [--max-width K] [--tol T]`: rollout.masks.check decides."""
    from rollout.masks.check import main as check_main

    return check_main(argv)


def cmd_demo(args: argparse.Namespace) -> int:
    from rollout.server.demo import run_demo
    from rollout.server.process import ServerStartError

    try:
        return run_demo(args.spec, args.n, args.max_tokens, args.prompt, args.seed, args.model, args.draft,
                        args.keep)
    except ServerStartError as exc:
        print(f"rollout demo: {exc}", file=sys.stderr)
        return 1


def cmd_show(args: argparse.Namespace) -> int:
    from rollout.show import main as show_main

    return show_main(args)


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown flag is reported with that subcommand's usage (argparse would
    hand it up to `rollout`'s own, which lists only the subcommands)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help unless it says its default already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: {'off' if action.default is False else '%(default)s'})"


def build_parser() -> argparse.ArgumentParser:
    from rollout.engine.config import EngineConfig
    from rollout.server.config import ServeConfig

    parser = argparse.ArgumentParser(prog="rollout", description="rollout: RL rollouts over gRPC + Arrow.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    kw = dict(formatter_class=HelpFormatter)

    serve = sub.add_parser("serve", help="run the gRPC server", description=SERVE_DESCRIPTION, **kw)
    add_options(serve, EngineConfig, "engine")
    add_options(serve, ServeConfig, "server")

    gen = sub.add_parser("generate", help="prompts -> Arrow IPC file through a running server", **kw)
    add_generate_args(gen)

    sub.add_parser("validate", help="check an Arrow IPC rollout file (docs/masks.md); see rollout validate --help",
                   add_help=False)

    demo = sub.add_parser("demo", help="local server + one GRPO group with support masks", **kw)
    demo.add_argument("--spec", choices=SPEC_METHODS, default="dflash",
                      help="speculative decoding of the demo's server")
    demo.add_argument("-n", "--n", type=int, default=8, help="samples of the prompt (one GRPO group)")
    demo.add_argument("--max-tokens", type=int, default=96, help="most output tokens per sample")
    demo.add_argument("--prompt", default="def fibonacci(n):\n", help="the group's prompt")
    demo.add_argument("--seed", type=int, default=7, help="the request's seed")
    demo.add_argument("--model", default=None, help="target checkpoint directory (default: the embedded tiny Qwen3)")
    demo.add_argument("--draft", default=None, help="drafter directory (default: the embedded drafter for --spec)")
    demo.add_argument("--keep", default=None, metavar="FILE",
                      help="write the group's rollout to FILE (Arrow IPC) for `rollout show` (default: not kept)")

    show = sub.add_parser("show", help="look at a rollout file: text per sample, --tokens, --html page", **kw)
    add_show_arguments(show)
    return parser


SERVE_DESCRIPTION = """Runs the gRPC server until SIGTERM or SIGINT, then drains (--drain-seconds).
Prints `rollout serving on HOST:PORT` once it serves; logs are JSON lines on stderr."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate"]:
        return cmd_validate(argv[1:])
    args = build_parser().parse_args(argv)
    commands = {"serve": cmd_serve, "generate": cmd_generate, "demo": cmd_demo, "show": cmd_show}
    try:
        return commands[args.command](args)
    except RolloutError as exc:
        print(f"rollout {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rollout {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:
        if not _is_rpc_error(exc):
            raise
        print(f"rollout {args.command}: {rpc_error_line(exc)}", file=sys.stderr)
        return 1


def _is_rpc_error(exc: Exception) -> bool:
    grpc = sys.modules.get("grpc")  # (not imported unless a command talked gRPC)
    return grpc is not None and isinstance(exc, grpc.RpcError)


if __name__ == "__main__":
    sys.exit(main())
