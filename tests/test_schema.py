"""`rollout.schema.to_record_batch` (flat values + offsets) against the straightforward nested
`pa.array` construction: the same schema and values for samples with and without masks, in
selected and support mode, with zero-length outputs and failed samples, and through Arrow IPC."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from rollout.outputs import SampleOutput
from rollout.schema import ROLLOUT_SCHEMA, schema_with_metadata, to_record_batch


def reference_batch(samples: list[SampleOutput], schema: pa.Schema = ROLLOUT_SCHEMA) -> pa.RecordBatch:
    """Every column as `pa.array` of the samples' Python values (the nested conversion)."""
    arrays = [pa.array([getattr(s, f.name) for s in samples], type=f.type) for f in ROLLOUT_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _sample(rng: random.Random, i: int, mode: str | None, num_tokens: int, width: int = 8) -> SampleOutput:
    s = SampleOutput(f"req-{i}", prompt_index=i // 2, sample_index=i % 2,
                     prompt_token_ids=[rng.randrange(264) for _ in range(rng.randrange(1, 9))])  # fmt: skip
    s.token_ids = [rng.randrange(264) for _ in range(num_tokens)]
    s.token_logprobs = [-rng.random() * 5 for _ in range(num_tokens)]
    widths = [rng.randrange(1, width + 1) for _ in range(num_tokens)]
    if mode is not None:
        s.support_ids = [[rng.randrange(264) for _ in range(w)] for w in widths]
    if mode == "support":
        s.support_logprobs = [[float("-inf") if k == 3 else -rng.random() * 9 for k in range(w)] for w in widths]
    s.finish_reason = rng.choice(["stop", "length", "abort"])
    s.accept_lengths = [rng.randrange(1, 9) for _ in range(rng.randrange(0, 5))]
    s.policy_version = rng.randrange(2**40)
    return s


def _samples(modes: list[str | None], seed: int = 0) -> list[SampleOutput]:
    rng = random.Random(seed)
    return [_sample(rng, i, mode, num_tokens=[0, 1, 7, 33][i % 4]) for i, mode in enumerate(modes)]


@pytest.mark.parametrize(
    "modes",
    [
        [None] * 5,
        ["selected"] * 6,
        ["support"] * 7,
        [None, "selected", "support", "support", None, "selected", None, "support"],  # nulls between rows
        ["support"],
    ],
)
def test_record_batch_equals_the_nested_reference(modes):
    samples = _samples(modes)
    schema = schema_with_metadata("tiny", "dflash", "dflash", "support", 8)
    batch = to_record_batch(samples, schema)
    assert batch.schema.equals(schema, check_metadata=True)
    assert batch.equals(reference_batch(samples, schema))
    assert batch.to_pylist() == reference_batch(samples, schema).to_pylist()
    for name in ("support_ids", "support_logprobs"):
        assert [x is None for x in batch.column(name).to_pylist()] == [getattr(s, name) is None for s in samples]


def test_zero_length_outputs_empty_batches_and_failed_samples():
    assert to_record_batch([]).equals(reference_batch([]))
    empty = SampleOutput("r", 0, 0, prompt_token_ids=[1])
    empty.support_ids, empty.support_logprobs = [], []
    failed = SampleOutput("r", 0, 1, prompt_token_ids=[1, 2], finish_reason="error", error="overflow")
    batch = to_record_batch([empty, failed])
    assert batch.equals(reference_batch([empty, failed]))
    assert batch.column("support_ids").to_pylist() == [[], None]


def test_ipc_bytes_round_trip_and_value_types():
    samples = _samples([None, "support", "selected"], seed=3)
    logprobs = samples[1].support_logprobs
    logprobs[0][0] = -1e-45  # float32 subnormal rounding matches pa.array's
    samples[1].support_logprobs = logprobs
    samples[1].token_logprobs[0] = 0.1  # not exact in float32
    samples[1].token_ids[0] = 2**31 - 1
    schema = schema_with_metadata("tiny", "dflash", "dflash", "support", 8)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(to_record_batch(samples, schema))
    read = pa.ipc.open_stream(sink.getvalue()).read_all()
    assert read.equals(pa.Table.from_batches([reference_batch(samples, schema)]))
    with pytest.raises((OverflowError, ValueError, pa.ArrowInvalid)):
        samples[1].token_ids[0] = 2**31
        to_record_batch(samples)
