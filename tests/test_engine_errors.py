"""Bad input at the engine's door: every out-of-range sampling parameter and every malformed
request is refused by `add_request` with InvalidArgument naming the field, a full queue with
ResourceExhausted, a request id still running with Aborted, and a refused request leaves nothing
queued or allocated.
"""

from __future__ import annotations

import math

import pytest

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import FLOAT32_TINY, SamplingParams
from rollout.errors import Aborted, InvalidArgument, ResourceExhausted

VOCAB = 264
NUM_BLOCKS, BLOCK_SIZE = 32, 4
MAX_MODEL_LEN = (NUM_BLOCKS - 1) * BLOCK_SIZE  # the KV cache bounds the context here (124 < 512)


@pytest.fixture(scope="module")
def engine(tiny_random_qwen3):
    return build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=BLOCK_SIZE,
                                  num_kv_blocks=NUM_BLOCKS, max_queued_samples=6, max_mask_tokens=16))


def assert_nothing_queued(eng: LLMEngine) -> None:
    assert not eng.has_unfinished()
    assert eng.intake.requests == {} and eng.intake.num_unfinished == 0
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert eng.kv_blocks() == (NUM_BLOCKS, NUM_BLOCKS)


def refused(eng: LLMEngine, field: str, prompts=([1, 2, 3],), params=None, n=1, mask=None,
            request_id="bad") -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        eng.add_request(request_id, [list(p) for p in prompts], params or SamplingParams(), n=n, mask=mask)
    assert info.value.field == field, f"field {info.value.field!r} named, expected {field!r}: {info.value}"
    assert field.split("[")[0] in str(info.value)
    assert_nothing_queued(eng)
    return info.value


BAD_PARAMS = [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_k", VOCAB + 1), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", -0.2), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01),
    ("presence_penalty", 3.0), ("presence_penalty", -2.5),
    ("logit_bias", {VOCAB: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: math.nan}), ("logit_bias", {"5": 1.0}),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [3, -1]),
    ("max_tokens", 0), ("max_tokens", -4), ("max_tokens", 2.0),
    ("seed", -1), ("seed", 2**63), ("seed", 1.5),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_out_of_range_sampling_parameter_is_named(engine, field, value):
    refused(engine, field, params=SamplingParams(**{field: value}))


# Finite in Python, not computable in float32 (the engine's precision): each once failed mid-request
# blaming the grammar, or rounded to another value, before validation refused it by name.
FLOAT32_EXTREMES = [
    ("temperature", 1e-39), ("temperature", 1e-6), ("temperature", 1e39), ("temperature", 1e6),
    ("top_p", 1e-46), ("top_p", 1e-39),
    ("min_p", 1e-46), ("min_p", 1e-40),
    ("repetition_penalty", 1e-38), ("repetition_penalty", 1e-4), ("repetition_penalty", 1e38),
    ("frequency_penalty", 1e-40), ("presence_penalty", -1e-45),
    ("logit_bias", {5: 1e-40}), ("logit_bias", {5: -3e-39}),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), FLOAT32_EXTREMES, ids=[f"{f}={v!r}" for f, v in FLOAT32_EXTREMES])
def test_values_float32_cannot_compute_are_refused_with_the_range(engine, field, value):
    err = refused(engine, field, params=SamplingParams(**{field: value}))
    assert " in [" in err.message or " in (" in err.message, err.message


@pytest.mark.parametrize("edge", [
    dict(temperature=1e-5, top_p=FLOAT32_TINY, min_p=FLOAT32_TINY, repetition_penalty=1e-3,
         frequency_penalty=-2.0, logit_bias={40: 100.0, 41: FLOAT32_TINY}),
    dict(temperature=1e5, top_p=1.0, min_p=1.0, repetition_penalty=1e3, presence_penalty=2.0,
         logit_bias={40: -100.0}),
])  # fmt: skip
def test_float32_limits_are_accepted_and_sample(engine, edge):
    """The documented limits compute: a repeating prompt under the strongest penalties at the
    smallest / largest temperature samples every token (no overflow to an empty support)."""
    engine.add_request("edge32", [[40, 41, 40, 41, 40, 41]], SamplingParams(top_k=0, max_tokens=6, **edge), n=2)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.finish_reason, o.error, len(o.token_ids)) for o in outputs] == [("length", None, 6)] * 2
    assert all(math.isfinite(lp) for o in outputs for lp in o.token_logprobs)
    assert_nothing_queued(engine)


@pytest.mark.parametrize(("min_tokens", "max_tokens"), [(5, 4), (-1, 4)])
def test_min_tokens_must_fit_under_max_tokens(engine, min_tokens, max_tokens):
    refused(engine, "min_tokens", params=SamplingParams(min_tokens=min_tokens, max_tokens=max_tokens))


def test_limits_themselves_are_accepted(engine):
    edge = SamplingParams(temperature=0.0, top_k=VOCAB, top_p=1.0, min_p=1.0, repetition_penalty=1e-3,
                          frequency_penalty=2.0, presence_penalty=-2.0,
                          logit_bias={0: -100.0, VOCAB - 1: 100.0}, stop_token_ids=[0, VOCAB - 1],
                          min_tokens=3, max_tokens=3, seed=2**63 - 1)
    engine.add_request("edge", [[1, 2, 3]], edge, n=2)
    assert engine.has_unfinished()
    while engine.has_unfinished():
        engine.step()
    assert_nothing_queued(engine)


@pytest.mark.parametrize(("prompts", "field"), [
    ([], "prompts"),
    ([[]], "prompts[0]"),
    ([[1, 2], []], "prompts[1]"),
    ([[1, VOCAB]], "prompts[0]"),
    ([[5], [3, -1]], "prompts[1]"),
    ([[1, 2.0]], "prompts[0]"),
])  # fmt: skip
def test_bad_prompts_are_named(engine, prompts, field):
    refused(engine, field, prompts=prompts)


def test_prompt_too_long_for_the_context(engine):
    params = SamplingParams(max_tokens=10)
    refused(engine, "prompts[1]", prompts=[[1], [2] * (MAX_MODEL_LEN - 9)], params=params)
    engine.add_request("fits", [[2] * (MAX_MODEL_LEN - 10)], params)
    engine.abort("fits")
    assert_nothing_queued(engine)


@pytest.mark.parametrize("n", [0, -2, 1.5, None])
def test_n_must_be_a_positive_integer(engine, n):
    refused(engine, "n", n=n)


@pytest.mark.parametrize("request_id", ["", None, 7])
def test_request_id_must_be_a_non_empty_string(engine, request_id):
    refused(engine, "request_id", request_id=request_id)


def test_duplicate_request_id_is_refused_retryably_the_first_survives_and_an_abort_frees_it(engine):
    """A running id is refused with Aborted (gRPC ABORTED: retry), not InvalidArgument (do not
    retry), and is free again as soon as its abort has run."""
    engine.add_request("dup", [[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(Aborted, match="request_id: 'dup' is still running"):
        engine.add_request("dup", [[4, 5]], SamplingParams(max_tokens=2))
    assert [s.prompt_token_ids for s in engine.intake.requests["dup"]] == [[1, 2, 3]]
    assert len(engine.scheduler.waiting) == 1
    engine.abort("dup")
    assert_nothing_queued(engine)
    engine.add_request("dup", [[4, 5]], SamplingParams(max_tokens=2))
    engine.abort("dup")
    assert_nothing_queued(engine)


@pytest.mark.parametrize(("mask", "params", "field"), [
    ("full", SamplingParams(top_k=4), "mask"),
    ("selected", SamplingParams(top_k=0), "top_k"),
    ("support", SamplingParams(top_k=-1), "top_k"),
    ("support", SamplingParams(top_k=17), "top_k"),
])  # fmt: skip
def test_bad_mask_requests_are_refused(engine, mask, params, field):
    refused(engine, field, params=params, mask=mask)


@pytest.mark.parametrize(("mask", "params"), [
    ("support", SamplingParams(temperature=0.0)),
    ("selected", SamplingParams(top_k=16)),
    ("", SamplingParams()),
])  # fmt: skip
def test_bounded_mask_requests_are_accepted(engine, mask, params):
    """Accepted means queued, with the mask mode asked for (an `add_request` that returned without
    queuing a mask request passed the old version of this test)."""
    engine.add_request("m", [[1, 2]], params, mask=mask)
    assert [s.mask for s in engine.intake.requests["m"]] == [mask or None]
    assert list(engine.scheduler.waiting) == engine.intake.requests["m"] and engine.has_unfinished()
    engine.abort("m")
    assert_nothing_queued(engine)


def test_queue_full_is_resource_exhausted_and_queues_nothing(engine):
    engine.add_request("a", [[1, 2], [3]], SamplingParams(max_tokens=2), n=2)  # 4 of 6 samples
    with pytest.raises(ResourceExhausted):
        engine.add_request("b", [[1, 2]], SamplingParams(max_tokens=2), n=3)
    assert set(engine.intake.requests) == {"a"} and engine.intake.num_unfinished == 4
    assert len(engine.scheduler.waiting) == 2
    engine.add_request("c", [[1, 2]], SamplingParams(max_tokens=2), n=2)  # exactly full
    with pytest.raises(ResourceExhausted):
        engine.add_request("d", [[9]], SamplingParams(max_tokens=2))
    engine.abort("a")
    engine.add_request("d", [[9]], SamplingParams(max_tokens=2))  # room again
    engine.abort("c")
    engine.abort("d")
    assert_nothing_queued(engine)


def test_validation_happens_before_anything_is_queued(engine):
    """A request with one good and one bad prompt queues neither."""
    refused(engine, "prompts[2]", prompts=[[1, 2], [3, 4], [VOCAB + 5]], n=2)
    refused(engine, "temperature", prompts=[[1, 2]], params=SamplingParams(temperature=-1.0), n=2)
