"""Regenerates README.md's table of `rollout serve` options from the parser (itself generated from
EngineConfig and ServeConfig), between `<!-- BEGIN serve options -->` and `<!-- END serve options -->`.
`python scripts/readme_options.py --check` exits 1 when the table is stale (tests/test_options.py
checks the same)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from rollout.cli import build_parser
from rollout.options import markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"
TABLE = re.compile(r"(<!-- BEGIN serve options.*?-->\n)(.*?)(<!-- END serve options -->)", re.S)


def serve_table() -> str:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return markdown_table(subparsers.choices["serve"])


def main(argv: list[str]) -> int:
    text = README.read_text()
    if not TABLE.search(text):
        print(f"{README} has no <!-- BEGIN serve options --> ... <!-- END serve options --> markers", file=sys.stderr)
        return 1
    updated = TABLE.sub(lambda m: m.group(1) + serve_table() + m.group(3), text)
    if "--check" in argv:
        return int(updated != text)
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
