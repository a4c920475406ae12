"""The hot path reads nothing back from the device except the step's one copy (DESIGN.md:
at most one host synchronisation per step). On CPU there is no real synchronisation, so the
test counts the calls that would be one on CUDA (item, tolist, bool, numpy, .cpu(), indexing
with a boolean tensor, repeat_interleave without a host-known output size, and blocking
uploads: `torch.tensor(..., device=...)` or a host tensor's `.to(device)` without
non_blocking, which synchronise the stream before copying) while the engine drafts, runs the
forward, verifies and captures a step, for a dense and a mixture-of-experts target."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

READBACKS = ("item", "tolist", "__bool__", "numpy", "cpu", "__int__", "__float__")


TARGETS = {"qwen3": ("tiny_random_qwen3", "random_drafters"),
           "qwen3-moe": ("tiny_random_qwen3_moe", "random_moe_drafters")}


@pytest.mark.parametrize("static", [False, True], ids=["eager", "graph-buffers"])
@pytest.mark.parametrize("spec", ["none", "dflash", "dspark"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_device_part_of_a_step_reads_nothing_back(request, target, spec, static, monkeypatch):
    model, drafters = (request.getfixturevalue(name) for name in TARGETS[target])
    eng = LLMEngine(EngineConfig(model=str(model), spec=spec, draft=drafters.get(spec),
                                 block_size=4, num_kv_blocks=300))
    if static:  # the CUDA-graph paths (target step and drafter forward), replayed eagerly
        eng.graphs = eng.make_step_graphs(capture=False)
    eng.add_request("g", [[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3),
                    mask="support")
    eng.add_request("s", [[11, 12, 13]], SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05,
                                                        repetition_penalty=1.2, logit_bias={5: 1.0},
                                                        max_tokens=12, seed=1), n=3, mask="selected")
    calls = []
    real_draft, real_run = eng._draft, eng._run
    saved_to = torch.Tensor.to

    def counting(fn):
        def wrapped(*args, **kw):
            saved = {name: getattr(torch.Tensor, name) for name in (*READBACKS, "__getitem__", "__setitem__")}
            for name in READBACKS:
                monkeypatch.setattr(torch.Tensor, name, _counted(name, saved[name], calls))
            for name in ("__getitem__", "__setitem__"):
                monkeypatch.setattr(torch.Tensor, name, _bool_index_checked(name, saved[name], calls))
            real_repeat, real_tensor = torch.repeat_interleave, torch.tensor
            monkeypatch.setattr(torch, "repeat_interleave", _sized_repeat_checked(real_repeat, calls))
            monkeypatch.setattr(torch, "tensor", _upload_checked(real_tensor, calls))
            monkeypatch.setattr(torch.Tensor, "to", _to_checked(saved_to, calls))
            try:
                return fn(*args, **kw)
            finally:
                for name, method in saved.items():
                    monkeypatch.setattr(torch.Tensor, name, method)
                monkeypatch.setattr(torch, "repeat_interleave", real_repeat)
                monkeypatch.setattr(torch, "tensor", real_tensor)
                monkeypatch.setattr(torch.Tensor, "to", saved_to)
        return wrapped

    monkeypatch.setattr(eng, "_draft", counting(real_draft))
    monkeypatch.setattr(eng, "_run", counting(real_run))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps > 3
    assert calls == [], f"device read-backs inside a step: {sorted(set(calls))}"


def _counted(name, method, calls):
    def wrapper(self, *args, **kw):
        calls.append(name)
        return method(self, *args, **kw)
    return wrapper


def _bool_index_checked(name, method, calls):
    def wrapper(self, index, *args):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            calls.append(f"{name} with a boolean index")
        return method(self, index, *args)
    return wrapper


def _sized_repeat_checked(real, calls):
    def wrapper(input, repeats=None, *args, **kw):
        if isinstance(repeats, torch.Tensor) and kw.get("output_size") is None:
            calls.append("repeat_interleave without output_size")
        return real(input, repeats, *args, **kw)
    return wrapper


def _upload_checked(real, calls):
    def wrapper(data, *args, **kw):
        if kw.get("device") is not None:
            calls.append("torch.tensor(..., device=...): a blocking upload" + _caller())
        return real(data, *args, **kw)
    return wrapper


def _to_checked(real, calls):
    def wrapper(self, *args, **kw):
        target = kw.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if target is not None and self.device.type == "cpu" and not kw.get("non_blocking", False):
            calls.append(".to(device) of a host tensor without non_blocking: a blocking upload" + _caller())
        return real(self, *args, **kw)
    return wrapper


def _caller() -> str:
    """ at file:line of the rollout code that made the call."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2] if "/rollout/" in f.filename]
    return f" at {frames[-1].filename.split('/rollout/')[-1]}:{frames[-1].lineno}" if frames else ""
