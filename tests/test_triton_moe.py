"""The fused MoE kernels (rollout/engine/triton_moe.py) against the torch reference of
rollout/engine/moe.py and transformers' router, on CPU through Triton's interpreter (conftest
sets TRITON_INTERPRET=1 without a GPU; on a GPU the compiled kernels run, in bfloat16 too).

Routing: softmax, top-k with ties to the lowest expert id, renormalisation. The sort by expert:
exact padded blocks for a small routing, the invariants for a random one. The grouped GEMMs on
routings with experts that receive no token, a token routed to every expert (so to every
block group), one decode token, and a step large enough for 64-row blocks. Then a MoE engine
through the kernels, with a drafter, on the CUDA-graph static buffers.
"""

from __future__ import annotations

import pytest
import torch
from test_spec_engine import PROMPTS, _generate

from rollout.engine import moe, triton_moe
from rollout.engine.params import SamplingParams
from rollout.engine.triton_attention import supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not supported(16, torch.float32, DEVICE),
                                reason="triton missing: it ships with xgrammar, a dependency")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _experts(num_experts: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2  # [E, 2I, H]
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2  # [E, H, I]
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_equals_the_reference_and_transformers(renormalize):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                      norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg).to(DEVICE)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=gen))
        x = torch.randn(37, 32, generator=gen).to(DEVICE)
        logits, hf_weights, hf_ids = router(x)
    weights, ids = moe.route(logits, 3, renormalize)
    k_weights, k_ids = triton_moe.route(logits, 3, renormalize)
    assert torch.equal(ids, hf_ids) and torch.equal(k_ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    torch.testing.assert_close(k_weights, hf_weights, atol=1e-5, rtol=1e-5)  # exp in Triton vs torch
    assert torch.allclose(k_weights.sum(-1), torch.ones(37, device=DEVICE)) == renormalize


def test_ties_go_to_the_lowest_expert_id():
    logits = torch.tensor([[0.0] * 6, [1, 3, 3, 0, 3, 3], [2, 2, 1, 1, 5, 5], [-1, 0, 0, 0, 0, -1]], device=DEVICE)
    want = [[0, 1, 2], [1, 2, 4], [4, 5, 0], [1, 2, 3]]
    in_align = lambda logits, k, renormalize: triton_moe.route_and_align(logits, k, renormalize, 16)[:2]  # noqa: E731
    for route in (moe.route, triton_moe.route, in_align):
        weights, ids = route(logits, 3, True)
        assert ids.tolist() == want
        torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=DEVICE))


def test_routing_inside_the_align_program_equals_the_two_launches():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(37, 7, generator=gen).to(DEVICE)  # three routing tiles, 7 experts
    weights, ids = triton_moe.route(logits, 4, False)  # 148 pairs: two align iterations
    want = triton_moe.align(ids, 7, 16)
    got = triton_moe.route_and_align(logits, 4, False, 16)
    for a, b in zip(got, (weights, ids, *want), strict=True):
        assert torch.equal(a, b)


def test_align_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[1, 0], [1, 3], [0, 1], [3, 1]], device=DEVICE)  # experts 2 and 4 get nothing
    sorted_pairs, block_expert = triton_moe.align(ids, 5, 4)
    pad = 8  # M: the sentinel of padding rows
    assert block_expert.tolist() == [0, 1, 3, -1, -1]  # max_blocks(8, 5, 4) = 5
    assert sorted_pairs[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, 7, 3, 6, pad, pad]
    assert (sorted_pairs[12:] == pad).all()


def test_align_invariants_on_a_random_routing():
    gen = torch.Generator().manual_seed(3)
    num_experts, block_m = 7, 16
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:3] for _ in range(50)]).to(DEVICE)  # [50, 3]
    sorted_pairs, block_expert = (t.cpu() for t in triton_moe.align(ids, num_experts, block_m))
    flat = ids.flatten().cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    assert (block_expert >= 0).sum() == (-(-counts // block_m)).sum()
    rows = sorted_pairs.view(-1, block_m)
    for block, expert in enumerate(block_expert.tolist()):
        pairs = rows[block][rows[block] < flat.numel()]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert (flat[pairs] == expert).all() and (pairs.diff() > 0).all()
    placed = sorted_pairs[sorted_pairs < flat.numel()]
    assert sorted(placed.tolist()) == list(range(flat.numel()))  # every pair exactly once


CASES = {  # tokens, experts, top k
    "decode-token": (1, 8, 2),
    "experts-without-tokens": (3, 8, 2),
    "token-to-every-expert": (5, 4, 4),
    "ragged-step": (23, 6, 2),
    "64-row-blocks": (70, 4, 2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_experts_equal_the_reference(case, dtype):
    num_tokens, num_experts, top_k = CASES[case]
    hidden, inter = 48, 40  # not multiples of the column / reduction tiles
    gate_up, down = _experts(num_experts, hidden, inter, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE, dtype)
    weights, ids = moe.route(logits, top_k, renormalize=True)
    used = ids.unique().numel()
    assert used < num_experts if case == "experts-without-tokens" else True
    assert triton_moe.tiles(num_tokens * top_k, num_experts)[0] == (64 if case == "64-row-blocks" else 16)
    want = moe.experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    got = triton_moe.fused_experts(x, gate_up, down, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.dtype == dtype and got.shape == x.shape


@pytest.mark.parametrize("num_tokens", [9, triton_moe.FUSED_ROUTE_TOKENS + 6])  # routed in align / on its own
def test_fused_moe_equals_the_sparse_block(num_tokens):
    block = moe.SparseMoeBlock(48, moe.MoeConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                                                 norm_topk_prob=False)).to(DEVICE)
    gate_up, down = _experts(6, 48, 40, seed=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
        block.gate.weight.copy_(torch.randn(6, 48, generator=gen))
        x = torch.randn(num_tokens, 48, generator=gen).to(DEVICE)
        want = block(x)
        block.backend = "triton"
        got = block(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, torch.zeros_like(got))


def test_a_wrong_expert_breaks_the_comparison():
    gate_up, down = _experts(4, 48, 40)
    x = torch.randn(3, 48, device=DEVICE)
    weights, ids = moe.route(torch.randn(3, 4, device=DEVICE), 2, True)
    got = triton_moe.fused_experts(x, gate_up, down, weights, ids)
    assert not torch.allclose(got, moe.experts_reference(x, gate_up, down, weights, (ids + 1) % 4), atol=1e-3)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU engine through the interpreter (bfloat16 on CUDA)")
def test_moe_engine_through_the_kernels_and_graph_buffers(tiny_random_qwen3_moe, random_moe_drafters):
    """Verify steps of a DFlash drafter on the static-buffer (CUDA-graph) path, every layer's
    kernels through the interpreter: the tokens and log-probs of the plain torch engine."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain, _ = _generate(tiny_random_qwen3_moe, PROMPTS[1:3], greedy, kernel_backend="torch")
    _, eng = _generate(tiny_random_qwen3_moe, [[1]], SamplingParams(max_tokens=1), spec="dflash", block=4,
                       draft=random_moe_drafters["dflash"], kernel_backend="triton")
    eng.graphs = eng.make_step_graphs(capture=False)
    eng.add_request("g", PROMPTS[1:3], greedy)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    outs.sort(key=lambda o: o.prompt_index)
    assert eng.graphs.num_replays > 0
    for ref, got in zip(plain, outs, strict=True):
        assert got.token_ids == ref.token_ids
        assert got.token_logprobs == pytest.approx(ref.token_logprobs, abs=1e-4)
