"""The one Arrow schema of a rollout (docs/wire.md): one row per finished sample.

Everything that writes or reads rollout record batches imports it from here: the server,
`rollout generate`, the validator and trainer_client.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import pyarrow as pa

from rollout.masks.pack import Supports
from rollout.outputs import SampleOutput

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
VOCAB_SIZE_KEY = "vocab_size"  # every token id of the batch is in [0, vocab_size)
INSTANCE_ID_KEY = "instance_id"  # the server that sent the batch (its GetServerInfo instance_id)
POLICY_VERSION_KEY = "policy_version"  # the newest policy_version among the batch's rows


def schema_with_metadata(model: str, drafter: str, spec_method: str, mask_mode: str,
                         mask_top_k: int | None = None, vocab_size: int | None = None, *,
                         instance_id: str | None = None, policy_version: int | None = None) -> pa.Schema:
    """The rollout schema carrying the names docs/wire.md lists in its metadata, plus the
    request's support bound (top_k, 1 for greedy) when it asked for masks and the model's
    vocabulary size, so a validator can check widths and token ids without knowing the request
    or the model, and, from a server, the server's instance id and the batch's policy version, so a
    client can tell servers and weights apart."""
    values = (model, drafter, spec_method, mask_mode)
    meta = {k: str(v) for k, v in zip(METADATA_KEYS, values)}
    optional = ((MASK_TOP_K_KEY, mask_top_k), (VOCAB_SIZE_KEY, vocab_size), (INSTANCE_ID_KEY, instance_id),
                (POLICY_VERSION_KEY, policy_version))
    meta.update({k: str(v) for k, v in optional if v is not None})
    return ROLLOUT_SCHEMA.with_metadata(meta)


def to_record_batch(samples: Sequence[SampleOutput], schema: pa.Schema = ROLLOUT_SCHEMA) -> pa.RecordBatch:
    """Samples -> one record batch. Failed samples (`error` set) are not rows: the server
    reports them as a gRPC status instead.

    Each list column is one flat numpy array of values plus int32 offsets, filled in one pass
    over the Python numbers (no nested conversion, no per-row objects): the server runs this
    for every delivered sample while the engine thread wants the GIL.
    """
    arrays = [
        pa.array([s.request_id for s in samples], pa.string()),
        pa.array([s.prompt_index for s in samples], pa.int32()),
        pa.array([s.sample_index for s in samples], pa.int32()),
        _list_array([s.prompt_token_ids for s in samples], np.int32),
        _list_array([s.token_ids for s in samples], np.int32),
        _list_array([s.token_logprobs for s in samples], np.float32),
        *_support_arrays([s.supports for s in samples]),
        pa.array([s.finish_reason for s in samples], pa.string()),
        _list_array([s.accept_lengths for s in samples], np.int16),
        pa.array([s.policy_version for s in samples], pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_LIST_TYPES = {np.int16: pa.list_(pa.int16()), np.int32: pa.list_(pa.int32()), np.float32: pa.list_(pa.float32())}


def _list_array(rows: Sequence[Sequence], dtype: type[np.generic]) -> pa.ListArray:
    """Rows of numbers -> list<dtype>: values [sum of lengths] and offsets [len(rows) + 1]."""
    offsets = _offsets(np.fromiter(map(len, rows), np.int64, count=len(rows)))
    values = np.fromiter(chain.from_iterable(rows), dtype, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), type=_LIST_TYPES[dtype])


def _support_arrays(per_sample: Sequence[Supports | None]) -> tuple[pa.ListArray, pa.ListArray]:
    """The support_ids and support_logprobs columns from each sample's flat arrays (no Python
    numbers at all): a sample without masks is a null row in both, one without log-probs (mask
    mode "selected") a null row in the second."""
    ids = _nested_from_flat([(p.ids, p.lens) if p is not None else None for p in per_sample], pa.int32())
    logp = _nested_from_flat([(p.logprobs, p.lens) if p is not None and p.logprobs is not None else None
                              for p in per_sample], pa.float32())
    return ids, logp


def _nested_from_flat(per_sample: Sequence[tuple[np.ndarray, np.ndarray] | None], value_type) -> pa.ListArray:
    """Per sample None (a null row) or (flat values, per-token lengths) -> list<list<value_type>>."""
    present = [p for p in per_sample if p is not None]
    dtype = value_type.to_pandas_dtype()
    values = np.concatenate([v for v, _ in present]).astype(dtype, copy=False) if present else np.zeros(0, dtype)
    lens = np.concatenate([n for _, n in present]) if present else np.zeros(0, np.int32)
    inner_offsets = _offsets(lens)
    inner = pa.ListArray.from_arrays(pa.array(inner_offsets), pa.array(values, value_type),
                                     type=pa.list_(value_type))
    outer_offsets = _offsets(np.fromiter((0 if p is None else len(p[1]) for p in per_sample), np.int64,
                                         count=len(per_sample)))
    nulls = None
    if len(present) < len(per_sample):
        nulls = pa.array(np.fromiter((p is None for p in per_sample), np.bool_, count=len(per_sample)))
    return pa.ListArray.from_arrays(pa.array(outer_offsets), inner, type=pa.list_(inner.type), mask=nulls)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """[N] lengths -> [N + 1] int32 offsets, 0 first; list<> offsets are 32-bit."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("a record batch column holds 2**31 list values or more; send fewer rows")
    return offsets.astype(np.int32)
