"""Ragged decode / verify steps (the adaptive draft budget verifies some drafts of some samples)
replay CUDA graphs too, run here through the static-buffer path eagerly (capture=False): every
decode and verify step and every drafter forward takes the graph path, outputs equal the eager
engine's (greedy and seeded), padding tokens sit in padding rows on the scratch block and are never
returned, and the graph keys stay within their bound (rollout/engine/graphs.py)."""

from __future__ import annotations

import collections

import pytest
import torch
from spec_helpers import cost_table

from rollout import build_engine
from rollout.engine.attention import AttentionMetadata
from rollout.engine.config import EngineConfig
from rollout.engine.graphs import TOKEN_STEPS, StepGraphs, bucket, graph_shape, padded_shape
from rollout.engine.params import SamplingParams

PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105], [42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 201]]


def _run(model, drafters: dict, kind: str, static: bool, backend: str = "torch"):
    """The adaptive budget on a frozen cost table that makes it verify ragged draft blocks; both arms
    price steps as graphed (so they choose alike), only `static` replays the graphs. Returns the
    outputs, the engine and the count of target steps by (kind, graphed)."""
    cost = cost_table(decode_ms=10.0, token_ms=0.2, drafter_ms=1.0, graph=True, q=4)
    eng = build_engine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=400, spec=kind, draft=drafters[kind],
                                    spec_block_size=4, kernel_backend=backend), step_cost=cost)
    if static:
        eng.graphs = eng.make_step_graphs(capture=False)
    eng.spec_budget.graphs, eng.spec_budget.max_graph_rows = True, 256
    kinds = collections.Counter()
    forward_step = eng._forward_step

    def counted(step, drafts):
        hidden = forward_step(step, drafts)
        q_lens = step.tokens.meta.cu_seqlens_q.diff().tolist()
        drafted = drafts.num_per_item
        kind = ("prefill" if any(q > 1 + d for q, d in zip(q_lens, drafted)) else
                "decode" if not any(drafted) else "uniform" if len(set(q_lens)) == 1 else "ragged")
        kinds[kind, eng._graphed] += 1
        return hidden

    eng._forward_step = counted
    prompts, n, tokens = (PROMPTS, 3, 12) if backend == "torch" else (PROMPTS[:2], 1, 5)  # triton: interpreted
    eng.add_request("g", prompts, SamplingParams(temperature=0.0, max_tokens=tokens + 4, ignore_eos=True))
    eng.add_request("s", prompts, SamplingParams(temperature=1.0, top_k=20, max_tokens=tokens, seed=3,
                                                 ignore_eos=True), n=n)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    outs.sort(key=lambda o: (o.request_id, o.prompt_index, o.sample_index))
    return outs, eng, kinds


@pytest.mark.parametrize("kind,backend", [("dflash", "torch"), ("dspark", "torch"), ("dflash", "triton")])
def test_ragged_verify_steps_replay_graphs_and_match_eager(tiny_random_qwen3, random_drafters, kind, backend):
    """Under the Triton kernel the padding rows hold fewer queries than the graph's q, or none."""
    base, _, base_kinds = _run(tiny_random_qwen3, random_drafters, kind, static=False, backend=backend)
    outs, eng, kinds = _run(tiny_random_qwen3, random_drafters, kind, static=True, backend=backend)
    assert kinds["ragged", True] >= 3 and base_kinds["ragged", False] >= 3  # the budget verified ragged blocks
    assert not any(graphed is False and k != "prefill" for k, graphed in kinds)  # ... all of them replayed
    drafter = eng.drafter
    assert drafter.num_proposals > 0 and drafter.graphs.num_replays == drafter.num_proposals  # drafter: all
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in base]
    for a, b in zip(outs, base):
        assert max(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs)) < 1e-4
    assert any(key[4] != key[0] * key[1] for key in eng.graphs.graphs)  # ragged keys (padded tokens)
    contexts = {(key[2], key[3]) for key in eng.graphs.graphs}
    steps = sum(m < 4 for m in TOKEN_STEPS) + 1
    assert len(eng.graphs.graphs) <= len(contexts) * len(eng.graphs.buckets) * (4 + steps)


def test_padding_tokens_sit_in_padding_rows_of_at_most_q_tokens_on_the_scratch_block():
    """Every ragged (rows, tokens) of batches up to 16 with q <= 4: the real tokens keep their places
    and are what comes back; the padding goes to rows past the real ones, at most q tokens each, with
    context q (each query sees a key) in the scratch block; keys of one context number at most
    buckets x (max_q + steps)."""
    seen = {}

    def forward(input_ids, meta):
        seen.update(cu=meta.cu_seqlens_q.tolist(), ctx=meta.context_lens.tolist(), q=meta.max_query_len,
                    tables=meta.block_tables.tolist(), slots=meta.slot_mapping.tolist())
        return input_ids[:, None].float(), None

    graphs = StepGraphs(forward, scratch_block=99, block_size=4, max_blocks_per_seq=64, max_q=4,
                        device=torch.device("cpu"), capture=False, max_batch=16)
    for rows in range(2, 17):
        for tokens in range(rows + 1, 4 * rows):
            q_lens = [1 + min(3, max(0, tokens - rows - 3 * i)) for i in range(rows)]  # [S] summing to tokens
            meta = _meta(q_lens)
            key = graphs.key(meta)
            assert key is not None and key[1] == 4 and key[4] >= tokens
            hidden, _ = graphs.run(key, torch.arange(tokens) + 1000, meta)
            assert hidden[:, 0].tolist() == list(range(1000, 1000 + tokens))  # the real tokens, in place
            pad = [b - a for a, b in zip(seen["cu"][rows:], seen["cu"][rows + 1:])]  # [padding rows]
            assert seen["cu"][: rows + 1] == meta.cu_seqlens_q.tolist() and seen["cu"][-1] == key[4]
            assert all(0 <= n <= 4 for n in pad) and seen["ctx"][rows:] == [4] * len(pad)
            assert all(set(t) == {99} for t in seen["tables"][rows:])
            assert set(seen["slots"][tokens:]) <= {99 * 4}
    steps = sum(m < 4 for m in TOKEN_STEPS) + 1
    assert len(graphs.graphs) <= len(graphs.buckets) * (4 + steps)
    assert padded_shape(256, 271, 16, (256,)) == (256 + 4, 320)  # one sample's block at batch 256: 1.25 x


def _meta(q_lens: list[int]) -> AttentionMetadata:
    """Sequences of q_lens[s] queries ending at position 7 + s % 4, blocks 3s .. 3s + 2."""
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    ctx = [8 + s % 4 for s in range(len(q_lens))]
    positions = [p for c, q in zip(ctx, q_lens) for p in range(c - q, c)]
    slots = [(3 * s + p // 4) * 4 + p % 4 for s, (c, q) in enumerate(zip(ctx, q_lens)) for p in range(c - q, c)]
    return AttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                             cu_seqlens_q=torch.tensor(cu), context_lens=torch.tensor(ctx),
                             block_tables=torch.tensor([[3 * s, 3 * s + 1, 3 * s + 2] for s in range(len(q_lens))]),
                             max_query_len=max(q_lens), max_context_len=max(ctx), block_size=4)


def _ragged(rows: int, tokens: int, max_q: int) -> AttentionMetadata:
    """A step of `rows` sequences of 1..max_q queries, `tokens` in all, each at context max_q + 4."""
    q_lens = [1 + min(max_q - 1, max(0, tokens - rows - (max_q - 1) * i)) for i in range(rows)]
    ctx, width = max_q + 4, -(-(max_q + 4) // 4)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    positions = [p for q in q_lens for p in range(ctx - q, ctx)]
    return AttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(positions),
                             cu_seqlens_q=torch.tensor(cu), context_lens=torch.full((rows,), ctx),
                             block_tables=torch.zeros(rows, width, dtype=torch.int64), max_query_len=max(q_lens),
                             max_context_len=ctx, block_size=4)


@pytest.mark.parametrize("max_num_seqs, max_tokens, max_q", [(256, 256, 2), (256, 2048, 16), (64, 200, 5)])
def test_no_graph_pads_past_the_largest_uniform_graph_the_memory_profile_measures(max_num_seqs, max_tokens, max_q):
    """A ragged step that would pad to more tokens than the profiled graph (rollout.engine.profile
    measures the uniform one of the most padded tokens) runs eagerly instead, so every setting the
    server accepts stays within its measured memory. At 256 sequences, 256 tokens and blocks of one
    draft, 129 sequences of 241 tokens would pad to 288 tokens: that step runs eagerly."""
    graphs = StepGraphs(lambda ids, meta: (ids[:, None].float(), None), scratch_block=99, block_size=4,
                        max_blocks_per_seq=64, max_q=max_q, device=torch.device("cpu"), capture=False,
                        max_batch=min(256, max_num_seqs), max_num_batched_tokens=max_tokens)
    rows, q = graph_shape(min(256, max_num_seqs), max_tokens, max_q, graphs.buckets)
    assert graphs.max_tokens == bucket(rows, graphs.buckets) * q
    stride = 7 if max_tokens <= 256 else 29  # token counts tried per row count (a few thousand keys)
    for s in range(1, min(max_num_seqs, max_tokens) + 1, 3):
        for t in range(s, min(s * max_q, max_tokens) + 1, stride):
            key = graphs.key(_ragged(s, t, max_q))
            assert key is None or key[4] <= graphs.max_tokens
    if max_tokens == 256:
        assert padded_shape(129, 241, 2, graphs.buckets)[1] == 288 > graphs.max_tokens
        assert graphs.key(_ragged(129, 241, 2)) is None
