"""Sampling masks captured after acceptance (docs/masks.md) through the real engine: the
{none, DFlash, DSpark} x {greedy, sampled, mixed} x {selected, support} matrix, independent
recomputation against transformers, grammar-constrained verify, support overflow, and
zero capture work for requests without masks."""

from __future__ import annotations

import json
import math
import os
import re

import pyarrow as pa
import pytest
import torch
from contract1_ref import reference_policy

import rollout.engine.capture as capture_mod
from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.grammar import GrammarSpec
from rollout.engine.params import SamplingParams
from rollout.errors import InvalidArgument
from rollout.masks.check import check_table
from rollout.schema import to_record_batch

PROMPTS = [[5, 6, 7, 8, 9], [100, 101], [42, 43, 44, 45, 46, 47, 48, 49, 50]]
SAMPLED = SamplingParams(temperature=1.0, top_k=12, top_p=0.9, max_tokens=10, seed=5, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engine(model, spec="none", draft=None, **kw):
    """ROLLOUT_TEST_DEVICE=cuda runs this file's engines on a GPU (the pinned host copy of the masks).
    There the engine computes in bfloat16, so the recomputation tests, which compare with a float32
    transformers forward, do not apply: `-k "not recomputation"`."""
    kw.setdefault("device", os.environ.get("ROLLOUT_TEST_DEVICE", "cpu"))
    kw.setdefault("spec_adaptive", False)  # full draft blocks: every sample verifies
    return build_engine(EngineConfig(model=str(model), spec=spec, draft=draft, block_size=4, num_kv_blocks=300,
                                  max_num_batched_tokens=64, **kw))


def _run(eng):
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def _check_sample(o, params, mode):
    n = len(o.token_ids)
    assert n == len(o.token_logprobs) == len(o.support_ids) > 0
    assert (o.support_logprobs is not None) == (mode == "support")
    for j, (tok, sup) in enumerate(zip(o.token_ids, o.support_ids)):
        assert tok in sup
        assert len(sup) == len(set(sup)) <= (1 if params.greedy else params.top_k)
        if params.greedy:
            assert sup == [tok] and o.token_logprobs[j] == 0.0
        if mode == "support":
            lps = torch.tensor(o.support_logprobs[j])
            assert abs(torch.logsumexp(lps, 0).item()) < 1e-4
            assert abs(lps[sup.index(tok)].item() - o.token_logprobs[j]) < 1e-5


@pytest.mark.parametrize("mode", ["selected", "support"])
@pytest.mark.parametrize("spec", ["none", "dflash", "dspark", "dspark-ragged"])
def test_mask_matrix(tiny_random_qwen3, random_drafters, spec, mode):
    """dspark-ragged: a confidence threshold cuts each sample's block at its own length."""
    kw = {"spec_confidence_threshold": 0.5} if spec == "dspark-ragged" else {}
    spec = spec.removesuffix("-ragged")
    eng = _engine(tiny_random_qwen3, spec, random_drafters.get(spec), **kw)
    eng.add_request("greedy", PROMPTS, GREEDY, mask=mode)
    eng.add_request("sampled", PROMPTS, SAMPLED, n=2, mask=mode)
    eng.add_request("mixed-unmasked", PROMPTS[:2], SAMPLED)  # same batch, no masks
    outs = _run(eng)
    assert len(outs) == 3 + 6 + 2
    for o in outs:
        if o.request_id == "mixed-unmasked":
            assert o.support_ids is None and o.support_logprobs is None
        else:
            _check_sample(o, GREEDY if o.request_id == "greedy" else SAMPLED, mode)
    masked = [o for o in outs if o.support_ids is not None]
    table = pa.Table.from_batches([to_record_batch(masked)])
    assert check_table(table).ok


def test_masks_with_trained_drafter_and_accepted_blocks(tiny_random_qwen3):
    """Accepted drafts commit several tokens per step; each still gets its own mask row."""
    from spec_helpers import RepeatDrafter, factory_of

    eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=300, spec_adaptive=False),
                       drafter_factory=factory_of(RepeatDrafter(4)))
    eng.add_request("g", PROMPTS, GREEDY, mask="support")
    eng.add_request("s", PROMPTS, SAMPLED, n=2, mask="support")
    outs = _run(eng)
    assert any(max(o.accept_lengths) > 1 for o in outs)
    for o in outs:
        _check_sample(o, GREEDY if o.request_id == "g" else SAMPLED, "support")


# ---- independent recomputation ---------------------------------------------------------------

PENALISED = SamplingParams(temperature=0.8, top_k=10, top_p=0.92, min_p=0.05, repetition_penalty=1.2,
                           frequency_penalty=0.3, presence_penalty=0.2, logit_bias={7: 1.5, 120: -2.0},
                           min_tokens=3, max_tokens=12, seed=9)


def _reference_row(z, history, sp, end_ids, out_index):
    """The sampling distribution of one row from tests/contract1_ref.py: (support ids by prob desc / id, logprobs)."""
    p = reference_policy(
        z.tolist(), temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
        logit_bias=sp.logit_bias, history=history, repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        banned=end_ids if out_index < sp.min_tokens else ())
    ids = sorted(p, key=lambda t: (-p[t], t))
    return ids, [math.log(p[t]) for t in ids]


@pytest.mark.parametrize("spec", ["none", "dflash", "repeat"])
def test_masks_equal_fresh_transformers_recomputation(tiny_random_qwen3, random_drafters, spec):
    """With accepted drafts ("repeat"), rows inside a verify block count the earlier drafts in
    their penalties: the recomputation over prompt + output checks exactly that."""
    import transformers
    from spec_helpers import RepeatDrafter, factory_of

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_random_qwen3, dtype=torch.float32).eval()
    if spec == "repeat":
        eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=300,
                                        spec_adaptive=False), drafter_factory=factory_of(RepeatDrafter(4)))
    else:
        eng = _engine(tiny_random_qwen3, spec, random_drafters.get(spec))
    eng.add_request("p", PROMPTS, PENALISED, n=2, mask="support")
    outs = _run(eng)
    assert len(outs) == 6
    if spec == "repeat":
        assert any(max(o.accept_lengths) > 1 for o in outs)
    for o in outs:
        seq = o.prompt_token_ids + o.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0]
        for j, tok in enumerate(o.token_ids):
            pos = len(o.prompt_token_ids) + j - 1
            ids, lps = _reference_row(logits[pos], seq[: pos + 1], PENALISED, eng.eos_token_ids, j)
            assert o.support_ids[j] == ids, f"sample {o.prompt_index}/{o.sample_index} position {j}"
            assert torch.allclose(torch.tensor(o.support_logprobs[j]), torch.tensor(lps), atol=2e-4)
            assert abs(o.token_logprobs[j] - lps[ids.index(tok)]) < 2e-4


# ---- grammar ---------------------------------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "n": {"enum": [1, 2, 3]}}}


@pytest.mark.parametrize("spec", ["none", "dflash", "dspark"])
def test_grammar_constrained_outputs(spec):
    """The embedded model under a JSON schema and a regex, with masks: outputs parse / match
    and no support holds a token the grammar forbids at that point."""
    eng = build_engine(EngineConfig(spec=spec, num_kv_blocks=400, spec_adaptive=False))
    tok = eng.tokenizer
    prompt = tok.encode("def f(x):\n    return ").ids
    schema = GrammarSpec("json_schema", json.dumps(SCHEMA))
    regex = GrammarSpec("regex", r"[0-9]{2,5}\.[0-9]")
    eng.add_request("json", [prompt], SamplingParams(temperature=1.0, top_k=20, max_tokens=80, seed=3), n=3,
                    grammar=schema, mask="support")
    eng.add_request("re", [prompt], SamplingParams(temperature=0.7, top_k=8, max_tokens=40, seed=4), n=2,
                    grammar=regex, mask="selected")
    outs = _run(eng)
    assert len(outs) == 5
    checker = eng.intake.grammars()
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] in eng.eos_token_ids
        text = tok.decode(o.token_ids[:-1])
        if o.request_id == "json":
            value = json.loads(text)
            assert re.fullmatch("[a-z]{1,6}", value["name"]) and value["n"] in (1, 2, 3)
        else:
            assert re.fullmatch(r"[0-9]{2,5}\.[0-9]", text)
        state = checker.new_state(schema if o.request_id == "json" else regex)
        for j, sup in enumerate(o.support_ids):
            row = torch.full((1, (eng.vocab_size + 31) // 32), -1, dtype=torch.int32)
            state.fill_verify_bitmask([], row, 0)
            allowed = [t for t in sup if (row[0, t >> 5].item() >> (t & 31)) & 1]
            assert allowed == sup, f"grammar-forbidden token in support at {j}"
            state.commit([o.token_ids[j]])


# ---- overflow and zero-cost -------------------------------------------------------------------

def test_support_overflow_fails_that_sample_only(tiny_random_qwen3, monkeypatch):
    monkeypatch.setattr(capture_mod, "mask_width", lambda entries: 2)  # pretend the bound is 2
    eng = _engine(tiny_random_qwen3)
    eng.add_request("wide", PROMPTS[:1], SamplingParams(temperature=1.5, top_k=50, max_tokens=8, seed=1),
                    mask="support")
    eng.add_request("greedy", PROMPTS[1:], GREEDY, mask="support")
    eng.add_request("plain", PROMPTS, SAMPLED)
    outs = {o.request_id + str(o.prompt_index): o for o in _run(eng)}
    failed = outs["wide0"]
    assert failed.error and "bound" in failed.error and failed.finish_reason == "error"
    assert failed.token_ids == [] and failed.support_ids is None
    assert all(len(outs[f"greedy{i}"].token_ids) == 10 for i in (0, 1))
    assert all(len(outs[f"plain{i}"].token_ids) == 10 for i in (0, 1, 2))
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]


def test_an_overflow_fails_its_sample_at_the_next_step(tiny_random_qwen3, monkeypatch):
    """A step's masks are handed over during the next step: an overflow in the first step's masks
    fails the sample in the second step's output, not at the end."""
    monkeypatch.setattr(capture_mod, "mask_width", lambda entries: 2)  # pretend the bound is 2
    eng = _engine(tiny_random_qwen3)
    eng.add_request("wide", PROMPTS[:1], SamplingParams(temperature=1.5, top_k=50, max_tokens=8, seed=1),
                    mask="support")
    first, second = eng.step(), eng.step()
    assert first == [] and [(o.request_id, o.finish_reason) for o in second] == [("wide", "error")]
    assert not eng.has_unfinished() and eng.kv_blocks()[0] == eng.kv_blocks()[1]


def test_an_overflow_found_at_an_abort_fails_the_sample(tiny_random_qwen3, monkeypatch):
    """An overflow still waiting in the last step's masks when its request is aborted: the abort
    hands the masks over first, and the sample fails as a whole instead of ending with a bad mask."""
    monkeypatch.setattr(capture_mod, "mask_width", lambda entries: 2)  # pretend the bound is 2
    eng = _engine(tiny_random_qwen3)
    eng.add_request("wide", PROMPTS[:1], SamplingParams(temperature=1.5, top_k=50, max_tokens=8, seed=1),
                    mask="support")
    assert eng.step() == [] and eng.committer.pending is not None
    (out,) = eng.abort("wide")
    assert out.finish_reason == "error" and "bound" in out.error
    assert out.token_ids == [] and out.supports is None
    assert not eng.has_unfinished() and eng.kv_blocks()[0] == eng.kv_blocks()[1]


@pytest.mark.parametrize("spec", ["none", "dspark"])
def test_masks_reach_their_samples_one_step_late_and_whole_at_every_end(tiny_random_qwen3, random_drafters,
                                                                       spec):
    """While no masked sample finishes, a step's masks wait for the next step (`pending`); a finish
    and an abort hand them over first, so every output has one mask per token."""
    eng = _engine(tiny_random_qwen3, spec, random_drafters.get(spec))
    long = SamplingParams(temperature=1.0, top_k=8, max_tokens=40, ignore_eos=True, seed=3)
    eng.add_request("kept", PROMPTS[:1], long, mask="support")
    eng.add_request("short", PROMPTS[1:2], SamplingParams(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True,
                                                          seed=4), mask="selected")
    eng.add_request("cut", PROMPTS[2:3], long, mask="support")
    outs = []
    for _ in range(3):
        outs += eng.step()
        kept = next(s for s in eng.scheduler.running if s.request_id == "kept")
        if eng.committer.pending is not None:  # the last step's parts are not in yet
            assert len(kept.support_parts) == len(kept.accept_lengths) - 1
    while not outs:  # "short" finishes: its masks are handed over at once
        outs += eng.step()
    assert [o.request_id for o in outs] == ["short"] and len(outs[0].supports) == len(outs[0].token_ids) == 3
    eng.step()
    assert eng.committer.pending is not None
    aborted = eng.abort("cut")
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert len(aborted[0].supports) == len(aborted[0].token_ids) > 0
    outs = aborted + _run(eng)
    for o in outs:
        assert len(o.supports) == len(o.token_ids) == len(o.token_logprobs)
        for j, tok in enumerate(o.token_ids):
            assert tok in o.support_ids[j]
    assert eng.committer.pending is None and eng.kv_blocks()[0] == eng.kv_blocks()[1]


@pytest.mark.parametrize("spec", ["none", "dflash"])
def test_samples_keep_only_committed_rows(tiny_random_qwen3, random_drafters, spec, monkeypatch):
    """Each step keeps exactly its masked entries' committed rows (a rejected draft's row is never
    held by a sample), and the masks are whole."""
    import rollout.engine.commit as commit_mod

    real = capture_mod.committed_masks
    steps = []  # (packed rows copied, rows kept, committed tokens of masked entries)

    def recording(cap, packed, counts):
        out = real(cap, packed, counts)
        steps.append((len(packed), len(out.rows.ids), sum(counts.values())))
        return out

    monkeypatch.setattr(commit_mod, "committed_masks", recording)
    eng = _engine(tiny_random_qwen3, spec, random_drafters.get(spec))
    eng.add_request("sampled", PROMPTS, SAMPLED, n=2, mask="support")
    eng.add_request("greedy", PROMPTS[:1], GREEDY, mask="selected")
    eng.add_request("plain", PROMPTS[1:], SAMPLED)
    outs = _run(eng)
    assert steps and all(kept == committed for _, kept, committed in steps)
    masked = [o for o in outs if o.request_id != "plain"]
    assert masked and all(o.supports is not None and len(o.supports) == len(o.token_ids) for o in masked)
    if spec == "none":  # one row per entry and step: every row is committed
        assert all(copied == kept for copied, kept, _ in steps)
    else:  # rejected drafts' rows are dropped
        assert sum(kept for _, kept, _ in steps) < sum(copied for copied, _, _ in steps)


def test_requests_without_masks_run_no_capture_code(tiny_random_qwen3, random_drafters, monkeypatch):
    calls = []
    real = capture_mod.pack_supports
    monkeypatch.setattr(capture_mod, "pack_supports", lambda *a, **k: calls.append(1) or real(*a, **k))
    eng = _engine(tiny_random_qwen3, "dflash", random_drafters["dflash"])
    eng.add_request("a", PROMPTS, SAMPLED, n=2)
    eng.add_request("b", PROMPTS, GREEDY)
    _run(eng)
    assert calls == [] and eng.capture.num_captures == 0
    eng.add_request("c", PROMPTS, SAMPLED, mask="selected")
    _run(eng)
    assert len(calls) > 0 and eng.capture.num_captures == len(calls)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constraints_that_exclude_every_token_fail_that_sample_only(temperature):
    """A regex that must end after one byte, with min_tokens banning EOS: no token is allowed at
    position 1. That sample fails with a clear error; the engine and the other request go on."""
    eng = build_engine(EngineConfig(num_kv_blocks=300))
    params = SamplingParams(temperature=temperature, top_k=5, max_tokens=8, min_tokens=3, seed=1)
    eng.add_request("conflict", [[97, 98]], params, grammar=GrammarSpec("regex", "a"), mask="support")
    eng.add_request("fine", [[97, 98]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outs = {o.request_id: o for o in _run(eng)}
    bad = outs["conflict"]
    assert bad.finish_reason == "error" and "no token is allowed at output position 1" in bad.error
    assert bad.token_ids == [] and bad.support_ids is None
    assert len(outs["fine"].token_ids) == 8 and outs["fine"].error is None
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]


def test_grammar_with_ignore_eos_is_refused_before_any_work():
    """A grammar ends the sample at EOS; ignore_eos would have the sample run past its grammar's
    end (it crashed every request's step before it was refused)."""
    eng = build_engine(EngineConfig(num_kv_blocks=100))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with pytest.raises(InvalidArgument, match="ignore_eos"):
        eng.add_request("g", [[97]], params, grammar=GrammarSpec("regex", "[a-z]{1,3}"))
    assert not eng.has_unfinished()


def test_a_token_the_grammar_rejects_at_commit_fails_that_sample_only(monkeypatch):
    """Defence in depth: if a committed token ever failed its grammar, that sample fails with the
    reason and the engine serves the rest, instead of the step raising for every request."""
    from rollout.engine import grammar as grammar_mod

    def reject(self, tokens):
        raise grammar_mod.GrammarRejected(f"grammar rejected committed token {tokens[0]}: test")

    monkeypatch.setattr(grammar_mod.GrammarState, "commit", reject)
    eng = build_engine(EngineConfig(num_kv_blocks=300))
    eng.add_request("g", [[97]], SamplingParams(temperature=0.0, max_tokens=8), grammar=GrammarSpec("regex", "[a-z]+"))
    eng.add_request("plain", [[97, 98]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outs = {o.request_id: o for o in _run(eng)}
    assert outs["g"].finish_reason == "error" and "grammar rejected committed token" in outs["g"].error
    assert len(outs["plain"].token_ids) == 8 and outs["plain"].error is None
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
