"""The engine end to end on a random tiny Qwen3 (tests/conftest.py), CPU, float32.

Greedy generation equals transformers' greedy `generate`; paging with tiny blocks, chunked
prefill and preemption give the tokens of the same requests run one at a time; the n samples
of a prompt share its blocks and prefill once; prefixes are reused across requests; seeded
requests reproduce whatever else is in the batch; finish reasons (stop ids, EOS, min_tokens,
max_tokens); abort frees every block at once; token_logprobs equal the log-probs of docs/sampling.md
recomputed from transformers' logits with the independent reference of contract1_ref.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from contract1_ref import reference_policy

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams

EOS = 256
PROMPTS = [[1, 2, 3], [40, 50, 60, 70, 80, 90, 100, 110, 120, 5], [200], list(range(60, 83)),
           [7, 7, 7, 7, 9], list(range(100, 137))]  # fmt: skip


def make_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=64)
    cfg.update(kw)
    return build_engine(EngineConfig(model=str(model_dir), **cfg))


def run_all(eng: LLMEngine, max_steps: int = 3000) -> dict:
    """Step until idle; finished samples keyed by (request_id, prompt_index, sample_index)."""
    outs, steps = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            key = (o.request_id, o.prompt_index, o.sample_index)
            assert key not in outs, f"{key} finished twice"
            outs[key] = o
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return outs


def count_forward_tokens(eng: LLMEngine) -> list[int]:
    """Records the number of tokens of every target forward."""
    sizes: list[int] = []
    eng.model.register_forward_pre_hook(lambda _module, args: sizes.append(args[0].numel()))
    return sizes


def assert_same_outputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert g.token_ids == w.token_ids, f"{key}: tokens differ"
        assert g.finish_reason == w.finish_reason, key
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4), key


@pytest.fixture(scope="module")
def hf_model(tiny_random_qwen3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_random_qwen3, attn_implementation="eager").float().eval()


# -- greedy parity --------------------------------------------------------------------------------


def test_greedy_batch_equals_transformers_generate(tiny_random_qwen3, hf_model):
    max_new = 16
    eng = make_engine(tiny_random_qwen3, block_size=4, max_num_batched_tokens=40)  # chunked prefill too
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"r{i}", [prompt], greedy)
    outs = run_all(eng)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                                    eos_token_id=None, pad_token_id=0)
        out = outs[(f"r{i}", 0, 0)]
        assert out.token_ids == ref[0, len(prompt):].tolist(), f"prompt {i}"
        assert out.token_logprobs == [0.0] * max_new and out.finish_reason == "length"


# -- paging, batching, preemption ------------------------------------------------------------------

SAMPLED = dict(temperature=1.0, top_k=60, top_p=0.95, ignore_eos=True)
REQUESTS = [  # (request_id, prompts, params, n)
    ("g0", [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), 1),
    ("s1", [PROMPTS[1]], SamplingParams(max_tokens=12, seed=11, **SAMPLED), 1),
    ("s2", [PROMPTS[2], PROMPTS[4]], SamplingParams(max_tokens=9, seed=12, **SAMPLED), 1),
    ("n3", [PROMPTS[3]], SamplingParams(max_tokens=8, seed=13, **SAMPLED), 3),
    ("g4", [PROMPTS[5]], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), 1),
    ("p5", [PROMPTS[4]], SamplingParams(max_tokens=10, seed=15, temperature=0.9, min_p=0.05,
                                        repetition_penalty=1.2, presence_penalty=0.3), 2),
]


def add_all(eng: LLMEngine, requests=REQUESTS) -> None:
    for rid, prompts, params, n in requests:
        eng.add_request(rid, prompts, params, n=n)


@pytest.fixture(scope="module")
def one_at_a_time(tiny_random_qwen3):
    """Every request of REQUESTS alone in a fresh engine with large blocks."""
    outs = {}
    for req in REQUESTS:
        eng = make_engine(tiny_random_qwen3, block_size=16, num_kv_blocks=64)
        add_all(eng, [req])
        outs.update(run_all(eng))
    return outs


def test_tiny_blocks_and_a_concurrent_batch_give_the_same_tokens(tiny_random_qwen3, one_at_a_time):
    eng = make_engine(tiny_random_qwen3, block_size=2, num_kv_blocks=512, max_num_batched_tokens=16)
    add_all(eng)
    assert_same_outputs(run_all(eng), one_at_a_time)
    assert eng.scheduler.num_preemptions == 0
    assert eng.kv_blocks() == (512, 512)


def test_preemption_under_a_small_kv_budget_keeps_every_token(tiny_random_qwen3, one_at_a_time):
    eng = make_engine(tiny_random_qwen3, block_size=2, num_kv_blocks=32, max_num_batched_tokens=64)
    add_all(eng)
    assert_same_outputs(run_all(eng), one_at_a_time)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv_blocks() == (32, 32)


def test_seeded_requests_reproduce_across_batch_compositions(tiny_random_qwen3, one_at_a_time):
    """The seeded requests of REQUESTS again, now arriving mid-run next to other traffic."""
    eng = make_engine(tiny_random_qwen3, block_size=8, max_num_batched_tokens=24)
    other = SamplingParams(max_tokens=15, temperature=1.3, ignore_eos=True)
    eng.add_request("noise-a", [list(range(5, 30))], other, n=2)
    eng.add_request("noise-b", [[3] * 11], other)
    seeded = [r for r in REQUESTS if r[2].seed is not None]
    for req in seeded:
        for _ in range(2):
            assert eng.step() == []
        add_all(eng, [req])
        eng.add_request(f"noise-{req[0]}", [PROMPTS[1][: len(req[0]) + 3]], other)
    outs = run_all(eng)
    got = {k: v for k, v in outs.items() if not k[0].startswith("noise")}
    want = {k: v for k, v in one_at_a_time.items() if k[0] in {r[0] for r in seeded}}
    assert_same_outputs(got, want)


def test_the_seed_decides_the_tokens(tiny_random_qwen3, one_at_a_time):
    eng = make_engine(tiny_random_qwen3)
    eng.add_request("s1", [PROMPTS[1]], SamplingParams(max_tokens=12, seed=12, **SAMPLED))
    out = run_all(eng)[("s1", 0, 0)]
    assert out.token_ids != one_at_a_time[("s1", 0, 0)].token_ids
    n3 = [one_at_a_time[("n3", 0, s)].token_ids for s in range(3)]
    assert len({tuple(t) for t in n3}) == 3, "the n samples of a prompt must draw differently"


# -- n samples share the prompt ------------------------------------------------------------------


def test_n_samples_share_the_prompt_blocks_and_prefill_once(tiny_random_qwen3):
    n, prompt, max_tokens = 4, list(range(30, 39)), 6  # 9 tokens: 2 full blocks of 4 + a partial one
    eng = make_engine(tiny_random_qwen3, block_size=4, num_kv_blocks=64, overlap=False)
    forwarded = count_forward_tokens(eng)
    eng.add_request("grp", [prompt], SamplingParams(max_tokens=max_tokens, seed=3, **SAMPLED), n=n)
    eng.step()
    assert forwarded == [9], "the prompt must be computed once for the whole group"
    samples = eng.scheduler.running
    assert len(samples) == n and sorted(s.sample_index for s in samples) == list(range(n))
    shared = samples[0].block_table[:2]
    bm = eng.block_manager
    for s in samples:
        assert s.block_table[:2] == shared and len(s.block_table) == 3
        assert bm.ref_counts[s.block_table[2]] == 1
    assert [bm.ref_counts[b] for b in shared] == [n, n]
    assert len({s.block_table[2] for s in samples}) == n  # the partial block is copied per sample
    assert eng.kv_blocks() == (64 - 2 - n, 64)
    outs = run_all(eng)
    assert sum(forwarded) == len(prompt) + n * (max_tokens - 1)
    assert eng.kv_blocks() == (64, 64)
    assert len({tuple(o.token_ids) for o in outs.values()}) > 1


def test_a_sample_that_stops_at_once_costs_its_group_no_second_prefill(tiny_random_qwen3):
    prompt, n = list(range(30, 39)), 4
    for seed in range(3, 30):  # a seed whose sample 0 draws a first token no sibling ever draws
        base = dict(max_tokens=6, seed=seed, **SAMPLED)
        eng = make_engine(tiny_random_qwen3)
        eng.add_request("grp", [prompt], SamplingParams(**base), n=n)
        free_run = run_all(eng)
        stop = free_run[("grp", 0, 0)].token_ids[0]
        if all(stop not in free_run[("grp", 0, s)].token_ids for s in range(1, n)):
            break
    else:
        pytest.fail("no seed in range gives sample 0 a first token its siblings never draw")
    eng = make_engine(tiny_random_qwen3, overlap=False)
    forwarded = count_forward_tokens(eng)
    eng.add_request("grp", [prompt], SamplingParams(stop_token_ids=[stop], **base), n=n)
    outs = run_all(eng)
    assert outs[("grp", 0, 0)].token_ids == [stop] and outs[("grp", 0, 0)].finish_reason == "stop"
    assert_same_outputs({k: v for k, v in outs.items() if k[2]}, {k: v for k, v in free_run.items() if k[2]})
    assert sum(forwarded) == len(prompt) + (n - 1) * (base["max_tokens"] - 1), "the prompt was computed twice"
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]


def test_a_group_wider_than_the_free_blocks_still_finishes_every_sample(tiny_random_qwen3):
    """81 prompt tokens fill 21 of 32 blocks; 12 forks would each copy the partial block, so
    some samples wait and recompute the prompt instead: same tokens as with ample blocks."""
    prompt, n = [7] * 81, 13
    params = SamplingParams(max_tokens=4, seed=5, **SAMPLED)
    runs = []
    for blocks in (256, 32):
        eng = make_engine(tiny_random_qwen3, block_size=4, num_kv_blocks=blocks)
        forwarded = count_forward_tokens(eng)
        eng.add_request("wide", [prompt], params, n=n)
        runs.append(run_all(eng))
        assert eng.kv_blocks() == (blocks, blocks)
    assert sum(forwarded) > len(prompt) + n * 3, "expected some samples to recompute their prompt"
    assert len(runs[1]) == n
    assert_same_outputs(runs[1], runs[0])


@pytest.mark.parametrize("block_size", [1, 16])
def test_forked_samples_see_the_right_kv(tiny_random_qwen3, block_size):
    """Block size 1 forks without copying; 16 copies the prompt's only block: the tokens of
    each sample must not depend on it (a wrong or missing KV copy would change them)."""
    n, prompt = 4, list(range(30, 39))
    params = SamplingParams(max_tokens=6, seed=3, **SAMPLED)
    runs = []
    for bs in (4, block_size):
        eng = make_engine(tiny_random_qwen3, block_size=bs, num_kv_blocks=128)
        eng.add_request("grp", [prompt], params, n=n)
        runs.append(run_all(eng))
    assert_same_outputs(runs[1], runs[0])
    single = make_engine(tiny_random_qwen3)
    single.add_request("grp", [prompt], params, n=1)  # the same seed: sample 0 is the same sample
    assert run_all(single)[("grp", 0, 0)].token_ids == runs[0][("grp", 0, 0)].token_ids


def test_prefix_cache_reuses_a_finished_prompt_and_computes_the_rest(tiny_random_qwen3):
    prompt = list(range(150, 168))  # 18 tokens: 4 full blocks reusable, 2 computed
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    branch = prompt[:8] + [9, 9, 9, 9, 9, 9]  # shares 2 blocks
    fresh = make_engine(tiny_random_qwen3, enable_prefix_caching=False)
    fresh.add_request("b", [branch], greedy)
    want_branch = run_all(fresh)[("b", 0, 0)].token_ids
    eng = make_engine(tiny_random_qwen3, block_size=4, overlap=False)
    forwarded = count_forward_tokens(eng)
    eng.add_request("a", [prompt], greedy)
    first = run_all(eng)[("a", 0, 0)].token_ids
    assert sum(forwarded) == 18 + 4
    forwarded.clear()
    eng.add_request("a2", [prompt], greedy)
    assert run_all(eng)[("a2", 0, 0)].token_ids == first
    assert sum(forwarded) == 2 + 4
    forwarded.clear()
    eng.add_request("b", [branch], greedy)
    assert run_all(eng)[("b", 0, 0)].token_ids == want_branch
    assert sum(forwarded) == 6 + 4


# -- finish reasons, abort ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_tokens(tiny_random_qwen3):
    eng = make_engine(tiny_random_qwen3)
    eng.add_request("g", [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return run_all(eng)[("g", 0, 0)].token_ids


def _one(model_dir, **params):
    eng = make_engine(model_dir)
    eng.add_request("x", [PROMPTS[1]], SamplingParams(temperature=0.0, **params))
    out = run_all(eng)[("x", 0, 0)]
    assert len(out.token_logprobs) == len(out.token_ids)
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
    return out


def test_max_tokens_finishes_with_length(tiny_random_qwen3, greedy_tokens):
    out = _one(tiny_random_qwen3, max_tokens=5, ignore_eos=True)
    assert out.token_ids == greedy_tokens[:5] and out.finish_reason == "length"


def test_a_stop_id_finishes_with_stop_and_is_included(tiny_random_qwen3, greedy_tokens):
    k = next(i for i, t in enumerate(greedy_tokens) if i >= 2 and t not in greedy_tokens[:i])
    out = _one(tiny_random_qwen3, max_tokens=12, stop_token_ids=[greedy_tokens[k], 263])
    assert out.token_ids == greedy_tokens[: k + 1] and out.finish_reason == "stop"


def test_min_tokens_bans_stop_ids_until_reached(tiny_random_qwen3, greedy_tokens):
    stop = greedy_tokens[0]
    out = _one(tiny_random_qwen3, max_tokens=12, min_tokens=3, stop_token_ids=[stop])
    assert stop not in out.token_ids[:3] and len(out.token_ids) >= 3
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_eos_stops_unless_ignored_and_waits_for_min_tokens(tiny_random_qwen3):
    forced = {EOS: 100.0}
    out = _one(tiny_random_qwen3, max_tokens=8, logit_bias=forced)
    assert out.token_ids == [EOS] and out.finish_reason == "stop"
    out = _one(tiny_random_qwen3, max_tokens=4, logit_bias=forced, ignore_eos=True)
    assert out.token_ids == [EOS] * 4 and out.finish_reason == "length"
    out = _one(tiny_random_qwen3, max_tokens=8, logit_bias=forced, min_tokens=3)
    assert len(out.token_ids) == 4 and EOS not in out.token_ids[:3]
    assert out.token_ids[3] == EOS and out.finish_reason == "stop"


def test_abort_frees_every_block_at_once(tiny_random_qwen3):
    eng = make_engine(tiny_random_qwen3, block_size=2, num_kv_blocks=128, max_num_batched_tokens=20, overlap=False)
    long = SamplingParams(max_tokens=30, seed=1, **SAMPLED)
    eng.add_request("a", [PROMPTS[1], PROMPTS[3]], long, n=2)
    eng.add_request("b", [PROMPTS[5]], long, n=3)  # still prefilling: its samples are not forked yet
    eng.add_request("c", [PROMPTS[0]], long)
    for _ in range(3):
        assert eng.step() == []
    assert eng.kv_blocks()[0] < 128
    out = eng.abort("a")
    assert sorted((o.prompt_index, o.sample_index) for o in out) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(o.finish_reason == "abort" and len(o.token_ids) == len(o.token_logprobs) for o in out)
    held = sum(len(s.block_table) for s in eng.scheduler.running)
    assert eng.kv_blocks()[0] == 128 - held  # c and b's prompt hold no shared blocks here
    out = eng.abort("b")
    assert sorted(o.sample_index for o in out) == [0, 1, 2]
    assert eng.abort("b") == [] and eng.abort("never-seen") == []
    assert [o.request_id for o in eng.abort("c")] == ["c"]
    assert eng.kv_blocks() == (128, 128)
    assert not eng.has_unfinished() and eng.step() == []
    eng.add_request("a", [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))  # the id is free again
    assert run_all(eng)[("a", 0, 0)].finish_reason in ("length", "stop")


# -- token logprobs against transformers -----------------------------------------------------------

LOGPROB_CASES = {
    "truncated": dict(temperature=0.8, top_k=30, top_p=0.9, max_tokens=10, seed=21),
    "hot-top-p": dict(temperature=1.4, top_p=0.7, max_tokens=10, seed=22),
    "processors": dict(temperature=0.9, top_k=50, min_p=0.02, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.4, logit_bias={5: 2.0, 60: -1.5}, min_tokens=4,
                       stop_token_ids=[47, 125], max_tokens=10, seed=23),
}


@pytest.mark.parametrize("case", LOGPROB_CASES)
def test_token_logprobs_equal_contract_1_on_transformers_logits(tiny_random_qwen3, hf_model, case):
    kw = LOGPROB_CASES[case]
    params = SamplingParams(**kw)
    prompts = [PROMPTS[1], PROMPTS[4]]
    eng = make_engine(tiny_random_qwen3)
    eng.add_request("lp", prompts, params, n=2)
    outs = run_all(eng)
    ref_kw = {k: v for k, v in kw.items() if k not in ("max_tokens", "seed", "min_tokens", "stop_token_ids")}
    for (_, p, s), out in outs.items():
        prompt = prompts[p]
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0]  # [L, V]
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.token_logprobs)):
            banned = [EOS, *params.stop_token_ids] if j < params.min_tokens else []
            ref = reference_policy(logits[len(prompt) + j - 1].tolist(), history=prompt + out.token_ids[:j],
                                   banned=banned, **ref_kw)
            assert tok in ref, f"{case} sample {(p, s)} token {j}: {tok} outside the support"
            assert lp == pytest.approx(math.log(ref[tok]), abs=2e-4), f"{case} sample {(p, s)} token {j}"
