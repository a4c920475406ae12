"""The Triton paged-attention kernel (rollout/engine/triton_attention.py) against the torch
reference path of rollout/engine/attention.py, on CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 when there is no GPU; on a GPU the same tests run the compiled kernel).

Shapes cover what the engine sends: decode rows whose keys are split over several programs and
merged, verify blocks mixed with decode rows, prefill chunks wider than one query tile, GQA
group sizes 1, 2 and 4, block sizes that do and do not divide the key chunk, and a scrambled
block table. Then the engine end to end: the same greedy tokens and log-probs with either
backend, with and without a drafter, and through the static-buffer graph path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_spec_engine import PROMPTS, _generate

from rollout.engine import triton_attention
from rollout.engine.attention import AttentionMetadata, paged_attention, write_kv
from rollout.engine.params import SamplingParams
from rollout.engine.triton_attention import paged_attention_triton, plan_grid, supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not supported(16, torch.float32, DEVICE),
                                reason="triton missing: it ships with xgrammar, a dependency")


def _ragged_case(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, seed=0):
    """Random q/k/v and a cache whose blocks are handed out in a scrambled order."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    width = max(-(-c // block_size) for c in ctx_lens) + 2
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int64)
    positions, slots, used = [], [], 0
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        n = -(-ctx // block_size)
        tables[s, :n] = order[used:used + n]
        used += n
        for p in range(ctx - q_len, ctx):
            positions.append(p)
            slots.append(int(tables[s, p // block_size]) * block_size + p % block_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    meta = AttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), cu_seqlens_q=cu,
                             context_lens=torch.tensor(ctx_lens), block_tables=tables, max_query_len=max(q_lens),
                             max_context_len=max(ctx_lens), block_size=block_size)
    t = sum(q_lens)
    q = torch.randn(t, heads, head_dim, generator=gen)
    k, v = torch.randn(t, kv_heads, head_dim, generator=gen), torch.randn(t, kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata(**{f: (getattr(meta, f).to(DEVICE) if torch.is_tensor(getattr(meta, f))
                                    else getattr(meta, f)) for f in META_FIELDS})
    return tuple(x.to(DEVICE) for x in (q, k, v, k_cache, v_cache)) + (meta,)


META_FIELDS = ("positions", "slot_mapping", "cu_seqlens_q", "context_lens", "block_tables", "max_query_len",
               "max_context_len", "block_size")


CASES = {
    # name: (q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    "one decode row, keys split": ([1], [300], 4, 2, 16, 4),
    "decode batch, ragged contexts": ([1, 1, 1, 1], [1, 64, 65, 200], 8, 2, 32, 16),
    "verify blocks and decode mixed": ([9, 1, 5, 9], [9, 130, 70, 40], 4, 2, 16, 4),
    "prefill wider than a tile": ([70, 3], [70, 90], 4, 1, 16, 8),
    "chunked prefill after cached keys": ([40], [230], 2, 2, 16, 16),
    "no grouping": ([2, 7], [50, 7], 2, 2, 32, 4),
}


@pytest.mark.parametrize("index32", [True, False], ids=["int32 offsets", "int64 offsets"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_the_torch_reference(name, index32, monkeypatch):
    """Key rows' offsets in int32 (triton_attention.INDEX32, the default where the caches fit) and in
    int64 (larger caches)."""
    monkeypatch.setattr(triton_attention, "INDEX32", index32)
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES[name]
    q, k, v, k_cache, v_cache, meta = _ragged_case(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    want = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    got = paged_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                                 meta.max_query_len, meta.max_context_len, scale)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("longer", [40, 300])  # the other sequence's keys: one program, split and merged
def test_queries_that_see_no_key_give_zero_like_the_torch_path(longer):
    """A query whose position precedes every key gets 0, as in the torch path, not 0/0 = NaN: a
    padded row of a CUDA-graph verify step (context 1, q queries) is such a row, and its NaN,
    written to the scratch blocks, reached the drafter's context on the H200 (test_graphs.py)."""
    q, k, v, k_cache, v_cache, meta = _ragged_case([4, 4], [4, longer], 4, 2, 16, 4)
    meta = dataclasses.replace(meta, context_lens=torch.tensor([1, longer], device=DEVICE))
    assert (plan_grid(2, 2, 2, 4, longer)[2] > 1) == (longer > 64)
    want = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    got = paged_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                                 meta.max_query_len, meta.max_context_len, 0.25)
    assert bool(torch.isfinite(got).all())
    assert not got[:3].any() and got[3].abs().sum() > 0  # queries 0-2 of the first sequence see nothing
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_the_cases_reach_every_kernel_path():
    """Guards the case table above: some case splits the keys (merge kernel), some tiles queries."""
    plans = [plan_grid(len(c[1]), c[3], c[2] // c[3], max(c[0]), max(c[1])) for c in CASES.values()]
    assert any(splits > 1 for _, _, splits, _ in plans)
    assert any(tiles > 1 for _, tiles, _, _ in plans)
    for _, tiles, splits, keys_per_split in plans:
        assert tiles == 1 or splits == 1
        assert keys_per_split % 64 == 0


def test_a_wrong_key_breaks_the_comparison():
    """Negative control: the comparison sees a single corrupted cache entry a query attends to."""
    q, k, v, k_cache, v_cache, meta = _ragged_case([1], [300], 4, 2, 16, 4)
    want = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    block = int(meta.block_tables[0, 37])
    v_cache[block, 1] += 100.0  # key 149 of the only sequence
    got = paged_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                                 meta.max_query_len, meta.max_context_len, 0.25)
    assert not torch.allclose(got, want, atol=1e-3)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU engine through the interpreter (bfloat16 on CUDA)")
@pytest.mark.parametrize("spec", ["none", "dflash"])
def test_engine_tokens_and_logprobs_do_not_depend_on_the_backend(tiny_random_qwen3, random_drafters, spec):
    draft = random_drafters.get(spec)
    outs = {}
    for backend in ("torch", "triton"):
        got, eng = _generate(tiny_random_qwen3, PROMPTS[:3], GREEDY, spec=spec, draft=draft, block=4,
                             kernel_backend=backend)
        assert eng.kernel_backend == backend
        outs[backend] = got
    for ref, tri in zip(outs["torch"], outs["triton"], strict=True):
        assert tri.token_ids == ref.token_ids
        assert tri.token_logprobs == pytest.approx(ref.token_logprobs, abs=1e-4)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU engine through the interpreter (bfloat16 on CUDA)")
def test_graph_static_buffers_with_the_kernel(tiny_random_qwen3):
    """The CUDA-graph path's padded rows (scratch block, context 1) through the kernel, eagerly on CPU."""
    plain, _ = _generate(tiny_random_qwen3, PROMPTS[:3], GREEDY, kernel_backend="triton")
    _, eng = _generate(tiny_random_qwen3, [[1]], SamplingParams(max_tokens=1), kernel_backend="triton")
    eng.graphs = eng.make_step_graphs(capture=False)
    eng.add_request("g", PROMPTS[:3], GREEDY)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    outs.sort(key=lambda o: o.prompt_index)
    assert eng.graphs.num_replays > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


# -- fused layer ops (rollout/engine/triton_ops.py) against the torch layer ----------------------


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("heads", [(6, 2), (18, 6)])  # (18, 6): 30 heads, over two programs of 16
def test_qk_norm_rope_store_equals_the_torch_layer(qk_norm, heads):
    from rollout.engine.model import Attention, ModelConfig, RotaryEmbedding
    from rollout.engine.triton_ops import qk_norm_rope_store

    num_heads, kv_heads = heads
    cfg = ModelConfig(model_type="qwen3" if qk_norm else "llama", vocab_size=64, hidden_size=48,
                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=num_heads,
                      num_key_value_heads=kv_heads,
                      head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=256, tie_word_embeddings=False, attention_bias=not qk_norm)
    torch.manual_seed(0)
    attn = Attention(cfg, RotaryEmbedding(16, 256, 10000.0)).to(DEVICE)
    with torch.no_grad():
        for p in attn.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 and p.shape[0] == 16 else p.normal_()
    hidden = torch.randn(5, 48, device=DEVICE)
    positions = torch.tensor([0, 7, 8, 100, 255], device=DEVICE)
    slots = torch.tensor([3, 17, 9, 30, 0], device=DEVICE)
    caches = [torch.zeros(8, 4, kv_heads, 16, device=DEVICE) for _ in range(4)]
    q_ref, k_ref, v_ref = attn.project_qkv(hidden, positions)
    write_kv(k_ref, v_ref, caches[0], caches[1], slots)
    with torch.no_grad():
        q = qk_norm_rope_store(attn.qkv_proj(hidden), positions, attn.rotary.table(DEVICE, torch.float32),
                               attn.q_norm.weight if qk_norm else None, attn.k_norm.weight if qk_norm else None,
                               1e-6, num_heads, kv_heads, 16, caches[2], caches[3], slots)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[2], caches[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0)  # v is copied as is


def test_add_rms_norm_and_silu_mul_equal_torch():
    import torch.nn.functional as F

    from rollout.engine.triton_ops import add_rms_norm, silu_mul

    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(3, 40, generator=gen).to(DEVICE), torch.randn(3, 40, generator=gen).to(DEVICE)
    weight = torch.rand(40, generator=gen).to(DEVICE) + 0.5
    normed, total = add_rms_norm(x, res, weight, 1e-6)
    torch.testing.assert_close(total, x + res)
    torch.testing.assert_close(normed, F.rms_norm(x + res, (40,), weight, 1e-6), atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(3, 2 * 1100, generator=gen).to(DEVICE)  # two column blocks of 1024
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_fused_forward_equals_the_torch_forward_with_hidden_taps(tiny_random_qwen3):
    """The whole model: fused residual/norm chain, hidden-state taps for drafters, final norm."""
    from rollout.engine.kv import allocate_kv
    from rollout.engine.loader import load_model

    loaded = load_model(tiny_random_qwen3, DEVICE, dtype=torch.float32)  # float32 on CUDA too
    model = loaded.model
    out = {}
    for backend in ("torch", "triton"):
        model.set_kernel_backend(backend)
        q, k, v, _, _, meta = _ragged_case([3, 1, 6], [3, 9, 6], 4, 2, 16, 4)
        caches = allocate_kv(loaded.config, meta.block_tables.max().item() + 1, 4, DEVICE, torch.float32)
        ids = torch.arange(10, device=DEVICE) * 7 % 250
        with torch.no_grad():
            out[backend] = model(ids, meta, caches, (0, 1))
    torch.testing.assert_close(out["triton"][0], out["torch"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], atol=1e-4, rtol=1e-4)
