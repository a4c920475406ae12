"""The package's declared dependency bounds are true: the generated gRPC / protobuf stubs check
the installed grpcio and protobuf at import and refuse older ones, so pyproject.toml must not
allow older ones (its lower bounds equal the stubs' requirements, read from the generated files)
and the installed versions satisfy both. torch has no upper bound (a GPU host keeps its CUDA
build); the Makefile pins the CPU wheel and passes the pin again with the package."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
STUBS = REPO / "rollout" / "proto" / "rollout" / "v1"


def _stub_requirements() -> dict[str, Version]:
    """The least grpcio / protobuf each generated stub accepts, parsed from the stub itself."""
    grpc_stub = (STUBS / "rollout_pb2_grpc.py").read_text()
    grpc_min = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", grpc_stub, re.M)
    pb_stub = (STUBS / "rollout_pb2.py").read_text()
    pb_min = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),"
                       r"\s*(\d+),\s*''", pb_stub)
    assert grpc_min and pb_min, "the generated stubs no longer state their versions where this test reads them"
    return {"grpcio": Version(grpc_min[1]), "protobuf": Version(".".join(pb_min.groups()))}


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    return {req.name: req for req in map(Requirement, deps)}


def _lower_bound(req: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    return max(bounds, default=None)


@pytest.mark.parametrize("package", ["grpcio", "protobuf"])
def test_pyproject_lower_bound_is_what_the_stubs_require(package):
    needed, req = _stub_requirements()[package], _declared()[package]
    assert _lower_bound(req) == needed, f"pyproject says {req}, the generated stubs need {package}>={needed}"
    assert req.specifier.contains(needed) and not req.specifier.contains(Version(f"{needed.major}.0"))


@pytest.mark.parametrize("package", ["grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection",
                                     "grpcio-tools", "torch"])
def test_installed_versions_satisfy_pyproject(package):
    installed = Version(version(package))
    assert _declared()[package].specifier.contains(installed, prereleases=True), (package, installed)


def test_installed_versions_satisfy_the_stubs():
    for package, needed in _stub_requirements().items():
        assert Version(version(package)) >= needed, (package, version(package), needed)
    from rollout.proto.rollout.v1 import rollout_pb2, rollout_pb2_grpc  # their own checks pass

    assert rollout_pb2.GenerateRequest and rollout_pb2_grpc.RolloutStub


def test_the_grpc_companions_are_bounded_like_grpcio():
    """grpcio-health-checking / -reflection / -tools of an older release pull an older grpcio."""
    declared = _declared()
    for name in ("grpcio-health-checking", "grpcio-reflection", "grpcio-tools"):
        assert _lower_bound(declared[name]) >= _stub_requirements()["grpcio"], declared[name]


def test_torch_has_no_upper_bound_and_the_makefile_pins_the_cpu_wheel():
    torch = _declared()["torch"]
    assert all(s.operator == ">=" for s in torch.specifier), f"{torch}: a newer CUDA torch could not install"
    makefile = (REPO / "Makefile").read_text()
    pin = re.search(r"^TORCH \?= (torch==[0-9.]+)$", makefile, re.M)
    assert pin and torch.specifier.contains(Version(pin[1].split("==")[1]))
    assert 'pip install -q -e ".[test]" "$(TORCH)"' in makefile  # pip keeps the pinned torch
