"""Dependencies run one way (README.md, "Layout"): `server -> engine <- spec`, and the data layer
(rollout.masks, rollout.schema, rollout.outputs, rollout.errors, the generated stubs, and
rollout.options, which turns config dataclasses into flags) imports nothing of engine/, spec/ or
server/. Every module's imports, at any depth (function-level and TYPE_CHECKING ones included),
are read with `ast` and checked against the allowed edges below. `rollout.build_engine`
(rollout/__init__.py) and the CLI (cli.py, cli_generate.py) are where the packages meet."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DATA = {"errors", "proto", "masks", "schema", "outputs", "options"}
# what each part may import of rollout (besides itself); None: anything (the composition root)
ALLOWED: dict[str, set[str] | None] = {
    "errors": set(),
    "proto": set(),
    "masks": {"errors", "schema"},
    "schema": {"errors", "masks", "outputs"},
    "outputs": {"masks"},
    "options": set(),
    "engine": DATA - {"proto", "schema"},
    "spec": {"engine"} | DATA - {"proto", "schema"},
    "server": {"engine"} | DATA,
    "cli": None,
    "cli_generate": None,
    "root": None,
}
# trainer_client speaks the wire; two named modules besides: the server's readiness line (fleet
# replicas start `rollout serve`) and the per-sample seed derivation (fleet routing reseeds prompts)
CLIENT_ALLOWED = {"errors", "proto", "schema"}
CLIENT_MODULES = {"rollout.server.process", "rollout.engine.intake"}


def part_of(module: str) -> str:
    """rollout.engine.batch -> "engine"; rollout -> "root"; rollout.cli -> "cli"."""
    parts = module.split(".")
    return "root" if len(parts) == 1 else parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` imports (absolute names; relative imports resolved against `module`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `source` (the text of `module`) that go against the allowed edges."""
    own = part_of(module) if module.startswith("rollout") else "trainer_client"
    bad = []
    for target in sorted(imported_modules(source, module, is_package)):
        if target.split(".")[0] != "rollout" or target == "rollout":
            continue
        other = part_of(target)
        if own == "trainer_client":
            ok = other in CLIENT_ALLOWED or any(target == m or target.startswith(m + ".") for m in CLIENT_MODULES)
            ok = ok or any(m.startswith(target + ".") for m in CLIENT_MODULES)  # `from rollout.server import process`
        else:
            allowed = ALLOWED[own]
            ok = allowed is None or other == own or other in allowed
        if not ok:
            bad.append(f"{module} imports {target} ({own} -> {other})")
    return bad


def _modules():
    for package in ("rollout", "trainer_client"):
        yield from sorted((ROOT / package).rglob("*.py"))


def test_every_part_is_known():
    parts = {part_of(module_name(p)) for p in _modules() if module_name(p).startswith("rollout")}
    assert parts <= set(ALLOWED), f"parts without a rule: {parts - set(ALLOWED)}"


def test_imports_follow_the_one_direction():
    bad = []
    for path in _modules():
        bad += violations(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not bad, "imports against the direction server -> engine <- spec, data below:\n" + "\n".join(bad)


@pytest.mark.parametrize("module, source", [
    ("rollout.engine.engine", "from rollout.spec.proposer import BlockDrafter"),
    ("rollout.engine.sampler", "def f():\n    from rollout.spec import grammar\n"),
    ("rollout.masks.check", "from rollout.engine.params import MASK_MODES"),
    ("rollout.masks.pack", "import rollout.server.loop"),
    ("rollout.schema", "if TYPE_CHECKING:\n    from rollout.engine.outputs import SampleOutput\n"),
    ("rollout.outputs", "from rollout.engine.sequence import Sequence"),
    ("rollout.server.app", "from rollout.spec.proposer import build_drafter"),
    ("rollout.spec.proposer", "from rollout.server.loop import EngineLoop"),
    ("rollout.engine.batch", "from ..server import loop"),
    ("rollout.options", "from rollout.engine.config import EngineConfig"),
    ("trainer_client.client", "from rollout.engine.engine import LLMEngine"),
])
def test_an_import_against_the_direction_is_found(module, source):
    assert violations(source, module), f"{source!r} in {module} was not flagged"


@pytest.mark.parametrize("module, source", [
    ("rollout.server.convert", "from rollout.engine.grammar import GrammarSpec"),
    ("rollout.spec.proposer", "from rollout.engine.drafter import Drafter"),
    ("rollout.engine.commit", "from rollout.masks.pack import assemble_supports"),
    ("trainer_client.fleet_replica", "from rollout.server.process import READY_PREFIX"),
    ("rollout", "from rollout.spec.proposer import build_drafter"),
])
def test_an_import_along_the_direction_passes(module, source):
    assert violations(source, module) == []
