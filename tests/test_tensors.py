"""trainer_client.tensors: padding of a hand-made table, and the mask replay reproducing the
log-probs (docs/sampling.md) of supports computed by hand from known logits, with gradients."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from rollout.outputs import SampleOutput
from rollout.schema import schema_with_metadata, to_record_batch
from trainer_client.tensors import masked_logprobs, to_torch

VOCAB, TEMPERATURE, TOP_K, TOP_P = 40, 0.7, 6, 0.8


def _contract1(z: np.ndarray, greedy: bool):
    """Support (sorted by prob desc, ties by id) and its log-probs: temperature, top-k, top-p."""
    if greedy:
        return [int(np.argmax(z))], [0.0]
    order = sorted(range(VOCAB), key=lambda t: (-z[t], t))[:TOP_K]
    scaled = z[order] / TEMPERATURE
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), TOP_P) + 1)  # shortest prefix reaching top_p
    kept = scaled[:keep]
    logp = kept - kept.max() - np.log(np.exp(kept - kept.max()).sum())
    return order[:keep], logp.tolist()


def _rollout(logits: np.ndarray, lens: list[int], greedy_rows: set[int], mode: str):
    rng = np.random.default_rng(1)
    samples = []
    for b, n in enumerate(lens):
        s = SampleOutput(
            f"req{b}", b // 2, b % 2, prompt_token_ids=list(range(1, 2 + b)), policy_version=3 + b
        )
        support_ids, support_logprobs = [], []
        for j in range(n):
            ids, logp = _contract1(logits[b, j], b in greedy_rows)
            pick = int(rng.integers(len(ids)))
            s.token_ids.append(ids[pick])
            s.token_logprobs.append(logp[pick])
            support_ids.append(ids)
            support_logprobs.append(logp)
        s.support_ids = support_ids if mode else None
        s.support_logprobs = support_logprobs if mode == "support" else None
        s.finish_reason, s.accept_lengths = "stop", [n]
        samples.append(s)
    schema = schema_with_metadata("tiny", "none", "none", mode)
    return pa.Table.from_batches([to_record_batch(samples, schema)]), samples


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(scale=2.0, size=(4, 7, VOCAB)).astype(np.float32)


def test_to_torch_shapes_and_padding(logits):
    table, samples = _rollout(logits, [5, 7, 2, 4], {2}, "support")
    batch = to_torch(table)
    assert batch.prompt_ids.shape == (4, 4) and batch.prompt_ids.dtype == torch.int64
    assert batch.prompt_ids[0].tolist() == [1, -1, -1, -1] and batch.prompt_lens.tolist() == [1, 2, 3, 4]
    assert batch.token_ids.shape == (4, 7) and batch.token_ids[2, 2:].tolist() == [0] * 5
    assert batch.loss_mask.sum(-1).tolist() == [5, 7, 2, 4] and batch.loss_mask.dtype == torch.bool
    width = max(len(ids) for s in samples for ids in s.support_ids)
    assert batch.support_ids.shape == (4, 7, width) == batch.support_logprobs.shape
    for b, s in enumerate(samples):
        assert batch.token_ids[b, : len(s.token_ids)].tolist() == s.token_ids
        assert torch.allclose(batch.token_logprobs[b, : len(s.token_ids)], torch.tensor(s.token_logprobs))
        for j, ids in enumerate(s.support_ids):
            assert batch.support_ids[b, j].tolist() == ids + [-1] * (width - len(ids))
            assert torch.isinf(batch.support_logprobs[b, j, len(ids) :]).all()
    assert (batch.support_ids[0, 5:] == -1).all() and (batch.token_logprobs[2, 2:] == 0).all()
    assert batch.policy_version.tolist() == [3, 4, 5, 6]
    assert (batch.request_id, batch.prompt_index, batch.sample_index) == (
        ["req0", "req1", "req2", "req3"],
        [0, 0, 1, 1],
        [0, 1, 0, 1],
    )
    sliced = to_torch(pa.concat_tables([table.slice(0, 1), table.slice(1, 3)]).slice(1, 2))
    assert torch.equal(sliced.support_ids, batch.support_ids[1:3, :, : sliced.support_ids.shape[2]])


def test_modes_select_columns(logits):
    selected = to_torch(_rollout(logits, [3, 2], set(), "selected")[0])
    assert selected.support_ids is not None and selected.support_logprobs is None
    moved = selected.to("cpu")
    assert torch.equal(moved.support_ids, selected.support_ids) and moved.support_logprobs is None
    assert moved.request_id == selected.request_id
    plain = to_torch(_rollout(logits, [3, 2], set(), "")[0])
    assert plain.support_ids is None and plain.support_logprobs is None


def test_mixed_masks_are_refused(logits):
    table, _ = _rollout(logits, [3, 2], set(), "selected")
    plain, _ = _rollout(logits, [3, 2], set(), "")
    with pytest.raises(ValueError, match="support_ids"):
        to_torch(pa.concat_tables([table, plain.cast(table.schema)]))


def test_masked_logprobs_reproduce_rollout(logits):
    table, samples = _rollout(logits, [5, 7, 2, 4], {2}, "selected")
    batch = to_torch(table)
    z = torch.tensor(logits, requires_grad=True)
    logp = masked_logprobs(z, batch, temperature=TEMPERATURE)
    assert logp.shape == (4, 7)
    torch.testing.assert_close(
        logp[batch.loss_mask], batch.token_logprobs[batch.loss_mask], atol=1e-5, rtol=0
    )
    assert (logp[2, :2] == 0).all()  # greedy singletons, exactly
    assert (logp[~batch.loss_mask] == 0).all()


def test_gradients_flow_inside_support_only(logits):
    table, samples = _rollout(logits, [5, 7, 2, 4], {2}, "support")
    batch = to_torch(table)
    z = torch.tensor(logits, requires_grad=True)
    masked_logprobs(z, batch, temperature=TEMPERATURE).sum().backward()
    grad = z.grad
    assert torch.isfinite(grad).all()
    b, j = 1, 3
    support = samples[b].support_ids[j]
    p = np.exp(samples[b].support_logprobs[j])
    expected = torch.zeros(VOCAB)
    expected[support] = -torch.tensor(p, dtype=torch.float32) / TEMPERATURE
    expected[samples[b].token_ids[j]] += 1 / TEMPERATURE
    torch.testing.assert_close(grad[b, j], expected, atol=1e-5, rtol=0)
    assert (grad[2, :2] == 0).all() and (grad[0, 5:] == 0).all()  # singletons and padding


def test_without_masks_is_plain_log_softmax(logits):
    batch = to_torch(_rollout(logits, [3, 2], set(), "")[0])
    z = torch.tensor(logits[:2, :3])
    logp = masked_logprobs(z, batch, temperature=2.0)
    full = torch.log_softmax(z / 2.0, dim=-1).gather(-1, batch.token_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logp, torch.where(batch.loss_mask, full, 0.0))
    with pytest.raises(ValueError, match="temperature"):
        masked_logprobs(z, batch, temperature=0.0)
    with pytest.raises(ValueError, match="logits"):
        masked_logprobs(torch.tensor(logits[:2]), batch)


@pytest.mark.parametrize("column, bad", [("support_ids", -5), ("support_ids", 2_080_374_867),
                                         ("support_ids", VOCAB), ("token_ids", -1), ("token_ids", VOCAB)])
def test_ids_outside_the_vocabulary_are_refused_before_gathering(logits, column, bad):
    """An out-of-range gather is a device-side assert on CUDA: refused with the id and the range."""
    table, _ = _rollout(logits, [3, 2], set(), "support")
    batch = to_torch(table)
    getattr(batch, column)[1, 1, ...] = bad  # (a real position, inside its support's row)
    with pytest.raises(ValueError, match=rf"{column} holds id {bad}, outside the logits' vocabulary \[0, {VOCAB}\)"):
        masked_logprobs(torch.tensor(logits[:2, :3]), batch)
