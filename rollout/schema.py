"""The one Arrow schema of a rollout (DESIGN.md Contract 4): one row per finished sample.

Everything that writes or reads rollout record batches imports it from here: the server,
`rollout generate`, the validator and trainer_client.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from rollout.engine.outputs import SampleOutput

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int32(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("token_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("support_ids", pa.list_(pa.list_(pa.int32())), nullable=True),
        pa.field("support_logprobs", pa.list_(pa.list_(pa.float32())), nullable=True),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("accept_lengths", pa.list_(pa.int16()), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
    ]
)

METADATA_KEYS = ("model", "drafter", "spec_method", "mask_mode")
MASK_TOP_K_KEY = "mask_top_k"  # the widest support a masked row of this batch may have


def schema_with_metadata(model: str, drafter: str, spec_method: str, mask_mode: str,
                         mask_top_k: int | None = None) -> pa.Schema:
    """The rollout schema carrying the names DESIGN.md asks for in its metadata, plus the
    request's support bound (top_k, 1 for greedy) when it asked for masks, so a validator can
    check widths without knowing the request."""
    values = (model, drafter, spec_method, mask_mode)
    meta = {k: str(v) for k, v in zip(METADATA_KEYS, values)}
    if mask_top_k is not None:
        meta[MASK_TOP_K_KEY] = str(mask_top_k)
    return ROLLOUT_SCHEMA.with_metadata(meta)


def to_record_batch(samples: Sequence[SampleOutput], schema: pa.Schema = ROLLOUT_SCHEMA) -> pa.RecordBatch:
    """Samples -> one record batch. Failed samples (`error` set) are not rows: the server
    reports them as a gRPC status instead."""
    cols = {
        "request_id": [s.request_id for s in samples],
        "prompt_index": [s.prompt_index for s in samples],
        "sample_index": [s.sample_index for s in samples],
        "prompt_token_ids": [s.prompt_token_ids for s in samples],
        "token_ids": [s.token_ids for s in samples],
        "token_logprobs": [s.token_logprobs for s in samples],
        "support_ids": [s.support_ids for s in samples],
        "support_logprobs": [s.support_logprobs for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
        "accept_lengths": [s.accept_lengths for s in samples],
        "policy_version": [s.policy_version for s in samples],
    }
    arrays = [pa.array(cols[f.name], type=f.type) for f in ROLLOUT_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
