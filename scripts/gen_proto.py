"""Regenerates the committed gRPC stubs from proto/rollout/v1/rollout.proto with grpcio-tools.

The stubs live under rollout/proto/rollout/v1/ so that they import as
`rollout.proto.rollout.v1.rollout_pb2`; protoc writes absolute imports (`from rollout.v1 import`)
that would collide with the `rollout` package, so they are rewritten to relative imports (and
the messages' module name to the real one, so they pickle).
Run `python scripts/gen_proto.py` after editing the proto; tests/test_proto.py fails when the
committed stubs differ from a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = "rollout/v1/rollout.proto"
STUB_ROOT = ROOT / "rollout" / "proto"
STUB_MODULE = "rollout.proto.rollout.v1.rollout_pb2"
STUB_FILES = ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py")


def generate(out_root: Path = STUB_ROOT) -> list[Path]:
    """Writes the three stub files under out_root/rollout/v1/ and returns their paths."""
    out_root.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PROTO_ROOT / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    stub_dir = out_root / "rollout" / "v1"
    grpc_stub = stub_dir / "rollout_pb2_grpc.py"
    _rewrite(grpc_stub, "from rollout.v1 import rollout_pb2", "from . import rollout_pb2")
    _rewrite(stub_dir / "rollout_pb2.py", "'rollout.v1.rollout_pb2'", f"'{STUB_MODULE}'")
    return [stub_dir / name for name in STUB_FILES]


def _rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if old not in text:
        raise RuntimeError(f"{path.name}: expected {old!r} in the generated code")
    path.write_text(text.replace(old, new))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUB_ROOT, help="stub root (default: rollout/proto)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
