"""Decode's all-heads lone pass (`LaunchConfig.lone_all_heads`; launched by
triton_prefix_attention.py after the shared pass): a lone item of a decode step is one token, and one
program runs all of that token's query heads. A key tile is whole keys x every KV head. A key's heads
lie side by side in the cache, so that is one contiguous read instead of one per KV head. Each query
row sees the key rows of its own KV head, masked in one softmax over the whole tile (`_heads_tile`).

In a decode step every token has a lone unit (suffixes unfused), so this pass also merges
(`LaunchConfig.lone_merge`). The shared pass has finished by then. A token's only lone chunk merges
the token's shared partial rows with its own rows, still in registers: no partial row is written and
read back, and there is no merge kernel. Where a lone unit is cut into chunks, the last chunk to finish
(a per-token count of finished chunks) merges them all.
"""

from __future__ import annotations

from rollout.engine.prefix_launch import LaunchConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with xgrammar, a dependency
    triton = None

ALL_HEADS_TILE = 128 * 128  # key rows x head dim of the all-heads kernel's tile at most (measured:
# 128 x 128, 82 KB of shared memory with two stages; twice that would not fit an H200's 228 KB)


def all_heads(config: LaunchConfig, max_query_len: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the lone pass runs every head of a token in one program (_lone_heads_kernel): asked
    for, a decode step (a lone item is one token), a key tile holding whole keys, and a tile no
    larger than the one measured (else the per-KV-head lone pass runs)."""
    return (config.lone_all_heads and max_query_len == 1 and num_kv_heads & (num_kv_heads - 1) == 0
            and config.lone_block_n % num_kv_heads == 0 and config.lone_block_n * head_dim <= ALL_HEADS_TILE)


if triton is not None:
    from rollout.engine.triton_pdl import start as pdl_start
    from rollout.engine.triton_prefix_tiles import (
        _heads_tile,
        _merge_partials,
        _rows_result,
        _rows_start,
        _store_merged,
        _store_out,
        _store_rows,
    )

    @triton.jit(do_not_specialize=["stride_bt", "num_tokens"],
                do_not_specialize_on_alignment=["items_ptr", "item_counts_ptr", "part_start_ptr", "part_count_ptr",
                                                "positions_ptr", "block_tables_ptr"])
    def _lone_heads_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr, tickets_ptr, items_ptr,
        item_counts_ptr, part_start_ptr, part_count_ptr, positions_ptr, block_tables_ptr, qk_scale, num_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, GROUPS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_FIELDS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr, LAZY: tl.constexpr,
        INDEX32: tl.constexpr,
    ):
        """A decode step's lone items, every head of the item's one token in one program: its rows
        are the token's query heads [HEADS_P2], a key tile is BLOCK_N // NUM_KV_HEADS keys x every
        KV head (a key's heads lie side by side in the cache: one contiguous read), and a row sees
        the key rows of its own KV head. Program p takes every P-th lone item. MERGE: every token
        has a lone unit, and this pass merges its partial results (_finish_token) in place of the
        merge kernel, whose other duties it takes on too (the work counter, padded rows). LAZY
        (LaunchConfig.lone_lazy_rescale): the rows' softmax rescales only as _raise_max's LAZY says.
        INDEX32: key rows' offsets in int32 (LaunchConfig.index32, where the caches allow)."""
        KEYS: tl.constexpr = BLOCK_N // NUM_KV_HEADS
        pdl_start(PDL)
        num_shared = tl.load(item_counts_ptr)
        total = tl.load(item_counts_ptr + 1)
        head = tl.arange(0, HEADS_P2)  # [M] the rows
        row_ok = head < NUM_HEADS
        kv_row = tl.arange(0, BLOCK_N)  # [N] key rows, key by key: key kv_row // NUM_KV_HEADS
        kv_head, key_of = kv_row % NUM_KV_HEADS, kv_row // NUM_KV_HEADS
        mine = (head // GROUPS)[:, None] == kv_head[None, :]  # [M, N]
        if MERGE:
            _merge_duties(out_ptr, counter_ptr, part_count_ptr, num_tokens, head, row_ok, stride_ot, stride_oh,
                          HEADS_P2, HEAD_DIM)
        item = num_shared + tl.program_id(0)
        while item < total:
            item_ptr = items_ptr + item * NUM_FIELDS
            tok = tl.load(item_ptr)  # lone items of a decode step: one token of the step, direct
            token = tok + tl.zeros([HEADS_P2], tl.int64)  # [M]
            key_lo = tl.load(item_ptr + 5).to(tl.int32)
            hi = tl.minimum(tl.load(item_ptr + 8), tl.load(item_ptr + 6)).to(tl.int32)
            q_pos = tl.load(positions_ptr + tok).to(tl.int32)
            q, m_i, l_i, acc = _rows_start(q_ptr, token, head, row_ok, stride_qt, stride_qh, HEAD_DIM, HEADS_P2)
            table = block_tables_ptr + tl.load(item_ptr + 4) * stride_bt
            for v0 in range(tl.load(item_ptr + 7).to(tl.int32), hi, KEYS):
                m_i, l_i, acc = _heads_tile(q, k_ptr, v_ptr, table, key_lo, v0 + key_of, hi, kv_head, mine, q_pos,
                                            m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh, stride_vb,
                                            stride_vs, stride_vh, HEAD_DIM, BLOCK_SIZE, DOT_PRECISION, LAZY, INDEX32)
            if MERGE:
                _finish_token(item_ptr, tok, token, head, row_ok, m_i, l_i, acc, out_ptr, part_o_ptr, part_lse_ptr,
                              tickets_ptr, part_start_ptr, part_count_ptr, stride_ot, stride_oh, NUM_HEADS, HEADS_P2,
                              HEAD_DIM)
            else:
                _store_rows(item_ptr, token, head, row_ok, m_i, l_i, acc, out_ptr, part_o_ptr, part_lse_ptr,
                            part_start_ptr, part_count_ptr, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM)
            item += tl.num_programs(0)

    @triton.jit
    def _finish_token(item_ptr, tok, token, head, head_ok, m_i, l_i, acc, out_ptr, part_o_ptr, part_lse_ptr,
                      tickets_ptr, part_start_ptr, part_count_ptr, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                      HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
        """A lone item's rows (every head of token `tok`, `token` [H] its copies) into the output,
        merged with the token's other partial results: those of the shared pass are done (this pass
        waited for it). The token's only lone chunk merges them with its own rows held in
        registers; of several chunks each stores its rows, and the last to finish (a count of
        finished chunks per token, reset for the next layer) merges them all."""
        count = tl.load(part_count_ptr + tok)
        start = tl.load(part_start_ptr + tok)
        if (count != 1) & (tl.load(item_ptr + 12) == 1):  # one lone chunk: its own rows weigh 1 against
            o, lse = _rows_result(m_i, l_i, acc)  # their lse as the running max
            _, l_sum, merged = _merge_partials(part_o_ptr, part_lse_ptr, start, count, tl.load(item_ptr + 11), head,
                                               head_ok, lse, tl.where(lse == float("-inf"), 0.0, 1.0), o,
                                               NUM_HEADS, HEAD_DIM, "")
            _store_out(out_ptr, tok, head, head_ok, l_sum, merged, stride_ot, stride_oh, HEAD_DIM)
        else:  # the output (the token's only partial result), or the chunk's partial row
            _store_rows(item_ptr, token, head, head_ok, m_i, l_i, acc, out_ptr, part_o_ptr, part_lse_ptr,
                        part_start_ptr, part_count_ptr, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM)
            if count != 1:
                tl.debug_barrier()  # every thread's rows stored before the count says so (release)
                if tl.atomic_add(tickets_ptr + tok, 1) == tl.load(item_ptr + 12) - 1:  # acquire: all chunks in
                    tl.store(tickets_ptr + tok, 0)
                    _store_merged(part_o_ptr, part_lse_ptr, start, count, tok, head, head_ok, out_ptr, stride_ot,
                                  stride_oh, NUM_HEADS, HEADS_P2, HEAD_DIM, ".cg")  # past L1: other SMs' rows

    @triton.jit
    def _merge_duties(out_ptr, counter_ptr, part_count_ptr, num_tokens, head, head_ok, stride_ot, stride_oh,
                      HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
        """What the merge kernel does besides merging, for a pass that merges in its place (after its
        wait): reset the item kernel's work counter for the next layer, and write 0 to the rows of
        tokens with no partial result (a CUDA graph's padding), program p taking every P-th token."""
        if tl.program_id(0) == 0:
            tl.store(counter_ptr, 0)
        t = tl.program_id(0).to(tl.int64)
        while t < num_tokens:
            if tl.load(part_count_ptr + t) == 0:
                _store_out(out_ptr, t, head, head_ok, tl.zeros([HEADS_P2], tl.float32),
                           tl.zeros([HEADS_P2, HEAD_DIM], tl.float32), stride_ot, stride_oh, HEAD_DIM)
            t += tl.num_programs(0)
