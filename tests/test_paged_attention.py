"""paged_attention against a naive per-sequence causal attention: ragged query blocks (prefill
chunks, verify blocks, single decode tokens), GQA, scattered block ids, and a max_context_len
padded past the longest context (as a CUDA-graph bucket would be)."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.attention import AttentionMetadata, gather_kv, paged_attention

BS, HQ, HKV, D, NB = 4, 6, 2, 8, 40


def naive(q_seq, k_seq, v_seq, first_pos, scale):
    """q_seq: [n, Hq, D] at positions first_pos.., keys k_seq/v_seq: [L, Hkv, D] -> [n, Hq, D]."""
    groups = HQ // HKV
    k = k_seq.repeat_interleave(groups, dim=1)  # [L, Hq, D]
    v = v_seq.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_seq, k) * scale  # [Hq, n, L]
    q_pos = torch.arange(first_pos, first_pos + q_seq.shape[0])
    allowed = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [n, L]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_case(q_lens, ctx_lens, pad_context=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.zeros(NB, BS, HKV, D), torch.zeros(NB, BS, HKV, D)
    perm = torch.randperm(NB, generator=gen).tolist()
    tables, full_k, full_v = [], [], []
    pos, slots = [], []
    for n, c in zip(q_lens, ctx_lens):
        table = [perm.pop() for _ in range(-(-c // BS))]
        tables.append(table)
        full_k.append(torch.randn(c, HKV, D, generator=gen))
        full_v.append(torch.randn(c, HKV, D, generator=gen))
        for p in range(c):  # earlier tokens are already cached; this step's are written by the call
            if p < c - n:
                k_cache[table[p // BS], p % BS], v_cache[table[p // BS], p % BS] = (
                    full_k[-1][p],
                    full_v[-1][p],
                )
            else:
                pos.append(p)
                slots.append(table[p // BS] * BS + p % BS)
    max_ctx = max(ctx_lens) + pad_context
    width = -(-max_ctx // BS)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    cu = torch.tensor([0] + q_lens).cumsum(0)
    meta = AttentionMetadata(
        positions=torch.tensor(pos), slot_mapping=torch.tensor(slots), cu_seqlens_q=cu,
        context_lens=torch.tensor(ctx_lens), block_tables=block_tables,
        max_query_len=max(q_lens), max_context_len=max_ctx, block_size=BS,
    )  # fmt: skip
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    k = torch.cat([fk[c - n :] for fk, n, c in zip(full_k, q_lens, ctx_lens)])
    v = torch.cat([fv[c - n :] for fv, n, c in zip(full_v, q_lens, ctx_lens)])
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=D**-0.5)
    expected = torch.cat([
        naive(q[cu[s] : cu[s + 1]], full_k[s], full_v[s], ctx_lens[s] - q_lens[s], D**-0.5)
        for s in range(len(q_lens))
    ])  # fmt: skip
    return out, expected, meta, k_cache, full_k, tables


@pytest.mark.parametrize(
    "q_lens, ctx_lens, pad",
    [
        ([5, 1, 3, 7], [5, 9, 14, 7], 0),  # prefill chunk from 0, decode, verify block, whole prompt
        ([1, 1, 1], [3, 17, 8], 0),  # pure decode (fast path)
        ([1, 1], [6, 2], 9),  # decode with a padded max_context_len
        ([2, 4], [11, 4], 5),  # ragged with a padded max_context_len
    ],
)
def test_paged_attention_matches_naive(q_lens, ctx_lens, pad):
    out, expected, meta, *_ = run_case(q_lens, ctx_lens, pad)
    assert meta.is_decode == (max(q_lens) == 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_gather_kv_reads_each_sequence_in_position_order():
    _, _, meta, k_cache, full_k, _ = run_case([2, 3], [6, 10])
    gathered = gather_kv(k_cache, meta.block_tables, meta.max_context_len)  # [S, L, Hkv, D]
    assert gathered.shape == (2, 10, HKV, D)
    torch.testing.assert_close(gathered[0, :6], full_k[0])
    torch.testing.assert_close(gathered[1], full_k[1])


def test_metadata_refuses_a_block_table_too_narrow_for_the_context():
    with pytest.raises(ValueError, match="block_tables"):
        AttentionMetadata(
            positions=torch.tensor([8]), slot_mapping=torch.tensor([8]), cu_seqlens_q=torch.tensor([0, 1]),
            context_lens=torch.tensor([9]), block_tables=torch.tensor([[0, 1]]), max_query_len=1,
            max_context_len=9, block_size=BS,
        )  # fmt: skip
