"""Shared-prefix attention as two Triton kernels (the plan: prefix_plan.py; the passes and their
torch reference: prefix_attention.py).

`_item_kernel` runs the plan's work items, each once per KV head: its query rows are (token,
query head) pairs of that KV head for the tokens of one unit (for a shared unit, all the
sequences of a group: a shared key tile is loaded once for all of them and used by one tl.dot of
[64 rows, D] x [D, BLOCK_N]); it walks the key range [key_lo, key_hi) of one block-table row in
tiles of BLOCK_N with an online softmax in float32, masking keys after each query's position
(only suffix ranges reach a query's own position: shared ranges end before every query of their
group). It writes the normalised output and the log-sum-exp to the token's partial row, or, when
the item is the token's only one, the output itself. The programs (a fixed number per SM) take
(item, KV head) pairs from a work queue, an atomic counter, heavy shared items first, until the
queue is empty: the item count is read on the device, so a CUDA graph replays any plan that fits
its buffers, and no program waits on a long item while others idle. `_merge_kernel` combines
each token's partial rows (all its heads in one program) by their log-sum-exp, and resets the
counter for the next layer.

Index arithmetic is 64-bit: item fields, tokens and block ids are loaded from int64 tensors, so
block id x block stride and token x row stride are int64 products. The index tensors are views
into the step's packed upload, so their addresses are not specialised on alignment (that would
compile a variant per offset parity), nor is the block table's width.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from rollout.engine.prefix_attention import SharedPrefixPlan
from rollout.engine.prefix_plan import ITEM_FIELDS, KEY_ALIGN, SHARED_BLOCK_M

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with xgrammar, a dependency
    triton = None

BLOCK_N = KEY_ALIGN  # keys per inner iteration
PROGRAMS_PER_SM = 8  # item-kernel programs launched per SM (more than fit at once: the queue balances)

if triton is not None:

    @triton.jit
    def _attend_item(
        item_ptr, kv_head, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        unit_tokens_ptr, part_start_ptr, positions_ptr, block_tables_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        tok_start = tl.load(item_ptr)  # the fields of prefix_plan.ITEM_FIELDS, int64
        tok_count = tl.load(item_ptr + 1)
        rows = tl.load(item_ptr + 2) + tl.arange(0, BLOCK_M)  # [M]: row = token * GROUPS + group head
        key_lo = tl.load(item_ptr + 4)
        key_hi = tl.load(item_ptr + 5)
        slot = tl.load(item_ptr + 6)
        indirect = (tl.load(item_ptr + 7) + tl.zeros([BLOCK_M], tl.int64)) != 0  # [M]: the interpreter masks by vectors
        local = rows // GROUPS
        row_ok = local < tok_count
        token = tl.load(unit_tokens_ptr + tok_start + local, mask=row_ok & indirect, other=0)
        token = tl.where(indirect, token, tok_start + local)  # [M] int64
        head = kv_head * GROUPS + rows % GROUPS
        q_pos = tl.load(positions_ptr + token, mask=row_ok, other=0)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        table = block_tables_ptr + tl.load(item_ptr + 3) * stride_bt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for n0 in range(key_lo, key_hi, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)  # [N]
            key_ok = keys < key_hi
            block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)  # [N] int64
            offset = block[:, None] * stride_kb + (keys % BLOCK_SIZE)[:, None] * stride_ks + dims[None, :]
            k = tl.load(k_ptr + offset + kv_head * stride_kh, mask=key_ok[:, None], other=0.0)  # [N, D]
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale  # [M, N]
            scores = tl.where(key_ok[None, :] & (keys[None, :] <= q_pos[:, None]), scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at 0
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(scores - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_offset = block[:, None] * stride_vb + (keys % BLOCK_SIZE)[:, None] * stride_vs + dims[None, :]
            v = tl.load(v_ptr + v_offset + kv_head * stride_vh, mask=key_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]  # a row that saw no key: 0, lse -inf
        if slot < 0:
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            base = (tl.load(part_start_ptr + token, mask=row_ok, other=0) + slot) * NUM_HEADS + head  # [M]
            tl.store(part_o_ptr + base[:, None] * HEAD_DIM + dims[None, :], o.to(part_o_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
            tl.store(part_lse_ptr + base, tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf")), mask=row_ok)

    @triton.jit(do_not_specialize=["stride_bt"],
                do_not_specialize_on_alignment=["items_ptr", "item_counts_ptr", "unit_tokens_ptr", "part_start_ptr",
                                                "positions_ptr", "block_tables_ptr"])
    def _item_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
        items_ptr, item_counts_ptr, unit_tokens_ptr, part_start_ptr, positions_ptr, block_tables_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SHARED_BLOCK_M: tl.constexpr, SUFFIX_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_FIELDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        num_shared = tl.load(item_counts_ptr)
        total = tl.load(item_counts_ptr + 1) * NUM_KV_HEADS
        work = tl.atomic_add(counter_ptr, 1)  # a work queue: (item, KV head) pairs, shared units' first
        while work < total:
            item = work // NUM_KV_HEADS
            item_ptr = items_ptr + item * NUM_FIELDS
            if item < num_shared:
                _attend_item(
                    item_ptr, work % NUM_KV_HEADS, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                    unit_tokens_ptr, part_start_ptr, positions_ptr, block_tables_ptr, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    NUM_HEADS, GROUPS, HEAD_DIM, BLOCK_SIZE, SHARED_BLOCK_M, BLOCK_N, DOT_PRECISION)
            else:
                _attend_item(
                    item_ptr, work % NUM_KV_HEADS, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                    unit_tokens_ptr, part_start_ptr, positions_ptr, block_tables_ptr, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    NUM_HEADS, GROUPS, HEAD_DIM, BLOCK_SIZE, SUFFIX_BLOCK_M, BLOCK_N, DOT_PRECISION)
            work = tl.atomic_add(counter_ptr, 1)

    @triton.jit(do_not_specialize_on_alignment=["part_start_ptr", "part_count_ptr"])
    def _merge_kernel(
        out_ptr, part_o_ptr, part_lse_ptr, part_start_ptr, part_count_ptr, counter_ptr, stride_ot, stride_oh,
        NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        if token == 0:  # the item kernel has finished with its work queue: ready for the next layer
            tl.store(counter_ptr, 0)
        count = tl.load(part_count_ptr + token)
        if count != 1:  # 1: written by its item; 0 (a graph's padded row): 0
            head = tl.arange(0, HEADS_P2)  # [H]
            head_ok = head < NUM_HEADS
            dims = tl.arange(0, HEAD_DIM)
            start = tl.load(part_start_ptr + token)
            m = tl.full([HEADS_P2], float("-inf"), tl.float32)
            l_sum = tl.zeros([HEADS_P2], tl.float32)
            acc = tl.zeros([HEADS_P2, HEAD_DIM], tl.float32)
            for p in range(0, count):
                base = (start + p) * NUM_HEADS + head  # [H]
                lse = tl.load(part_lse_ptr + base, mask=head_ok, other=float("-inf"))
                o = tl.load(part_o_ptr + base[:, None] * HEAD_DIM + dims[None, :], mask=head_ok[:, None], other=0.0)
                m_new = tl.maximum(m, lse)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # partials that saw no key weigh 0
                alpha = tl.exp(m - m_ref)
                weight = tl.exp(lse - m_ref)
                l_sum = l_sum * alpha + weight
                acc = acc * alpha[:, None] + weight[:, None] * o.to(tl.float32)
                m = m_new
            out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
            tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def shared_prefix_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                   positions: Tensor, plan: SharedPrefixPlan, scale: float) -> Tensor:
    """q: [T, Hq, D]; caches: [NB, BS, Hkv, D] (this step's keys already written); block_tables:
    [S, W]; positions: [T]. Returns [T, Hq, D] in q's dtype (prefix_attention's two passes)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("shared_prefix_attention_triton needs the head dimension contiguous")
    out = torch.empty_like(q)
    part_o, part_lse, counter = plan.buffers(q)
    programs = max(1, min(plan.max_items * num_kv_heads, _resident_programs(q.device)))
    _item_kernel[(programs,)](
        q, k_cache, v_cache, out, part_o, part_lse, counter,
        plan.items, plan.item_counts, plan.unit_tokens, plan.part_start, positions, block_tables, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, NUM_HEADS=num_heads, GROUPS=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, SHARED_BLOCK_M=SHARED_BLOCK_M, SUFFIX_BLOCK_M=plan.suffix_block_m, BLOCK_N=BLOCK_N,
        NUM_FIELDS=len(ITEM_FIELDS), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    heads_p2 = triton.next_power_of_2(num_heads)
    _merge_kernel[(num_tokens,)](
        out, part_o, part_lse, plan.part_start, plan.part_count, counter, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEADS_P2=heads_p2, HEAD_DIM=head_dim, num_warps=4 if heads_p2 * head_dim <= 8192 else 8,
    )
    return out


@functools.cache
def _resident_programs(device: torch.device) -> int:
    """Programs of the item kernel: enough to keep every SM busy (they take work from a queue
    until it is empty). The interpreter runs programs one after another: the first takes all."""
    if device.type != "cuda":
        return 2
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def compiled_variants() -> int:
    """Variants of this module's kernels compiled so far (see triton_ops.compiled_variants)."""
    if triton is None:
        return 0
    kernels = (_item_kernel, _merge_kernel)
    return sum(len(cache[0]) for k in kernels for cache in getattr(k, "device_caches", {}).values())


__all__ = ["compiled_variants", "shared_prefix_attention_triton"]
