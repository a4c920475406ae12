"""A step makes the host wait for the device once: its synchronisation (at most one host
synchronisation per step). tests/host_waits.py finds, on CPU, every operation that would make the
host wait on a GPU (each aten op replayed on the meta device, plus the Python-level reads and
blocking copies); here it watches the whole `LLMEngine.step()` (draft, step layout, forward,
policy, verify, capture, the results' copy started at launch) except the sanctioned
synchronisation itself (`_to_host`, with `MaskCapture.to_host`, which starts the masks' copy) and
the commit after it, which reads host copies. With overlapped scheduling (the default,
rollout/engine/overlap.py) step n+1 is built and launched before step n's synchronisation, and
nothing before that synchronisation reads the device (its pending tokens come from n's on the
device): `test_the_next_step_launches_before_the_sync_without_a_read`.

The workload mixes greedy, sampled, penalised, biased, masked (both modes) and grammar requests,
with no drafter, DFlash, DSpark and DSpark with a confidence threshold, full draft blocks and the
adaptive draft budget (rollout/engine/spec_budget.py: its per-step choice and its record of the
step are host work on host data, watched too), eagerly and through the CUDA-graph static buffers
(replayed eagerly), on a dense and on a mixture-of-experts target. Two waits are stated
exceptions, counted exactly:

* a grammar sample that verifies drafts: `rows.grammar_bitmask` reads the step's drafts back,
  once per such step. Its bitmask row i is the grammar's state after the first i drafts, which
  xgrammar's host-side matcher must walk, and the drafts were sampled on the device. Steps whose
  grammar samples carry no drafts (no drafter, or no room) read nothing.
* DSpark with a confidence threshold: `BlockDrafter._lengths` reads the confidence runs back, once
  per proposal. The cut blocks are ragged and the step's layout (rows, KV slots, positions) is
  built on the host; cutting is what saves the target's compute, so padding to the full block
  instead would undo the feature.
* top-p rows without top-k: `rollout.engine.top_p._short_rows` reads which rows' candidates fall
  short of top_p (and which may reach at the next width), once per candidate stage that runs (the
  first in every step with such rows, the next only when some rows were short and may reach there),
  so that only those rows take more candidates or the sort
  (rollout/engine/top_p.py says why a sync-free fallback would cost every step the worst row's
  price). The stage widths are set small here, below the tiny vocabulary, so that the reads happen.

Negative controls: each kind of wait (the issue's list: `torch.nonzero`, `.nonzero()`,
`masked_select`, `unique`, `torch.as_tensor(..., device=...)`; and the others the detector names)
injected next to `verify` in the step must be found, exactly once per step.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from host_waits import HostWaits
from spec_helpers import cost_table

import rollout.engine.engine as engine_mod
import rollout.engine.rows as rows_mod
import rollout.engine.top_p as top_p_mod
from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.grammar import GrammarSpec
from rollout.engine.params import SamplingParams

GRAMMAR_SITE = ("rollout/engine/rows.py", "grammar_bitmask")
TOP_P_SITE = ("rollout/engine/top_p.py", "_short_rows")
THRESHOLD_SITE = ("rollout/spec/proposer.py", "_lengths")
SPECS = {"none": ("none", 0.0, False), "dflash": ("dflash", 0.0, False), "dspark": ("dspark", 0.0, False),
         "dspark-threshold": ("dspark", 0.3, False), "dflash-adaptive": ("dflash", 0.0, True),
         "dspark-threshold-adaptive": ("dspark", 0.3, True)}
TARGETS = {"qwen3": ("tiny_random_qwen3", "random_drafters"),
           "qwen3-moe": ("tiny_random_qwen3_moe", "random_moe_drafters")}


def _engine(model, drafters, spec: str, threshold: float = 0.0, static: bool = False,
            adaptive: bool = False) -> LLMEngine:
    # adaptive: a synthetic cost under which drafts are nearly free, so that grammar samples verify some
    eng = build_engine(EngineConfig(model=str(model), spec=spec, draft=drafters.get(spec), block_size=4,
                                    num_kv_blocks=300, spec_confidence_threshold=threshold, spec_adaptive=adaptive),
                       step_cost=cost_table(decode_ms=10.0, token_ms=0.001, q=4) if adaptive else None)
    if static:  # the CUDA-graph paths (target step and drafter forward), replayed eagerly
        eng.graphs = eng.make_step_graphs(capture=False)
    return eng


def _add_workload(eng: LLMEngine) -> None:
    eng.add_request("g", [[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3),
                    mask="support")
    eng.add_request("s", [[11, 12, 13]], SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05,
                                                        repetition_penalty=1.2, logit_bias={5: 1.0},
                                                        max_tokens=12, seed=1), n=3, mask="selected")
    eng.add_request("grammar", [[97, 98]], SamplingParams(temperature=1.0, top_k=16, max_tokens=12, seed=2),
                    grammar=GrammarSpec("regex", "[a-z]{4,12}"), mask="support")
    eng.add_request("top_p", [[21, 22, 23]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=4), n=2)


class _Watched:
    """Runs an engine's steps under the detector, counting the sanctioned synchronisations and the
    steps in which a grammar sample verified drafts."""

    def __init__(self, eng: LLMEngine, monkeypatch):
        self.eng, self.waits = eng, HostWaits()
        self.syncs = self.grammar_draft_steps = self.steps = 0
        self.top_p_reads: list[int] = []  # per step: the top-p host reads
        self.top_p_steps: list[bool] = []  # per step: it has top-p rows without top-k
        self.events: list[str] = []  # "build" (a step's layout) and "sync", in order
        w = self.waits
        real_to_host, real_build = engine_mod._to_host, engine_mod.build_step
        real_short = top_p_mod._short_rows

        def short_rows(reached, reachable):
            self.top_p_reads[-1] += 1
            return real_short(reached, reachable)

        def to_host(copy, masks):
            self.syncs += copy is not None
            self.events.append("sync")
            return real_to_host(copy, masks)

        def build_step(*args, **kw):
            self.events.append("build")
            step = real_build(*args, **kw)
            rows = step.rows
            self.grammar_draft_steps += any(s.grammar is not None and k for s, k in zip(rows.entries, rows.num_draft))
            self.top_p_steps.append(any(s.request_id == "top_p" for s in rows.entries))
            self.top_p_reads.append(0)
            return step

        monkeypatch.setattr(engine_mod, "_to_host", w.pausing(to_host))
        monkeypatch.setattr(engine_mod, "build_step", build_step)
        monkeypatch.setattr(top_p_mod, "_short_rows", short_rows)
        monkeypatch.setattr(top_p_mod, "STAGE_WIDTHS", (2, 8))
        monkeypatch.setattr(eng.capture, "to_host", w.pausing(eng.capture.to_host))
        monkeypatch.setattr(eng.committer, "commit", w.pausing(eng.committer.commit))
        monkeypatch.setattr(rows_mod, "allocate_bitmask", w.on_host(rows_mod.allocate_bitmask))

    def run(self) -> list:
        outs = []
        with self.waits:
            while self.eng.has_unfinished():
                outs += self.eng.step()
                self.steps += 1
        return outs

    def sites(self) -> Counter:
        return Counter((w.file, w.function) for w in self.waits.found)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "graph-buffers"])
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_step_waits_for_the_device_once(request, target, spec, static, monkeypatch):
    method, threshold, adaptive = SPECS[spec]
    model, drafters = (request.getfixturevalue(name) for name in TARGETS[target])
    eng = _engine(model, drafters, method, threshold, static, adaptive)
    _add_workload(eng)
    watched = _Watched(eng, monkeypatch)
    outs = watched.run()
    assert watched.steps > 3 and watched.syncs == watched.steps
    grammar = next(o for o in outs if o.request_id == "grammar")
    assert grammar.error is None and grammar.supports is not None
    assert (watched.grammar_draft_steps > 0) == (method != "none")  # each exception is exercised, or absent
    expected = Counter({GRAMMAR_SITE: watched.grammar_draft_steps, TOP_P_SITE: sum(watched.top_p_reads)})
    discarded = len(watched.top_p_reads) - watched.steps  # a last step launched ahead, all samples finished before it
    assert discarded in (0, 1) and (not discarded or watched.events[-2:] == ["build", "sync"])
    assert any(watched.top_p_steps)
    assert all(n in (1, 2) if top_p else n == 0 for n, top_p in zip(watched.top_p_reads, watched.top_p_steps))
    if threshold:
        assert eng.drafter.num_proposals > 0
        expected[THRESHOLD_SITE] = eng.drafter.num_proposals
    assert watched.sites() == expected, "host waits inside a step:\n" + "\n".join(map(str, watched.waits.found))


class _NoDrafts:
    """A draft budget that verifies no drafts."""

    def caps(self, running, token_budget, waiting_tokens=0, states=None):
        return {}


@pytest.mark.parametrize("spec", ["none", "dflash", "dflash-refresh", "dflash-drafts"],
                         ids=["no-drafter", "dflash-no-drafts", "dflash-refresh-no-drafts", "dflash-drafts"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_the_next_step_launches_before_the_sync_without_a_read(tiny_random_qwen3, random_drafters, overlap, spec,
                                                               monkeypatch):
    """Overlapped scheduling (rollout/engine/overlap.py): step n+1 is built and launched before step
    n's sync, with no device -> host read anywhere before that sync (the pending tokens of n+1 come
    from n's on the device). The workload has nothing that falls back (no grammar, no penalties); with
    a drafter the draft budget verifies no drafts, so its steps are plain ones (the drafter's context
    update still runs in every forward; a refreshing drafter's taps of the step in flight are copied
    aside on the device, its training between steps is off here), or full blocks ("dflash-drafts":
    drafted steps overlap too, their anchors and positions gathered on the device)."""
    refresh, drafts = spec.endswith("-refresh"), spec.endswith("-drafts")
    spec = spec.removesuffix("-refresh").removesuffix("-drafts")
    eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=300, overlap=overlap,
                                    spec=spec, draft=random_drafters.get(spec), spec_adaptive=False,
                                    drafter_refresh="always" if refresh else "off"))
    if refresh:
        eng.drafter.refresh.train_slice = lambda idle=False, bound=None: None
    if spec != "none" and not drafts:
        eng.scheduler.draft_budget = _NoDrafts()
    eng.add_request("g", [[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3),
                    mask="support")
    eng.add_request("s", [[11, 12, 13]], SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05,
                                                        logit_bias={5: 1.0}, max_tokens=12, seed=1), n=3,
                    mask="selected")
    eng.add_request("short", [[20, 21]], SamplingParams(temperature=1.0, max_tokens=2, seed=3))
    watched = _Watched(eng, monkeypatch)
    watched.run()
    assert watched.steps > 10 and watched.syncs == watched.steps and not eng.pipeline.sync_steps.keys() - {"off"}
    assert watched.sites() == Counter(), "host waits inside a step:\n" + "\n".join(map(str, watched.waits.found))
    builds = syncs = ahead = 0
    for event in watched.events:
        builds += event == "build"
        syncs += event == "sync"
        ahead += event == "sync" and builds > syncs  # the next step was launched before this sync
    assert ahead == (eng.pipeline.overlapped if overlap else 0)
    if drafts:  # (a step whose samples all sit out, near their ends, launches nothing ahead)
        assert eng.pipeline.overlapped_drafts >= (5 if overlap else 0) and eng.draft_counts.total()[0] > 30
    else:
        assert ahead >= watched.steps - 1 if overlap else True


def _nonzero_method(r):
    return r.num_accepted.nonzero()


def _index_put_with_mask(r):
    t = r.tokens.clone()
    t[t < 0] = 0


INJECTED = {
    "torch.nonzero": lambda r: torch.nonzero(r.num_accepted),
    ".nonzero()": _nonzero_method,
    "masked_select": lambda r: torch.masked_select(r.tokens, r.tokens >= 0),
    "unique": lambda r: torch.unique(r.tokens),
    "as_tensor-readback": lambda r: torch.as_tensor(r.num_accepted, device="cpu"),
    "as_tensor-upload": lambda r: torch.as_tensor([0, 1], device=r.tokens.device),
    "tensor-upload": lambda r: torch.tensor([0, 1], device=r.tokens.device),
    "boolean-mask": lambda r: r.tokens[r.tokens >= 0],
    "boolean-mask-assign": _index_put_with_mask,
    "where-one-arg": lambda r: torch.where(r.tokens >= 0),
    "argwhere": lambda r: torch.argwhere(r.tokens),
    "repeat_interleave": lambda r: torch.repeat_interleave(r.num_accepted + 1),
    "bincount": lambda r: torch.bincount(r.num_accepted),
    "one_hot": lambda r: torch.nn.functional.one_hot(r.num_accepted),
    "item": lambda r: r.num_accepted.sum().item(),
    "tolist": lambda r: r.tokens.tolist(),
    "numpy": lambda r: r.tokens.numpy(),
    "bool": lambda r: bool(r.has_support.all()),
    "int": lambda r: int(r.num_accepted.max()),
    "index": lambda r: [0, 1, 2][r.num_accepted.max()],
    "cpu": lambda r: r.tokens.cpu(),
    "to-blocking": lambda r: r.tokens.to("cpu"),
    "equal": lambda r: torch.equal(r.tokens, r.tokens),
    "allclose": lambda r: torch.allclose(r.logprobs, r.logprobs),
    "cuda-synchronize": lambda r: torch.cuda.synchronize(),
}


@pytest.fixture(scope="module")
def plain_engine(tiny_random_qwen3) -> LLMEngine:
    return build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=64))


@pytest.mark.parametrize("name", list(INJECTED))
def test_the_detector_finds_each_kind_of_wait(plain_engine, name, monkeypatch):
    real_verify, inject = engine_mod.verify, INJECTED[name]

    def verify_and_wait(*args, **kw):
        result = real_verify(*args, **kw)
        inject(result)
        return result

    monkeypatch.setattr(engine_mod, "verify", verify_and_wait)
    plain_engine.add_request(name, [[1, 2, 3]], SamplingParams(temperature=1.0, top_k=8, max_tokens=3, seed=1))
    watched = _Watched(plain_engine, monkeypatch)
    watched.run()
    here = [w for w in watched.waits.found if w.file == "tests/test_host_syncs.py"]
    launched = watched.events.count("build")  # 4: overlap launches a 4th step, whose one slot is discarded
    assert watched.steps == 3 and launched == 4, watched.events
    assert len(here) == launched, f"{name}: found {[str(w) for w in watched.waits.found]}"
    assert len(watched.waits.found) == len(here)
