"""The static-buffer step replay behind CUDA graphs, run eagerly on CPU: padded rows must not
change any real output or touch real KV blocks (outputs equal the plain eager engine)."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import RepeatDrafter, factory_of

from rollout import build_engine
from rollout.engine.attention import AttentionMetadata
from rollout.engine.config import EngineConfig
from rollout.engine.graphs import StepGraphs
from rollout.engine.params import SamplingParams

PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105], [42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 201]]


def _run(model, static: bool, drafter=None, params=None, after_step=None, prompts=PROMPTS, n=3, max_tokens=12,
         **config):
    config.setdefault("spec_adaptive", False)  # full blocks: every verify shape
    eng = build_engine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=200, **config),
                       drafter_factory=factory_of(drafter))
    if static:
        eng.graphs = eng.make_step_graphs(capture=False)
    eng.add_request("g", prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    eng.add_request("s", prompts, params or SamplingParams(temperature=1.0, top_k=20, max_tokens=6, seed=3,
                                                           ignore_eos=True), n=n, mask="support")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
        if after_step is not None:
            after_step(eng)
    outs.sort(key=lambda o: (o.request_id, o.prompt_index, o.sample_index))
    return outs, eng


def test_static_replay_matches_eager_decode(tiny_random_qwen3):
    base, _ = _run(tiny_random_qwen3, static=False)
    outs, eng = _run(tiny_random_qwen3, static=True)
    assert eng.graphs.num_replays > 5 and len(eng.graphs.graphs) >= 2  # several batch buckets were used
    assert _one_output_buffer(eng.graphs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    for a, b in zip(outs, base):
        assert max(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs)) < 1e-4
        assert a.support_ids == b.support_ids


def test_static_replay_matches_eager_verify(tiny_random_qwen3):
    base, _ = _run(tiny_random_qwen3, static=False, drafter=RepeatDrafter(4))
    outs, eng = _run(tiny_random_qwen3, static=True, drafter=RepeatDrafter(4))
    assert eng.graphs.num_replays > 0
    assert any(k[1] == 4 for k in eng.graphs.graphs)  # verify blocks of 1 + 3 drafts were replayed
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]


def _one_output_buffer(graphs) -> bool:
    """Every graph of a set writes its outputs into the set's one buffer per output (the memory
    plan reserves one forward's working set for a set's pool, not outputs per captured key)."""
    return all(len({g[i].untyped_storage().data_ptr() for g in graphs.graphs.values()}) == 1
               for i in (1, 2) if all(g[i] is not None for g in graphs.graphs.values()))


def _assert_finite(eng) -> None:
    """After a step: the replayed steps' whole output buffers, padded rows included (their
    context K/V go to the scratch blocks, where writes of several rows to one slot race on a
    GPU), and every K/V cache of the target and the drafter."""
    outputs = [t for _, *outs in eng.graphs.graphs.values() for t in outs if t is not None]
    caches = [t for pair in eng.kv_caches + eng.drafter.caches for t in pair]
    assert all(bool(torch.isfinite(t).all()) for t in outputs + caches)


@pytest.mark.parametrize("backend,spec", [("torch", "dflash"), ("triton", "dflash"), ("torch", "dspark")])
def test_static_replay_with_a_block_drafter_matches_eager(tiny_random_qwen3, random_drafters, backend, spec):
    """The replayed step also writes the drafter's context K/V (padded rows into the scratch
    block of the drafter's cache), and the drafter's forward replays from its own static buffers
    (DraftGraphs, padded to batch and context buckets), and so does its choice of drafts (sampled
    batches; DSpark's walk with its confidence cut, greedy batches too): drafts, hence acceptance
    and outputs, equal the eager engine. Under the Triton kernel a padded verify row once saw no
    key (context 1 < its 4 queries) and computed NaN; on the H200 that NaN reached the scratch
    blocks, which the drafter's context reads (masked, but 0 * NaN): acceptance fell from ~3.0 to
    ~1.7."""
    kw = dict(spec=spec, draft=random_drafters[spec], spec_block_size=4, kernel_backend=backend)
    if spec == "dspark":
        kw.update(spec_confidence_threshold=0.5)
    if backend == "triton":  # interpreted on CPU: 6 sequences, still padded to the batch bucket 8
        kw.update(prompts=PROMPTS[:3], n=1, max_tokens=5,
                  params=SamplingParams(temperature=1.0, top_k=20, max_tokens=4, seed=3, ignore_eos=True))
    base, base_eng = _run(tiny_random_qwen3, static=False, **kw)
    outs, eng = _run(tiny_random_qwen3, static=True, after_step=_assert_finite, **kw)
    assert eng.graphs.num_replays > 0 and any(k[1] == 4 for k in eng.graphs.graphs)
    assert eng.drafter.graphs.num_replays > 0 and len(eng.drafter.graphs.graphs) >= 2  # drafter graphs too
    assert _one_output_buffer(eng.graphs) and _one_output_buffer(eng.drafter.graphs)
    choices = eng.drafter.graphs.choices  # (batch bucket, sampled): greedy batches choose eagerly but DSpark's
    assert {sampled for _, sampled in choices} == ({True, False} if spec == "dspark" else {True})
    assert len({b for b, _ in choices}) >= 2
    assert eng.compiled()["graphs"] == len(eng.graphs.graphs) + len(eng.drafter.graphs.graphs) + len(choices)
    assert base_eng.compiled()["graphs"] == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in base]


def test_every_query_of_a_padded_row_sees_a_key():
    """Rows padded up to the batch bucket are sequences of q tokens with context q in the scratch
    block: with a shorter context their first queries would see no key at all."""
    seen = {}

    def forward(input_ids, meta):
        seen.update(context_lens=meta.context_lens.tolist(), q=meta.max_query_len,
                    tables=meta.block_tables.tolist())
        return torch.zeros(input_ids.shape[0], 2), None

    graphs = StepGraphs(forward, scratch_block=9, block_size=4, max_blocks_per_seq=64, max_q=4,
                        device=torch.device("cpu"), capture=False)
    contexts = [5, 6, 7]  # three sequences verifying 4 tokens each: batch bucket 4, one padded row
    positions = [p for c in contexts for p in range(c - 4, c)]
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]])
    slots = [int(tables[i, p // 4]) * 4 + p % 4 for i, c in enumerate(contexts) for p in range(c - 4, c)]
    meta = AttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                             cu_seqlens_q=torch.tensor([0, 4, 8, 12]), context_lens=torch.tensor(contexts),
                             block_tables=tables, max_query_len=4, max_context_len=7, block_size=4)
    key = graphs.key(meta)
    assert key[:2] == (4, 4)
    graphs.run(key, torch.arange(12), meta)
    assert seen["q"] == 4 and seen["context_lens"][:3] == contexts
    assert seen["context_lens"][3] >= 4  # the padded row: each of its 4 queries sees key 0 at least
    assert set(seen["tables"][3]) == {9}  # ... all of them in the scratch block


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_choice_graphs_draw_what_the_eager_choice_draws(tiny_random_qwen3, random_drafters, spec):
    """The drafter's choice replayed from its static buffers (DraftGraphs.run_choice) against the
    same choice made eagerly, call after call: batches of 3, 5 and 3 rows again (padded to the
    buckets 4 and 8), greedy, sampled and mixed rows, DSpark with its confidence cut. The choice
    rewrites its logits in place, so a graph's first replay must not follow a warm-up run on the
    inputs (it did once: every key's first proposal then drew from twice-tempered logits)."""
    from rollout.engine.loader import load_model
    from rollout.spec.draft_graphs import DraftGraphs
    from rollout.spec.draft_loader import load_drafter
    from rollout.spec.proposer import BlockDrafter

    target = load_model(tiny_random_qwen3)
    drafter = BlockDrafter(load_drafter(random_drafters[spec], target), 4, confidence_threshold=0.5)
    graphs = DraftGraphs(None, 16, 8, 4, 0, torch.device("cpu"), capture=False)

    class Seq:
        def __init__(self, temperature, seed):
            self.params, self.seed = SamplingParams(temperature=temperature), seed

    gen = torch.Generator().manual_seed(0)
    for rows, temps in [(3, [1.0, 0.0, 0.7]), (5, [0.0] * 5), (3, [1.0, 1.0, 1.0]), (5, [0.0, 1.3, 1.0, 0.0, 1.0])]:
        logits = torch.randn(rows, 3, 264, generator=gen) * 4
        hidden = torch.randn(rows, 3, drafter.model.config.backbone.hidden_size, generator=gen)
        anchors, first = torch.randint(0, 264, (rows,), generator=gen), torch.randint(5, 50, (rows,), generator=gen)
        seqs = [Seq(t, 7 * i + rows) for i, t in enumerate(temps)]
        drafter.graphs = None
        want = drafter._choose(logits.clone(), hidden, anchors, seqs, first)
        drafter.graphs = graphs
        got = drafter._choose(logits.clone(), hidden, anchors, seqs, first)
        if spec == "dflash" and not any(temps):  # greedy DFlash: the argmax, no graph
            assert got[1] is None and torch.equal(got[0], want[0])
            continue
        assert torch.equal(got[0], want[0])
        assert (got[2] is None) == (spec == "dflash") and (got[2] is None or torch.equal(got[2], want[2]))
        assert (got[1] is None) == (not any(temps))
        if got[1] is not None:
            for a, b in zip((got[1].z, got[1].lse, got[1].one_hot), (want[1].z, want[1].lse, want[1].one_hot)):
                assert torch.equal(a, b)
    assert {b for b, _ in graphs.choices} == {4, 8} and graphs.num_choice_replays >= 3
