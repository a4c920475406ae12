"""Sampled drafts through the real engine where they are accepted often (docs/verification.md).

The embedded DFlash and DSpark drafters propose for the embedded target at temperature 1, top-k 4:
about 70% of their sampled drafts are accepted, so the law of the committed tokens depends on the q
each drafter reports with its drafts (a random drafter, accepted ~1% of the time, barely tests q).
1,500 samples of one prompt run to four tokens; the first comes from the prefill, the second and
third from verified drafts (block size 3: two drafts). Their joint law of the first three tokens
must equal the exact law of docs/sampling.md, computed from transformers' logits by the independent
reference (tests/contract1_ref.py): chi-square, fixed seeds.

Under the adaptive draft budget (issue 19), with each sample's drafts per step drawn at random through
the budget's hook (0, 1 or 2: a prefix of the block, or none), the law is the same.

Negative controls: the same statistic must fail, by at least twice its critical value, for three
wrong drafters, each a mutation of `rollout.spec.proposer._draw` that passed every test before
this file (issue 25): q reported as uniform (the drafts still drawn from q: a real exactness bug),
the argmax drafted while the softmax is reported, and q^4 (renormalised) reported.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from contract1_ref import reference_policy
from spec_helpers import cost_table

import rollout.spec.proposer as proposer
from rollout import build_engine
from rollout.engine.config import DEFAULT_MODEL, EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

PROMPT = "        if "  # the embedded target continues it in several ways, its drafters follow well
PROMPT_IDS = list(PROMPT.encode())  # the byte-level tokenizer
TOP_K = 4
PARAMS = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, ignore_eos=True, seed=3)
NUM_SAMPLES = 1500
BLOCK = 3  # two drafts per block: the second and third tokens


@pytest.fixture(scope="module", params=["dflash", "dspark"])
def engine(request) -> LLMEngine:
    return build_engine(EngineConfig(spec=request.param, spec_block_size=BLOCK, block_size=4,
                                  num_kv_blocks=3 * NUM_SAMPLES, max_num_seqs=NUM_SAMPLES,
                                  max_num_batched_tokens=BLOCK * NUM_SAMPLES, spec_adaptive=False))


@pytest.fixture(scope="module")
def exact_joint() -> dict[tuple[int, int, int], float]:
    return exact_joint_law()


def exact_joint_law() -> dict[tuple[int, int, int], float]:
    """p(t1, t2, t3) = p_1(t1) p_2(t2 | t1) p_3(t3 | t1, t2) from transformers' logits (also the
    reference of tests/test_history_sampled_drafts.py)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()

    def p(context: list[int]) -> dict[int, float]:
        with torch.no_grad():
            z = hf(torch.tensor([PROMPT_IDS + context])).logits[0, -1]
        return reference_policy(z.tolist(), temperature=PARAMS.temperature, top_k=TOP_K)

    return {(a, b, c): pa * pb * pc for a, pa in p([]).items() for b, pb in p([a]).items()
            for c, pc in p([a, b]).items()}


def _run(engine: LLMEngine) -> tuple[Counter, float]:
    """The first three tokens of every sample, and the fraction of sampled drafts accepted."""
    drafted = engine.drafter.num_drafted
    assert engine.tokenizer.encode(PROMPT).ids == PROMPT_IDS
    engine.add_request("r", [PROMPT_IDS], PARAMS, n=NUM_SAMPLES)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert all(o.accept_lengths[0] == 1 for o in outs)  # the first token comes from the prefill
    accepted = sum(a - 1 for o in outs for a in o.accept_lengths[1:])
    return Counter(tuple(o.token_ids[:3]) for o in outs), accepted / (engine.drafter.num_drafted - drafted)


def _chi2(counts: Counter, exact: dict) -> tuple[float, float]:
    """Chi-square of the observed triples against the exact law (cells expecting < 5 pooled) and
    its critical value at ~3e-5 (Wilson-Hilferty, z = 4). A triple outside the support is
    infinitely unlikely."""
    if set(counts) - set(exact):
        return math.inf, 0.0
    n = sum(counts.values())
    big = [k for k, p in exact.items() if p * n >= 5]
    cells = [(counts[k], exact[k] * n) for k in big]
    cells.append((n - sum(o for o, _ in cells), n - sum(e for _, e in cells)))  # the rest, pooled
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    return stat, df * (1 - 2 / (9 * df) + 4.0 * math.sqrt(2 / (9 * df))) ** 3


def test_often_accepted_sampled_drafts_follow_the_exact_law(engine, exact_joint):
    counts, acceptance = _run(engine)
    assert acceptance > 0.55, f"only {acceptance:.0%} of the drafts were accepted: q hardly matters"
    stat, crit = _chi2(counts, exact_joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}"


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_sampled_drafts_follow_the_exact_law_under_a_varying_budget(spec, exact_joint):
    eng = build_engine(EngineConfig(spec=spec, spec_block_size=BLOCK, block_size=4, num_kv_blocks=3 * NUM_SAMPLES,
                                    max_num_seqs=NUM_SAMPLES, max_num_batched_tokens=BLOCK * NUM_SAMPLES),
                       step_cost=cost_table(q=BLOCK))
    rng, chosen = random.Random(7), Counter()

    def random_caps(running, admits, budget, waiting_tokens=0):
        caps = {s: rng.randint(0, BLOCK - 1) for s in running}
        chosen.update(caps.values())
        return caps

    eng.spec_budget.caps = random_caps
    counts, acceptance = _run(eng)
    assert min(chosen[k] for k in range(BLOCK)) > NUM_SAMPLES / 2  # every budget, often
    assert acceptance > 0.5
    stat, crit = _chi2(counts, exact_joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}"


# `_draw(z, temp, greedy, u)` divides the logits z in place by the temperature, so that they become
# q's logits (the drafter hands them over as its Proposal), draws from softmax(z) and returns
# (drafts, logsumexp(z)). Each mutation runs after the real draw and changes what is reported.
def _uniform_q(z, prev, lse):
    z.zero_()  # q reported as uniform
    return prev, torch.full_like(lse, math.log(z.shape[-1]))


def _argmax_drafted(z, prev, lse):
    return z.argmax(dim=-1), lse  # the argmax drafted, the softmax reported


def _q_to_the_fourth(z, prev, lse):
    z.mul_(4.0)  # q^4, normalised, reported
    return prev, torch.logsumexp(z, dim=-1)


@pytest.mark.parametrize("mutation", [_uniform_q, _argmax_drafted, _q_to_the_fourth],
                         ids=["uniform-q", "argmax-drafted", "q^4-reported"])
def test_a_drafter_reporting_a_wrong_q_fails_the_law(engine, exact_joint, mutation, monkeypatch):
    real = proposer._draw
    monkeypatch.setattr(proposer, "_draw", lambda z, *rest: mutation(z, *real(z, *rest)))
    stat, crit = _chi2(_run(engine)[0], exact_joint)
    assert stat > 2 * crit, f"the mutation passes: chi2 {stat:.1f}, critical value {crit:.1f}"
