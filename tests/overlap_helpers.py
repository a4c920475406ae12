"""What the overlap tests share (tests/test_overlap.py, tests/test_overlap_drafts.py): an engine with
or without overlapped scheduling, a run to idle, and the comparison of two runs' samples."""

from __future__ import annotations

import pytest

from rollout import build_engine
from rollout.engine.config import EngineConfig

SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.9, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 101], list(range(60, 73)), [42, 43, 44]]


def overlap_engine(model, overlap: bool, **kw):
    cfg = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=32)
    cfg.update(kw)
    return build_engine(EngineConfig(model=str(model), overlap=overlap, **cfg))


def run_steps(eng, between=None) -> dict:
    """Steps until idle; `between(eng, step_index)` runs between steps. Samples by key."""
    outs, i = [], 0
    while eng.has_unfinished():
        outs += eng.step()
        if between is not None:
            outs += between(eng, i) or []
        i += 1
        assert i < 2000
    return {(o.request_id, o.prompt_index, o.sample_index): o for o in outs}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert g.token_ids == w.token_ids, f"{key}: tokens differ"
        assert (g.finish_reason, g.stop_reason, g.error) == (w.finish_reason, w.stop_reason, w.error), key
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-5), key
        assert g.policy_version == w.policy_version, key
        assert g.support_ids == w.support_ids, key
        if w.support_logprobs is not None:
            for a, b in zip(g.support_logprobs, w.support_logprobs):
                assert a == pytest.approx(b, abs=1e-5), key
