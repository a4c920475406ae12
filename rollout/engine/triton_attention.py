"""Paged attention as one Triton kernel: every query reads its keys straight from the block pool.

The torch path (`attention.paged_attention`'s default) gathers each sequence's keys into a dense
`[S, L, Hkv, D]` copy per layer and pads ragged queries; this kernel does neither. One program
owns (sequence, KV head, query tile, key split): its rows are the (query token, group head) pairs
of that KV head, so GQA shares every key load across the G query heads; it walks the sequence's
block table in chunks of BLOCK_N keys with an online softmax in float32 (base 2: the tile is
triton_prefix_tiles' `_key_tile`, which the shared-prefix kernels use too). Causality is by
position: query j of a sequence with q_len queries and context_len keys sits at position
context_len - q_len + j and sees keys 0..position, exactly like the torch path's mask; a query
that sees no key (position < 0) gets 0, as the torch path's SDPA gives.

Triton compiles a variant per constexpr combination and per integer argument that equals 1 or
is divisible by 16. The token count and the block table's width change with every batch, so
those two are not specialised. Otherwise a serving engine kept meeting new variants, each
compiled inside a step, which stalls it (BENCHMARKS.md, issue 5).

Decode and verify steps have few query rows per sequence, so at small batch a (sequence, head)
grid leaves most of the GPU idle; the key range is then split over several programs whose
partial (max, sum, accumulator) are merged by a second small kernel (flash-decoding).

The same kernels run on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 is set
before triton is imported (the test suite does, and compares them with the torch path); the
engine uses them on CUDA (`EngineConfig.kernel_backend`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from rollout.engine import triton_pdl
from rollout.engine.triton_prefix_tiles import LOG2E, index32_fits

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with xgrammar, a dependency
    triton = None

TARGET_PROGRAMS = 512  # split the keys until the grid has about this many programs
# Even short contexts are split: alone, with the cache in L2, a 192-key decode row took 6.1 us in one
# program against 7.5 split in two and merged (H200), yet the engine at batch 1 decoded 1.2% (8B) and
# 2.3% (30B-A3B) slower with contexts of up to 4 key tiles unsplit (BENCHMARKS.md, eighth session).
BLOCK_N = 64  # keys per inner iteration
INDEX32 = True  # key rows' offsets in int32 where every element of the caches lies within 2**31 of their start
# (index32_fits; else int64), as the shared-prefix kernels' (BENCHMARKS.md, twenty-second session)
MAX_BLOCK_M = 64  # query rows (token x group head) per program


def supported(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel runs here: on CUDA, or on CPU under Triton's interpreter
    (TRITON_INTERPRET=1 before triton is imported, as the test suite does); a head size that
    tl.dot takes (a power of two >= 16); a floating dtype."""
    runs_here = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return (triton is not None and runs_here and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and dtype in (torch.float16, torch.bfloat16, torch.float32))


if triton is not None:
    from rollout.engine.triton_pdl import start as pdl_start
    from rollout.engine.triton_prefix_tiles import _key_tile, _rows_start

    @triton.jit(do_not_specialize=["num_tokens", "stride_bt"])
    def _attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,
        qk_scale, keys_per_split, num_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr, INDEX32: tl.constexpr,
    ):
        # 64-bit offsets: a row or block index times its stride can pass 2**31 in a large step / pool (key
        # rows' offsets are int32 where the caches fit: INDEX32)
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)  # the step's metadata: read before the PDL
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start  # wait (the previous kernel, which writes q
        ctx = tl.load(context_lens_ptr + seq)  # and the new keys, does not write it)
        pdl_start(PDL)
        if tile * BLOCK_M < q_len * GROUPS:
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]: row = token * GROUPS + group
            tok = rows // GROUPS
            head = kv_head * GROUPS + rows % GROUPS
            row_ok = tok < q_len
            q_pos = ctx - q_len + tok  # [M]
            dims = tl.arange(0, HEAD_DIM)
            q, m_i, l_i, acc = _rows_start(q_ptr, q_start + tok, head, row_ok, stride_qt, stride_qh, HEAD_DIM, BLOCK_M)
            # keys this program reads: its split of [0, ctx), cut at the tile's last query position
            last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, q_len * GROUPS) - 1
            last = ctx - q_len + last_row // GROUPS + 1
            lo = split * keys_per_split
            hi = tl.minimum(lo + keys_per_split, last)
            for n0 in range(lo, hi, BLOCK_N):
                keys = n0 + tl.arange(0, BLOCK_N)  # [N]
                key_ok = keys < hi
                block = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok,
                                other=0).to(tl.int64)
                seen = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
                m_i, l_i, acc = _key_tile(q, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, block, keys,
                                          key_ok, seen, m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_vb,
                                          stride_vs, HEAD_DIM, BLOCK_SIZE, DOT_PRECISION, True, INDEX32)
            token = q_start + tok
            if NUM_SPLITS == 1:  # a row that saw no key has acc = 0, l = 0: it gives 0 (torch's SDPA too)
                out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
                tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            else:  # partials [splits, T, Hq, D] and [splits, T, Hq, 2] (max in log2 units, sum): _merge_kernel
                base = (split * num_tokens + token) * NUM_HEADS + head  # [M]
                tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
                tl.store(part_ml_ptr + base * 2, m_i, mask=row_ok)
                tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=row_ok)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _merge_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr, num_tokens, stride_ot, stride_oh,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, NUM_SPLITS)
        base = (splits * num_tokens + token) * NUM_HEADS + head  # [P]
        m = tl.load(part_ml_ptr + base * 2)
        l_split = tl.load(part_ml_ptr + base * 2 + 1)
        m_max = tl.max(m, 0)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # splits that saw no key weigh 0
        dims = tl.arange(0, HEAD_DIM)
        acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + dims[None, :])  # [P, D]
        total = tl.sum(l_split * weight, 0)
        out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # no key anywhere: 0
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def plan_grid(num_seqs: int, num_kv_heads: int, groups: int, max_query_len: int, max_context_len: int,
              ) -> tuple[int, int, int, int]:
    """(BLOCK_M, query tiles, key splits, keys per split) for one step's shape (host ints only,
    so a CUDA graph captured for a shape replays the same launch)."""
    rows = max_query_len * groups
    block_m = max(16, min(MAX_BLOCK_M, triton.next_power_of_2(rows)))
    tiles = -(-rows // block_m)
    chunks = -(-max_context_len // BLOCK_N)
    splits = 1
    if tiles == 1:
        splits = max(1, min(chunks, TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads), 32))
        splits = 1 << (splits.bit_length() - 1)  # a power of two: the merge kernel's arange
    keys_per_split = -(-chunks // splits) * BLOCK_N
    splits = -(-max_context_len // keys_per_split)
    splits = 1 << (splits - 1).bit_length() if splits > 1 else 1
    return block_m, tiles, splits, keys_per_split


def paged_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, cu_seqlens_q: Tensor, max_query_len: int,
                           max_context_len: int, scale: float) -> Tensor:
    """q: [T, Hq, D]; caches: [NB, BS, Hkv, D] (this step's keys already written); block_tables:
    [S, max_blocks]; context_lens, cu_seqlens_q: [S], [S+1]. Returns [T, Hq, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    groups = num_heads // num_kv_heads
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_attention_triton needs the head dimension contiguous")
    block_m, tiles, splits, keys_per_split = plan_grid(num_seqs, num_kv_heads, groups, max_query_len,
                                                      max_context_len)
    out = torch.empty_like(q)
    if splits > 1:
        part_acc = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _attn_kernel[(num_seqs, num_kv_heads, tiles * splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, context_lens, cu_seqlens_q,
        scale * LOG2E, keys_per_split, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUPS=groups, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays float32
        INDEX32=INDEX32 and index32_fits(k_cache, v_cache), **triton_pdl.launch(q),
    )
    if splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, num_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits, **triton_pdl.launch(q),
        )
    return out


__all__ = ["paged_attention_triton", "plan_grid", "supported"]
