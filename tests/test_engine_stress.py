"""A seeded random workload through the engine (bounded: 100 steps per configuration): mixed
sampling settings, masks, grammars, n > 1, prefix reuse, aborts, small KV budgets, all three
spec methods. Every sample of every request comes back exactly once (or aborted), masked
samples pass the mask validator (docs/masks.md), and every KV block is free at the end. This is the
test that found forks copying a first sample's accepted drafts. Every generated request is valid,
so a refusal fails the test (it used to be swallowed: a validation that refused, say, masks with a
grammar passed)."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.grammar import GrammarSpec
from rollout.engine.params import SamplingParams
from rollout.masks.check import check_table
from rollout.schema import to_record_batch

GRAMMARS = [None, None, GrammarSpec("regex", "[a-z]{1,5}"),
            GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))]


def _params(rng: random.Random) -> tuple[SamplingParams, str | None]:
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.2]), top_k=rng.choice([0, 5, 40]), top_p=rng.choice([1.0, 0.9]),
        min_p=rng.choice([0.0, 0.05]), repetition_penalty=rng.choice([1.0, 1.3]), min_tokens=rng.choice([0, 2]),
        max_tokens=rng.randint(1, 24), seed=rng.choice([None, 5]), stop_token_ids=rng.choice([[], [10]]),
        logit_bias=rng.choice([{}, {32: 3.0}]))
    mask = rng.choice([None, "selected", "support"])
    if mask and params.temperature > 0 and params.top_k == 0:
        params.top_k = 40
    return params, mask


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("spec", ["none", "dflash", "dspark"])
def test_random_workload(spec, seed):
    rng = random.Random(seed)
    eng = build_engine(EngineConfig(
        spec=spec, num_kv_blocks=rng.choice([60, 300]), block_size=rng.choice([4, 16]),
        spec_confidence_threshold=0.4 if spec == "dspark" and seed == 2 else 0.0,
        max_num_batched_tokens=rng.choice([16, 64, 512]), max_num_seqs=rng.choice([4, 64])))
    expected, aborted, outs = {}, set(), []
    prompts_pool = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    for step in range(100):
        if rng.random() < 0.3:
            rid = f"r{step}"
            params, mask = _params(rng)
            prompts = [rng.choice(prompts_pool) for _ in range(rng.randint(1, 3))]  # repeats: prefix reuse
            n = rng.randint(1, 4)
            eng.add_request(rid, prompts, params, n=n, mask=mask, grammar=rng.choice(GRAMMARS))
            expected[rid] = len(prompts) * n
        if expected and rng.random() < 0.05:
            rid = rng.choice(sorted(set(expected) - aborted))
            aborted.add(rid)
            outs += eng.abort(rid)
        outs += eng.step()
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
    seen = {}
    for o in outs:
        key = (o.request_id, o.prompt_index, o.sample_index)
        assert key not in seen, f"{key} came back twice"
        seen[key] = o
        assert o.error is None or "no token is allowed" in o.error
    for rid, count in expected.items():
        got = [k for k in seen if k[0] == rid]
        assert len(got) == count or rid in aborted, (rid, len(got), count)
    masked = [o for o in outs if o.support_ids is not None and o.error is None]
    assert masked
    report = check_table(pa.Table.from_batches([to_record_batch(masked)]))
    assert report.ok, report.violations[:3]
