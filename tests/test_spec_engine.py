"""Speculative decoding through the real engine (docs/verification.md): greedy outputs equal
non-speculative greedy outputs token for token for DFlash, DSpark and a drafter whose drafts
are often accepted, across block sizes, batch sizes and preemption; sampled outputs follow
the exact law of docs/sampling.md (with truncation, penalties and bias on), with a negative control;
mismatched drafters are refused at load."""

from __future__ import annotations

import math

import pytest
import torch
from spec_helpers import RepeatDrafter, factory_of

import rollout.engine.verify as verify_mod
from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.drafter import Drafts
from rollout.engine.loader import load_model
from rollout.engine.params import SamplingParams
from rollout.engine.sampler import PURPOSE_ACCEPT, RowParams, policy, uniform_of_keys
from rollout.errors import LoadError
from rollout.spec.draft_loader import random_drafter, save_drafter

PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [42],
           [1, 2, 3, 4, 5, 6], [200, 201], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17], [77, 78, 79, 80]]


def _generate(model, prompts, params, n=1, spec="none", draft=None, block=None, num_kv_blocks=400,
              drafter=None, max_num_seqs=256, budget=32, spec_adaptive=False, **config):
    """Runs the prompts to the end; full draft blocks unless `spec_adaptive` (test_spec_adaptive.py)."""
    cfg = EngineConfig(model=str(model), spec=spec, draft=draft, spec_block_size=block, block_size=4,
                       num_kv_blocks=num_kv_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                       spec_adaptive=spec_adaptive, **config)
    eng = build_engine(cfg, drafter_factory=factory_of(drafter))
    eng.add_request("r", prompts, params, n=n)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
    outs.sort(key=lambda o: (o.prompt_index, o.sample_index))
    return outs, eng


GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_base(tiny_random_qwen3):
    return {n: [o.token_ids for o in _generate(tiny_random_qwen3, PROMPTS[:n], GREEDY)[0]] for n in (1, 7)}


@pytest.mark.parametrize("block", [2, 4, 8])
@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_greedy_spec_equals_plain_greedy(tiny_random_qwen3, random_drafters, greedy_base, spec, block):
    for prompts in (PROMPTS[:1], PROMPTS):
        for kv in (400, 14):  # 14 blocks of 4 slots force preemption with 7 prompts
            outs, eng = _generate(tiny_random_qwen3, prompts, GREEDY, spec=spec, draft=random_drafters[spec],
                                  block=block, num_kv_blocks=kv)
            assert [o.token_ids for o in outs] == greedy_base[len(prompts)]
            assert all(sum(o.accept_lengths) == len(o.token_ids) for o in outs)
            if kv == 14 and len(prompts) > 1:
                assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("block", [2, 4, 8])
def test_greedy_with_often_accepted_drafts(tiny_random_qwen3, greedy_base, block):
    for kv in (400, 14):
        outs, eng = _generate(tiny_random_qwen3, PROMPTS, GREEDY, drafter=RepeatDrafter(block), num_kv_blocks=kv)
        assert [o.token_ids for o in outs] == greedy_base[7]
        steps = [a for o in outs for a in o.accept_lengths]
        assert max(steps) == block  # some blocks were accepted whole (+ bonus)
        assert sum(steps) / len(steps) > 1.3


def test_dspark_confidence_threshold_shortens_drafts_losslessly(tiny_random_qwen3, random_drafters, greedy_base):
    drafted = {}
    for threshold in (0.0, 0.6):
        cfg = EngineConfig(model=str(tiny_random_qwen3), spec="dspark", draft=random_drafters["dspark"],
                           spec_block_size=8, spec_confidence_threshold=threshold, block_size=4, num_kv_blocks=400,
                           spec_adaptive=False)
        eng = build_engine(cfg)
        eng.add_request("r", PROMPTS, GREEDY)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        outs.sort(key=lambda o: o.prompt_index)
        assert [o.token_ids for o in outs] == greedy_base[7]
        drafted[threshold] = eng.drafter.num_drafted
        if threshold == 0.0:
            assert eng.drafter.num_drafted > 0
    assert 0 < drafted[0.6] < drafted[0.0]  # ragged, shorter blocks, same output


# ---- sampled exactness --------------------------------------------------------------------

SAMPLED = dict(temperature=1.1, top_k=6, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
               frequency_penalty=0.1, presence_penalty=0.05, logit_bias={120: 2.0, 7: -1.5},
               max_tokens=4, ignore_eos=True)  # the second step verifies 2 drafts
PROMPT = [120, 50, 7, 120, 33]
NUM_SAMPLES = 2000


def _reference_joint(model_dir):
    """p(t1, t2) from transformers logits with the sampling distribution applied (penalties count prompt + t1)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    with torch.no_grad():
        z1 = hf(torch.tensor([PROMPT])).logits[0, -1]
        cand = torch.arange(vocab)
        batch = torch.cat([torch.tensor(PROMPT).expand(vocab, -1), cand[:, None]], dim=1)
        z2 = hf(batch).logits[:, -1]  # [V (t1), V]
    p1 = policy(z1[None], _row_params(1, vocab, [PROMPT])).probs()[0]
    p2 = policy(z2, _row_params(vocab, vocab, [PROMPT + [t] for t in range(vocab)])).probs()
    return p1[:, None] * p2


def _row_params(n, vocab, histories):
    sp = SAMPLED
    counts = torch.zeros(n, vocab)
    for i, h in enumerate(histories):
        for t in h:
            counts[i, t] += 1
    bias = sp["logit_bias"]
    rows = torch.arange(n).repeat_interleave(len(bias))
    toks = torch.tensor(list(bias)).repeat(n)
    vals = torch.tensor(list(bias.values())).repeat(n)
    return RowParams(
        temperature=torch.full((n,), sp["temperature"]), top_k=torch.full((n,), sp["top_k"]),
        top_p=torch.full((n,), sp["top_p"]), min_p=torch.full((n,), sp["min_p"]),
        bias=(rows, toks, vals), counts=counts,
        penalties=torch.tensor([[sp["repetition_penalty"], sp["frequency_penalty"],
                                 sp["presence_penalty"]]]).repeat(n, 1),
    )


def _engine_pairs(model_dir, drafter=None, spec="none", draft=None):
    outs, _ = _generate(model_dir, [PROMPT], SamplingParams(seed=11, **SAMPLED), n=NUM_SAMPLES, spec=spec,
                        draft=draft, block=4, drafter=drafter, max_num_seqs=NUM_SAMPLES,
                        num_kv_blocks=3 * NUM_SAMPLES, budget=4 * NUM_SAMPLES)
    if drafter is not None or spec != "none":
        assert all(o.accept_lengths[0] == 1 for o in outs)  # the first token comes from the prefill
        if drafter is not None:  # repeated anchors are often right: verified drafts were accepted
            assert any(max(o.accept_lengths) > 1 for o in outs)
    return torch.tensor([o.token_ids[:2] for o in outs])


def _chi2(pairs, expected):
    v = expected.shape[0]
    obs = torch.zeros(v, v)
    obs.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs)), accumulate=True)
    exp = expected * len(pairs)
    assert obs[exp == 0].sum() == 0, "a committed token outside its support"
    cells = exp >= 5
    stat = (((obs - exp) ** 2) / exp.clamp(min=1e-12))[cells].sum().item()
    df = int(cells.sum()) - 1
    return stat, df, df * (1 - 2 / (9 * df) + 4.0 * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def reference_joint(tiny_random_qwen3):
    return _reference_joint(tiny_random_qwen3)


@pytest.mark.parametrize("which", ["plain", "repeat-drafter", "random-dflash"])
def test_sampled_spec_follows_contract1_joint_law(tiny_random_qwen3, random_drafters, reference_joint, which):
    kw = {"plain": {}, "repeat-drafter": {"drafter": RepeatDrafter(4)},
          "random-dflash": {"spec": "dflash", "draft": random_drafters["dflash"]}}[which]
    stat, df, crit = _chi2(_engine_pairs(tiny_random_qwen3, **kw), reference_joint)
    assert df >= 8
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} ({df} dof)"


def test_sampled_negative_control_detects_accept_all(tiny_random_qwen3, reference_joint, monkeypatch):
    def accept_all(keys, purpose):
        u = uniform_of_keys(keys, purpose)
        return torch.zeros_like(u) if purpose == PURPOSE_ACCEPT else u

    monkeypatch.setattr(verify_mod, "uniform_of_keys", accept_all)
    stat, df, crit = _chi2(_engine_pairs(tiny_random_qwen3, drafter=RepeatDrafter(4)), reference_joint)
    assert stat > 3 * crit, f"accept-all verifier not detected: chi2 {stat:.1f} vs {crit:.1f}"


# ---- refusals -----------------------------------------------------------------------------

def test_mismatched_drafter_is_refused(tiny_random_qwen3, tmp_path):
    """Refused for the pairing: the same drafter serves the target it was built for (a loader that
    refused every drafter with a "hidden" message passed the old version of this test)."""
    from conftest import TINY_QWEN3, save_random_hf_model, write_byte_tokenizer

    other = tmp_path / "wide-target"
    save_random_hf_model(other, **{**TINY_QWEN3, "hidden_size": 96})
    write_byte_tokenizer(other)
    wide = load_model(other)
    save_drafter(random_drafter(wide, "dflash", block_size=4, mask_token_id=258), tmp_path / "d")
    with pytest.raises(LoadError, match="hidden"):
        build_engine(EngineConfig(model=str(tiny_random_qwen3), spec="dflash", draft=str(tmp_path / "d"),
                               num_kv_blocks=64))
    own = build_engine(EngineConfig(model=str(other), spec="dflash", draft=str(tmp_path / "d"), num_kv_blocks=64))
    assert own.drafter.block == 4 and own.drafter_name == "d"


def test_generation_up_to_the_context_limit_with_a_drafter(tiny_random_qwen3, random_drafters):
    """The drafter's block reaches block - 1 positions past its anchor: the engine's context
    limit leaves room for it, and a request that fills the context runs to the end."""
    eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), spec="dflash", draft=random_drafters["dflash"],
                                    block_size=4, num_kv_blocks=400, spec_adaptive=False))
    assert eng.max_model_len == 512 - 4 + 2  # max_position_embeddings 512, drafter block 4
    prompt = [7] * 500
    eng.add_request("edge", [prompt], SamplingParams(temperature=0.0, max_tokens=eng.max_model_len - 500,
                                                      ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert len(outs[0].token_ids) == eng.max_model_len - 500


def test_group_whose_prompt_is_cached_forks_before_drafting(tiny_random_qwen3):
    """A prompt cached but for its last token is caught up in one decode-sized step; its n
    samples must fork from the prompt alone, not from a first sample that already accepted
    drafts (drafts here are the exact greedy continuation, so they are accepted)."""
    prompt = [120, 50, 7, 120, 33, 9, 9, 9, 11]  # 9 tokens: two full blocks are cacheable
    expected = _generate(tiny_random_qwen3, [prompt], GREEDY)[0][0].token_ids

    class OracleDrafter(RepeatDrafter):
        def propose(self, items, block_tables):
            counts = [it.num_draft for it in items]
            flat = [(expected + [0] * 64)[it.seq.num_output_tokens + j] for it in items for j in range(it.num_draft)]
            return Drafts(torch.tensor(flat, dtype=torch.int64), counts)

    eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=200, spec_adaptive=False),
                       drafter_factory=factory_of(OracleDrafter(4)))
    eng.add_request("warm", [prompt], GREEDY)
    while eng.has_unfinished():
        eng.step()
    eng.add_request("group", [prompt], GREEDY, n=3)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.token_ids for o in outs] == [expected] * 3
    assert max(outs[0].accept_lengths) == 4  # whole blocks were accepted
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
