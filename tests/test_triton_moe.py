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

import dataclasses

import pytest
import torch
from test_spec_engine import PROMPTS, _generate

from rollout.engine import moe, moe_launch, triton_moe, triton_moe_route, triton_ops
from rollout.engine.moe_launch import MoeLaunch, Tiles
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
    k_weights, k_ids = triton_moe_route.route(logits, 3, renormalize)
    assert torch.equal(ids, hf_ids) and torch.equal(k_ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    torch.testing.assert_close(k_weights, hf_weights, atol=1e-5, rtol=1e-5)  # exp in Triton vs torch
    assert torch.allclose(k_weights.sum(-1), torch.ones(37, device=DEVICE)) == renormalize


def test_ties_go_to_the_lowest_expert_id():
    logits = torch.tensor([[0.0] * 6, [1, 3, 3, 0, 3, 3], [2, 2, 1, 1, 5, 5], [-1, 0, 0, 0, 0, -1]], device=DEVICE)
    want = [[0, 1, 2], [1, 2, 4], [4, 5, 0], [1, 2, 3]]
    for route in (moe.route, triton_moe_route.route, _gemv_routing):
        weights, ids = route(logits, 3, True)
        assert ids.tolist() == want
        torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=DEVICE))


def _gemv_routing(logits, top_k, renormalize):
    """The routing the gemv path's gate/up programs compute for themselves (and hand to down)."""
    gate_up, _ = _experts(logits.shape[1], 16, 8, logits.dtype)
    x = torch.randn(logits.shape[0], 16, device=DEVICE, dtype=logits.dtype)
    _, weights, ids = triton_moe.gemv_gate_up(x, logits, gate_up, top_k, renormalize, Tiles(8, 16))
    return weights.view(-1, top_k), ids.view(-1, top_k)


@pytest.mark.parametrize("renormalize", [False, True])
def test_the_gemv_programs_route_like_the_reference(renormalize):
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    want_weights, want_ids = moe.route(logits, 4, renormalize)
    weights, ids = _gemv_routing(logits, 4, renormalize)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=1e-5)


def _align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """A stable sort by expert, each run padded to whole blocks with M, unused blocks -1."""
    flat = ids.flatten().cpu().long()
    num_pairs, rows, experts = flat.numel(), [], []
    for expert in range(num_experts):
        mine = (flat == expert).nonzero().flatten().tolist()  # increasing pair ids
        blocks = -(-len(mine) // block_m)
        rows += mine + [num_pairs] * (blocks * block_m - len(mine))
        experts += [expert] * blocks
    total = triton_moe_route.max_blocks(num_pairs, num_experts, block_m)
    return rows + [num_pairs] * (total * block_m - len(rows)), experts + [-1] * (total - len(experts))


ALIGN_CASES = {  # tokens, experts, top k, block_m: routing tiles of 16 tokens
    "one-token": (1, 8, 2, 16),
    "three-tiles": (37, 7, 4, 16),
    "top-3-four-tiles": (50, 7, 3, 16),  # 48 pairs a tile: padded lanes
    "two-experts-used": (40, 9, 2, 4),  # many blocks per program, unused experts between
    "two-block-iterations": (16, 128, 8, 16),  # 128 blocks for one program: two of 64
}


@pytest.mark.parametrize("case", ALIGN_CASES)
def test_align_is_a_stable_sort_padded_to_blocks(case):
    num_tokens, num_experts, top_k, block_m = ALIGN_CASES[case]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if case == "two-experts-used":
        logits[:, [2, 6]] += 10.0
    logits = logits.to(DEVICE)
    weights, ids = triton_moe_route.route(logits, top_k, False)
    want_rows, want_experts = _align_reference(ids, num_experts, block_m)
    for sorted_pairs, block_expert in (triton_moe_route.align(ids, num_experts, block_m),
                                       triton_moe.sorted_route(logits, top_k, False, block_m)[1:]):
        assert sorted_pairs.tolist() == want_rows
        assert block_expert.tolist() == want_experts
    assert torch.equal(triton_moe.sorted_route(logits, top_k, False, block_m)[0], weights.flatten())


def test_align_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[1, 0], [1, 3], [0, 1], [3, 1]], device=DEVICE)  # experts 2 and 4 get nothing
    sorted_pairs, block_expert = triton_moe_route.align(ids, 5, 4)
    pad = 8  # M: the sentinel of padding rows
    assert block_expert.tolist() == [0, 1, 3, -1, -1]  # max_blocks(8, 5, 4) = 5
    assert sorted_pairs[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, 7, 3, 6, pad, pad]
    assert (sorted_pairs[12:] == pad).all()


def test_align_invariants_on_a_random_routing():
    gen = torch.Generator().manual_seed(3)
    num_experts, block_m = 7, 16
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:3] for _ in range(50)]).to(DEVICE)  # [50, 3]
    sorted_pairs, block_expert = (t.cpu() for t in triton_moe_route.align(ids, num_experts, block_m))
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
    "top-3-of-7": (4, 7, 3),  # padded routing slots and expert lanes
    "ragged-step": (23, 6, 2),
    "64-row-blocks": (70, 4, 2),
}
# Every launch of the table on every case, and on two cases variants with other tiles (several
# reduction iterations, one pipeline stage, 64-row blocks on a small step, routing launched
# before the gemv programs, the gemv kernels multiplying by tl.dot): any launch computes the same
# function.
TABLE = {f"table-{i}": launch for i, (_, launch) in enumerate(moe_launch.LAUNCHES)}
VARIANTS = {
    "gemv-narrow": MoeLaunch("gemv", gate_up=Tiles(16, 16, 2, 1), down=Tiles(16, 16, 4, 2)),
    "gemv-routed": MoeLaunch("gemv", gate_up=Tiles(16, 32), down=Tiles(8, 32), route_inside=False),
    "gemv-wide": MoeLaunch("gemv", gate_up=Tiles(32, 32, 4, 1), down=Tiles(32, 32, 2, 2), route_inside=False),
    "sorted-m16": MoeLaunch("sorted", gate_up=Tiles(16, 16, 4, 1), down=Tiles(32, 16, 4, 2), block_m=16),
    "sorted-m64": MoeLaunch("sorted", gate_up=Tiles(32, 32, 4, 2), down=Tiles(16, 32, 4, 3), block_m=64),
}
LAUNCHES = TABLE | VARIANTS
RUNS = [(case, launch) for case in CASES for launch in TABLE] + [
    (case, launch) for case in ("decode-token", "top-3-of-7") for launch in VARIANTS]


def _case(case: str, dtype, seed: int = 1):
    num_tokens, num_experts, top_k = CASES[case]
    hidden, inter = 48, 40  # not multiples of the column / reduction tiles
    gate_up, down = _experts(num_experts, hidden, inter, dtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE, dtype)
    return x, logits, gate_up, down, top_k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("case", "launch"), RUNS)
def test_fused_moe_equals_the_reference(case, launch, dtype):
    launch = LAUNCHES[launch]
    x, logits, gate_up, down, top_k = _case(case, dtype)
    if launch.path == "gemv" and DEVICE.type == "cpu":  # a program per pair: slow in the interpreter, so its
        x, logits = x[:5], logits[:5]  # first 5 tokens (the table sends only 1-token steps to this path)
    weights, ids = moe.route(logits, top_k, renormalize=True)
    assert ids.unique().numel() < gate_up.shape[0] if case == "experts-without-tokens" else True
    want = moe.experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    got = triton_moe.fused_moe(x, logits, gate_up, down, top_k, True, launch)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.dtype == dtype and got.shape == x.shape
    if launch.path == "sorted":  # the same path on a given routing
        torch.testing.assert_close(triton_moe.fused_experts(x, gate_up, down, weights, ids, launch).float(), want,
                                   atol=tol, rtol=tol)


def test_the_table_picks_by_token_count():
    (first, small), (second, mid) = moe_launch.LAUNCHES[:2]
    assert moe_launch.launch_for(1) == moe_launch.launch_for(first) == small
    assert moe_launch.launch_for(first + 1) == moe_launch.launch_for(second) == mid
    assert moe_launch.launch_for(10**9) == moe_launch.LAUNCHES[-1][1]
    assert moe_launch.launch_for(1, "sorted").path == "sorted"
    paths = [launch.path for _, launch in moe_launch.LAUNCHES]
    assert paths == sorted(paths) and paths[0] == "gemv" and paths[-1] == "sorted"  # gemv for the small steps only


@pytest.mark.parametrize("bad", [dict(block_n=24), dict(warps=3), dict(stages=0)])
def test_bad_tiles_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Tiles(**{**dict(block_n=16, block_k=32, warps=4, stages=2), **bad})
    with pytest.raises(ValueError, match="block_m"):
        MoeLaunch("sorted", Tiles(16, 16), Tiles(16, 16), block_m=8)
    with pytest.raises(ValueError, match="path"):
        MoeLaunch("dense", Tiles(16, 16), Tiles(16, 16))
    with pytest.raises(ValueError, match="gemv path's tl.dot tiles"):  # its gate/up multiplies by tl.dot
        MoeLaunch("gemv", Tiles(8, 16), Tiles(16, 16))
    assert MoeLaunch("gemv", Tiles(16, 16), Tiles(8, 16)).down.block_n == 8  # its down does not


@pytest.mark.parametrize("num_tokens", [9, 2 * triton_moe_route.ROUTE_BLOCK_T + 6])  # one / three routing tiles
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


@pytest.mark.parametrize("launch", ["table-0", "sorted-m16", "gemv-wide"])
def test_a_wrong_expert_breaks_the_comparison(launch):
    x, logits, gate_up, down, top_k = _case("experts-without-tokens", torch.float32)
    weights, ids = moe.route(logits, top_k, True)
    got = triton_moe.fused_moe(x, logits, gate_up, down, top_k, True, LAUNCHES[launch])
    assert torch.allclose(got, moe.experts_reference(x, gate_up, down, weights, ids), atol=1e-5)
    assert not torch.allclose(got, moe.experts_reference(x, gate_up, down, weights, (ids + 1) % 8), atol=1e-3)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU engine through the interpreter (bfloat16 on CUDA)")
def test_moe_engine_through_the_kernels_and_graph_buffers(tiny_random_qwen3_moe, random_moe_drafters, monkeypatch):
    """Verify steps of a DFlash drafter on the static-buffer (CUDA-graph) path, every layer's
    kernels through the interpreter: the tokens and log-probs of the plain torch engine. Every
    step takes the sorted path here: the gemv path's program per pair costs the interpreter ~6x
    the time (it is checked on its own above, and through the sparse block)."""
    monkeypatch.setattr(moe_launch, "LAUNCHES", tuple((most, moe_launch.launch_for(most, "sorted"))
                                                      for most, _ in moe_launch.LAUNCHES))
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


@pytest.mark.parametrize("router_rows", [4, 8])
def test_the_router_in_the_norm_launch_equals_norm_then_gate(router_rows):
    """add_rms_norm_router: the norm and residual of add_rms_norm and the router's F.linear on the
    normed rows, for 6 experts over programs of 4 (a partial tile) or 8 rows, a width of 48."""
    gen = torch.Generator().manual_seed(6)
    x, res = (torch.randn(3, 48, generator=gen).to(DEVICE) for _ in range(2))
    weight, router = torch.rand(48, generator=gen).to(DEVICE) + 0.5, torch.randn(6, 48, generator=gen).to(DEVICE)
    want_out, want_total = triton_ops.add_rms_norm(x, res, weight, 1e-6)
    out, total, logits = triton_ops.add_rms_norm_router(x, res, weight, 1e-6, router, router_rows)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(total, want_total, atol=0, rtol=0)
    torch.testing.assert_close(logits, torch.nn.functional.linear(want_out, router), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="router_rows"):
        triton_ops.add_rms_norm_router(x, res, weight, 1e-6, router, 3)
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.add_rms_norm_router(x, res, weight, 1e-6, router.t().contiguous().t())


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU engine through the interpreter (bfloat16 on CUDA)")
@pytest.mark.parametrize("path", ["gemv", "sorted"])
def test_moe_decode_with_the_router_in_the_norm(tiny_random_qwen3_moe, monkeypatch, path):
    """One sequence decoding: its 1-token steps take the table's gemv entry (or a sorted one),
    whose router logits come from the norm's launch; tokens and log-probs are the torch engine's."""
    if path == "sorted":
        launch = dataclasses.replace(moe_launch.launch_for(1, "sorted"), router_in_norm=True)
        monkeypatch.setattr(moe_launch, "LAUNCHES", ((1, launch), *moe_launch.LAUNCHES[1:]))
    assert moe_launch.launch_for(1).path == path and moe_launch.launch_for(1).router_in_norm
    calls, fused = [], triton_ops.add_rms_norm_router
    monkeypatch.setattr(triton_ops, "add_rms_norm_router",
                        lambda *a, **k: calls.append(a[0].shape[0]) or fused(*a, **k))
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want, _ = _generate(tiny_random_qwen3_moe, PROMPTS[1:2], greedy, kernel_backend="torch")
    got, _ = _generate(tiny_random_qwen3_moe, PROMPTS[1:2], greedy, kernel_backend="triton")
    assert calls and set(calls) == {1}  # the decode steps' sparse layers, never the prefill
    assert got[0].token_ids == want[0].token_ids
    assert got[0].token_logprobs == pytest.approx(want[0].token_logprobs, abs=1e-4)


def test_pdl_is_off_without_cuda_and_when_disabled(monkeypatch):
    """Programmatic dependent launch is a CUDA (Hopper+) launch option: CPU tensors (the interpreter)
    get the kernels' PDL constexpr off and no `launch_pdl`, whatever ENABLED says."""
    from rollout.engine import triton_pdl

    assert triton_pdl.launch(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setattr(triton_pdl, "ENABLED", False)
    assert triton_pdl.launch(torch.zeros(1, device=DEVICE)) == {"PDL": False}


def test_every_pdl_kernel_waits_before_it_writes():
    """triton_pdl's rule, the part a reading of the source can check: a kernel launched with PDL
    calls `pdl_start(PDL)` once, before any store (it may read before it, only what the kernel
    launched before it does not write). Covers every Triton kernel of the engine with a PDL flag."""
    import inspect

    import triton

    from rollout.engine import triton_attention, triton_gemv, triton_moe_route, triton_pdl

    kernels = {f"{m.__name__}.{name}": k
               for m in (triton_ops, triton_attention, triton_moe, triton_moe_route, triton_gemv)
               for name, k in vars(m).items()
               if isinstance(k, triton.runtime.jit.KernelInterface) and "PDL" in getattr(k, "arg_names", ())
               and k.fn is not triton_pdl.start.fn}
    assert len(kernels) >= 11, sorted(kernels)  # norms, RoPE, attention + merge, silu, MoE route/align/4 GEMMs, gemv
    for name, kernel in kernels.items():
        source = inspect.getsource(kernel.fn)
        assert source.count("pdl_start(PDL)") == 1, name
        assert "tl.store(" not in source.split("pdl_start(PDL)")[0], name
