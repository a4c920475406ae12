"""The KV pool's memory plan (rollout/engine/memory.py) and the profile of the largest step
(rollout/engine/profile.py), on CPU: the arithmetic from measured bytes to a block count, the
settings that cannot fit refused by name, the shapes of the largest steps, and the dummy steps run
through the engine's real step path (what CUDA measures) leaving the engine as it was."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from rollout import build_engine
from rollout.engine import graphs, memory, profile
from rollout.engine.config import EngineConfig
from rollout.engine.drafter import Drafts
from rollout.engine.memory import DeviceMemory
from rollout.engine.params import SamplingParams
from rollout.engine.verify import Proposal
from rollout.errors import InvalidArgument

GIB = 1 << 30


def test_the_pool_gets_what_the_fraction_leaves_after_weights_step_and_graphs():
    mem = DeviceMemory(total=100 * GIB, held=20 * GIB, step=10 * GIB, graphs=5 * GIB, step_setting="max_num_seqs")
    assert memory.gpu_kv_blocks(mem, 0.9, GIB // 4) == (90 - 35) * 4
    assert memory.gpu_kv_blocks(mem, 0.5, GIB // 4) == (50 - 35) * 4


@pytest.mark.parametrize("held, step, graphs, field", [
    (95, 1, 1, "gpu_memory_fraction"),  # the weights alone
    (20, 80, 0, "max_num_batched_tokens"),  # a step that cannot fit next to the weights
    (20, 60, 20, "cuda_graphs"),  # the step fits, not with the graph pools
])  # fmt: skip
def test_a_plan_that_cannot_fit_names_the_setting(held, step, graphs, field):
    mem = DeviceMemory(total=100 * GIB, held=held * GIB, step=step * GIB, graphs=graphs * GIB,
                       step_setting="max_num_batched_tokens")
    with pytest.raises(InvalidArgument) as exc:
        memory.gpu_kv_blocks(mem, 0.9, GIB // 4)
    assert exc.value.field == field


def test_num_kv_blocks_is_refused_beyond_the_plan_and_kept_within():
    assert memory.choose_kv_blocks(EngineConfig(num_kv_blocks=50), planned=80) == 50
    assert memory.choose_kv_blocks(EngineConfig(), planned=80) == 80
    with pytest.raises(InvalidArgument) as exc:
        memory.choose_kv_blocks(EngineConfig(num_kv_blocks=81), planned=80)
    assert exc.value.field == "num_kv_blocks"


def test_an_explicit_max_model_len_the_pool_cannot_hold_is_refused(tiny_random_qwen3):
    with pytest.raises(InvalidArgument) as exc:  # 7 usable blocks of 16 = 112 tokens
        build_engine(EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=8, max_model_len=200))
    assert exc.value.field == "max_model_len"
    eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=8))  # unset: capped to the pool
    assert eng.max_model_len == 112
    with pytest.raises(InvalidArgument) as exc:
        build_engine(EngineConfig(model=str(tiny_random_qwen3), cpu_kv_bytes=1000))
    assert exc.value.field == "cpu_kv_bytes"


def test_the_largest_steps_reach_max_rows_and_the_token_budget():
    shapes = profile.step_shapes(max_num_seqs=256, max_tokens=2048, num_spec=0, max_model_len=4096)
    assert shapes[profile.ROWS] == [(1, 0)] * 256
    assert shapes[profile.TOKENS] == [(1, 0)] * 255 + [(1793, 0)]
    shapes = profile.step_shapes(max_num_seqs=256, max_tokens=2048, num_spec=15, max_model_len=4096)
    assert shapes == {profile.ROWS: [(16, 15)] * 128}  # max_rows = the budget: no room for a prefill
    shapes = profile.step_shapes(max_num_seqs=5, max_tokens=50, num_spec=3, max_model_len=8)
    assert sum(t for t, _ in shapes[profile.ROWS]) == 20 and len(shapes[profile.ROWS]) == 5
    tokens = shapes[profile.TOKENS]  # chunks of at most max_model_len: 5 x 8 is the most a step can have
    assert tokens == [(8, 0)] * 5
    assert graphs.graph_shape(256, 2048, 16, (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)) == (136, 15)


@contextlib.contextmanager
def _recorded(engine, steps: list):
    """Records (section, tokens, rows, masked, grammar) of every policy run of the profile."""
    real = engine._sample
    section = [None]

    def sample(step, drafts, hidden):
        masked = sum(bool(s.mask) for s in step.rows.entries)
        grammar = sum(s.grammar is not None for s in step.rows.entries)
        steps.append((section[0], step.tokens.input_ids.shape[0], step.rows.cu_rows[-1], masked, grammar))
        return real(step, drafts, hidden)

    class Meter:
        names = []

        @contextlib.contextmanager
        def section(self, name):
            self.names.append(name)
            outer, section[0] = section[0], name
            yield
            section[0] = outer

    engine._sample = sample
    try:
        yield Meter()
    finally:
        del engine._sample


@pytest.mark.parametrize("spec", ["dflash", "dspark+history", "history"])
def test_the_profile_runs_the_real_step_path_and_leaves_the_engine_as_it_was(tiny_random_qwen3, random_drafters,
                                                                               spec):
    """The dummy steps on CPU: the token budget and max_rows reached, every kind of row sampled
    (masks and a grammar bitmask included), the graph sets' static paths run; then the engine's
    outputs equal those of an engine that was never profiled. A combined drafter's parts (the
    drafter model and the history drafter) are each left as they were. A history drafter, which has
    no history for the dummy steps' sequences, is profiled at full blocks too (its drafts padded)."""
    kind = spec.split("+")[0]
    kw = dict(model=str(tiny_random_qwen3), spec=spec, draft=random_drafters.get(kind), spec_block_size=4,
              num_kv_blocks=64, max_num_seqs=6, max_num_batched_tokens=40, max_mask_tokens=16,
              spec_adaptive=False)  # full blocks: an adaptive budget's choices follow wall time
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=6, seed=5, ignore_eos=True)
    fresh = build_engine(EngineConfig(**kw))
    eng = build_engine(EngineConfig(**kw))
    steps = []
    with _recorded(eng, steps) as meter:
        profile.run_largest_steps(eng, 300, meter, graphs=True)
    rows = [s for s in steps if s[0] == profile.ROWS]
    assert len(rows) == 4 and all(s[1:3] == (24, 24) for s in rows)  # 6 x (1 + 3 drafts), four kinds
    assert {s[3] for s in rows} == {0, 6, 2} and max(s[4] for s in rows) == 6  # masked / grammar rows
    tokens = [s for s in steps if s[0] == profile.TOKENS]
    assert [s[1:3] for s in tokens] == [(40, 21)]  # 5 verify blocks + a 20-token prefill chunk
    graph_sets = {"graph_buffers", profile.GRAPHS} | ({profile.DRAFT_GRAPHS} if spec != "history" else set())
    assert graph_sets <= set(meter.names)  # graph sets' forwards (a history drafter has none)
    assert eng.graphs is None and getattr(eng.drafter, "graphs", None) is None and eng.kv_caches is not None
    outs = {}
    for name, engine in (("fresh", fresh), ("profiled", eng)):
        engine.add_request("r", [[3, 4, 5], [9, 8]], params, n=2, mask="support")
        done = []
        while engine.has_unfinished():
            done += engine.step()
        outs[name] = sorted((o.prompt_index, o.sample_index, o.token_ids, o.accept_lengths) for o in done)
    assert outs["profiled"] == outs["fresh"]
    for part, fresh_part in zip(eng.drafter.parts(), fresh.drafter.parts(), strict=True):
        assert (part.num_proposals, part.num_drafted) == (fresh_part.num_proposals, fresh_part.num_drafted)


def test_a_short_proposal_is_padded_to_full_blocks_with_uniform_drafts():
    """The profile's padding (a drafter proposed 2 + 1 of 3 + 3 drafts): the drafter's own drafts and
    distributions in place, the rest token 0 from a uniform q (log-sum-exp log V), none one-hot."""
    vocab = 10
    z = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([4, 5, 6])
    q = Proposal(z, torch.logsumexp(z, dim=1), torch.tensor([False, True, False]), tokens)
    out = profile._full_blocks(Drafts(tokens, [2, 1, 0], q), [3, 3, 0], vocab)
    assert out.num_per_item == [3, 3, 0] and out.tokens.tolist() == [4, 5, 0, 6, 0, 0]
    own = [0, 1, 3]
    assert torch.equal(out.q.z[own], z) and not out.q.z[[2, 4, 5]].any()
    assert torch.allclose(out.q.lse[own], q.lse) and torch.allclose(out.q.lse[[2, 4, 5]], torch.tensor(math.log(vocab)))
    assert out.q.one_hot.tolist() == [False, True, False, False, False, False]
    assert torch.equal(out.q.tokens, out.tokens)
    unchanged = Drafts(tokens, [3, 0, 0], q)
    assert profile._full_blocks(unchanged, [3, 0, 0], vocab) is unchanged
