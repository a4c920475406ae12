"""The online-softmax pieces the attention kernels are built from (triton_attention.py: the plain
paged kernel; triton_prefix_attention.py: the shared-prefix item kernel; triton_prefix_lone.py:
decode's all-heads lone pass): a tile of query rows with an empty online softmax, one tile of keys
into its running (max, sum, accumulator), and the store of those rows, to the output or to their
token's partial row; and the merge of a token's partial rows by their log-sum-exp. Scores are in
base 2: callers pass the softmax scale times LOG2E."""

from __future__ import annotations

import functools

LOG2E = 1.4426950408889634
LAZY_SLACK = 8.0  # log2 units a row's scores may pass its reference max by before a lazy softmax rescales


def index32_fits(*caches) -> bool:
    """Whether every element of each cache lies within 2**31 elements of its first (the kernels'
    INDEX32: a key row's offset in int32). Asked every layer of every step: kept per layout."""
    return all(_span_fits(tuple(cache.shape), cache.stride()) for cache in caches)


@functools.cache
def _span_fits(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) < 2**31

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with xgrammar, a dependency
    triton = None

if triton is not None:
    _LAZY_SLACK = tl.constexpr(LAZY_SLACK)

    @triton.jit
    def _rows_start(q_ptr, token, head, row_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        """The queries of M rows (token int64 [M], head [M]) as [M, D], and an empty online softmax:
        (m, l) [M] and acc [M, D]."""
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        return (q, tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
                tl.zeros([BLOCK_M, HEAD_DIM], tl.float32))

    @triton.jit
    def _key_tile(q, k_base, v_base, block, pos, key_ok, seen, m_i, l_i, acc, qk_scale,
                  stride_kb, stride_ks, stride_vb, stride_vs,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  MASKED: tl.constexpr = True, INDEX32: tl.constexpr = False):
        """One tile of keys (block [N] int64 and pos [N] of each) into the online softmax of the
        rows of q [M, D]: (m, l) in log2 units, acc [M, D] float32. INDEX32: the rows' offsets in
        int32 (every element of the caches lies within 2**31 of their start: index32_fits)."""
        if INDEX32:
            block = block.to(tl.int32)
        slot = pos % BLOCK_SIZE
        return _row_tile(q, k_base + (block * stride_kb + slot * stride_ks),
                         v_base + (block * stride_vb + slot * stride_vs), key_ok, seen, m_i, l_i, acc,
                         qk_scale, HEAD_DIM, DOT_PRECISION, MASKED)

    @triton.jit
    def _row_tile(q, k_row, v_row, key_ok, seen, m_i, l_i, acc, qk_scale,
                  HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr = True,
                  LAZY: tl.constexpr = False):
        """One tile of key rows (k_row / v_row [N]: each row's first element) into the online
        softmax of the rows of q [M, D], a key row counting for the rows `seen` [M, N] gives it
        (MASKED False: every row sees every key row, all valid; key_ok and seen are not read).
        LAZY: the rows' reference max moves only as _raise_max's LAZY says."""
        scores = _tile_scores(q, k_row, key_ok, HEAD_DIM, DOT_PRECISION, MASKED)  # [M, N], unscaled
        if MASKED:
            scores = tl.where(seen, scores, float("-inf"))
        m_i, l_i, acc = _raise_max(m_i, tl.max(scores, 1) * qk_scale, l_i, acc, LAZY)
        m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)  # rows with no key yet stay at 0
        p = tl.exp2(tl.fma(scores, qk_scale, -m_ref[:, None]))  # the scale in one multiply-add with the max
        return m_i, l_i + tl.sum(p, 1), _add_values(acc, p, v_row, key_ok, HEAD_DIM, DOT_PRECISION, MASKED)

    @triton.jit
    def _heads_tile(q, k_ptr, v_ptr, table, key_lo, vk, hi, kv_head, mine, q_pos, m_i, l_i, acc, qk_scale,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    LAZY: tl.constexpr = False, INDEX32: tl.constexpr = False):
        """One tile of key rows holding several KV heads of each key (row i: virtual key vk[i] of
        KV head kv_head[i], read through the block-table row `table` at position key_lo + vk[i];
        virtual keys at `hi` and past it are not read) into the online softmax of q's rows, a row
        seeing the key rows `mine` [M, N] gives it, up to its query's position q_pos."""
        key_ok = vk < hi
        pos = key_lo + vk
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0)  # [N] int64
        slot = pos % BLOCK_SIZE
        if INDEX32:  # (as _key_tile's)
            block = block.to(tl.int32)
        k_row = k_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)
        v_row = v_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)
        return _row_tile(q, k_row, v_row, key_ok, mine & (key_ok & (pos <= q_pos))[None, :], m_i, l_i, acc, qk_scale,
                         HEAD_DIM, DOT_PRECISION, True, LAZY)

    @triton.jit
    def _tile_scores(q, k_row, key_ok, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
        """The unscaled scores [M, N] of q [M, D] against a tile's key rows (k_row [N]; MASKED: the
        rows where key_ok is False read as 0)."""
        dims = tl.arange(0, HEAD_DIM)
        if MASKED:
            k = tl.load(k_row[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)  # [N, D]
        else:
            k = tl.load(k_row[:, None] + dims[None, :])
        return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32)

    @triton.jit
    def _add_values(acc, p, v_row, key_ok, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    MASKED: tl.constexpr):
        """acc [M, D] plus the probabilities p [M, N] times the tile's value rows (v_row [N]; MASKED:
        the rows where key_ok is False read as 0)."""
        dims = tl.arange(0, HEAD_DIM)
        if MASKED:
            v = tl.load(v_row[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)  # [N, D]
        else:
            v = tl.load(v_row[:, None] + dims[None, :])
        return acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)

    @triton.jit
    def _raise_max(m_i, m_tile, l_i, acc, LAZY: tl.constexpr):
        """A running softmax's reference max m_i [M] (base 2) raised to take in a tile whose rows'
        scaled maxima are m_tile [M], and what was summed against it (l_i [M], acc [M, D]) rescaled
        to the new one. The tile's probabilities are then taken against the reference: each at
        most 1. LAZY: at most 2**LAZY_SLACK, for the reference moves only when some row's tile max
        passes it by more than LAZY_SLACK, every row's at once: one branch a tile, and a tile that
        does not take it leaves acc as it is. Either way acc / l is the same softmax: both are sums
        against the same reference."""
        if LAZY:
            if tl.max((m_tile > m_i + _LAZY_SLACK).to(tl.int32), 0) > 0:
                m_i, l_i, acc = _rescale(m_i, tl.maximum(m_i, m_tile), l_i, acc)
        else:
            m_i, l_i, acc = _rescale(m_i, tl.maximum(m_i, m_tile), l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _rescale(m_i, m_new, l_i, acc):
        """l_i and acc, summed against the reference m_i, rescaled to m_new (-inf: no key yet)."""
        alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))  # [M]; 0 where m_i is -inf
        return m_new, l_i * alpha, acc * alpha[:, None]

    @triton.jit
    def _rows_result(m_i, l_i, acc):
        """The rows' normalised output [M, D] and log-sum-exp [M] (natural log); a row that saw no
        key: 0 and -inf."""
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        return acc / l_safe[:, None], lse

    @triton.jit
    def _store_rows(item_ptr, token, head, row_ok, m_i, l_i, acc, out_ptr, part_o_ptr, part_lse_ptr, part_start_ptr,
                    part_count_ptr, stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
        """The normalised rows to the output where their token has one partial result, else with
        their log-sum-exp (natural log) to the token's partial row of the item's slot."""
        dims = tl.arange(0, HEAD_DIM)
        o, lse = _rows_result(m_i, l_i, acc)
        count = tl.load(part_count_ptr + token, mask=row_ok, other=0)
        direct = row_ok & (count == 1)
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=direct[:, None])
        part = row_ok & (count != 1)
        base = (tl.load(part_start_ptr + token, mask=row_ok, other=0) + tl.load(item_ptr + 11)) * NUM_HEADS + head
        tl.store(part_o_ptr + base[:, None] * HEAD_DIM + dims[None, :], o.to(part_o_ptr.dtype.element_ty),
                 mask=part[:, None])
        tl.store(part_lse_ptr + base, lse, mask=part)

    @triton.jit
    def _merge_in(m, l_sum, acc, lse, o):
        """One partial result (lse [H], natural log; o [H, D] normalised, float32) into a running
        merge: max m, sum of weights l_sum [H], weighted sum acc [H, D]."""
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # partials that saw no key weigh 0
        alpha = tl.exp(m - m_ref)
        weight = tl.exp(lse - m_ref)
        return m_new, l_sum * alpha + weight, acc * alpha[:, None] + weight[:, None] * o

    @triton.jit
    def _merge_partials(part_o_ptr, part_lse_ptr, start, count, skip, head, head_ok, m, l_sum, acc,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE: tl.constexpr):
        """A token's partial rows start .. start + count, but for row start + skip, into a running
        merge (heads `head` [H] of them)."""
        dims = tl.arange(0, HEAD_DIM)
        for p in range(0, count):
            base = (start + p) * NUM_HEADS + head  # [H]
            ok = head_ok & (head * 0 + p != skip)  # [H] (the interpreter masks by vectors)
            lse = tl.load(part_lse_ptr + base, mask=ok, other=float("-inf"), cache_modifier=CACHE)
            o = tl.load(part_o_ptr + base[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0,
                        cache_modifier=CACHE)
            m, l_sum, acc = _merge_in(m, l_sum, acc, lse, o.to(tl.float32))
        return m, l_sum, acc

    @triton.jit
    def _store_merged(part_o_ptr, part_lse_ptr, start, count, token, head, head_ok, out_ptr, stride_ot, stride_oh,
                      NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                      CACHE: tl.constexpr):
        """A token's partial rows start .. start + count merged into its output rows (0 for none)."""
        _, l_sum, acc = _merge_partials(part_o_ptr, part_lse_ptr, start, count, -1, head, head_ok,
                                        tl.full([HEADS_P2], float("-inf"), tl.float32),
                                        tl.zeros([HEADS_P2], tl.float32), tl.zeros([HEADS_P2, HEAD_DIM], tl.float32),
                                        NUM_HEADS, HEAD_DIM, CACHE)
        _store_out(out_ptr, token, head, head_ok, l_sum, acc, stride_ot, stride_oh, HEAD_DIM)

    @triton.jit
    def _store_out(out_ptr, token, head, head_ok, l_sum, acc, stride_ot, stride_oh, HEAD_DIM: tl.constexpr):
        """One token's merged rows (acc [H, D] over weights l_sum [H]; 0 where nothing weighed) to
        the output."""
        dims = tl.arange(0, HEAD_DIM)
        o = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
