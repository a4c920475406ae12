"""Intake (rollout.engine.intake) on its own: a real Scheduler and BlockManager, no model and no
LLMEngine. A request becomes n samples per prompt with per-sample seeds, the first of each
prompt queued with the others as its children; every refusal names its field and leaves nothing
queued; finished samples leave the request's bookkeeping."""

from __future__ import annotations

import pytest

from rollout.engine.block_manager import BlockManager
from rollout.engine.intake import Intake, Limits, sample_seed
from rollout.engine.params import SamplingParams
from rollout.engine.scheduler import Scheduler
from rollout.errors import Aborted, InvalidArgument, ResourceExhausted

EOS = 0
SHORT = SamplingParams(max_tokens=4)
LIMITS = Limits(vocab_size=50, max_model_len=32, max_mask_tokens=8, max_queued_samples=6)


def make_intake(limits: Limits = LIMITS) -> Intake:
    return Intake(Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64), limits, [EOS])


def test_a_request_becomes_n_samples_per_prompt_with_their_seeds():
    intake = make_intake()
    params = SamplingParams(top_k=5, max_tokens=4, stop_token_ids=[7], seed=11)
    intake.add("r", [[1, 2, 3], [4, 5]], params, n=2, mask="support", grammar=None)
    first = list(intake.scheduler.waiting)
    assert [s.prompt_token_ids for s in first] == [[1, 2, 3], [4, 5]]
    samples = intake.requests["r"]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s.children for s in first] == [[samples[1]], [samples[3]]]
    assert [s.seed for s in samples] == [sample_seed(11, p, i) for p in range(2) for i in range(2)]
    assert all(s.mask == "support" and s.mask_bound == params.top_k and s.support_parts == [] for s in samples)
    assert all(s.end_ids == (EOS, 7) and s.stop_ids == {EOS, 7} for s in samples)
    assert intake.num_unfinished == 4


def test_ignore_eos_keeps_only_the_stop_ids():
    intake = make_intake()
    intake.add("r", [[1]], SamplingParams(max_tokens=2, stop_token_ids=[7], ignore_eos=True), 1, None, None)
    (seq,) = intake.requests["r"]
    assert seq.stop_ids == {7} and seq.end_ids == (EOS, 7)  # min_tokens still bans EOS


@pytest.mark.parametrize("field, request_id, prompts, params, n, mask", [
    ("request_id", "", [[1]], SHORT, 1, None),
    ("prompts", "r", [], SHORT, 1, None),
    ("n", "r", [[1]], SHORT, 0, None),
    ("prompts[1]", "r", [[1], []], SHORT, 1, None),
    ("prompts[0]", "r", [[1, 50]], SHORT, 1, None),
    ("prompts[0]", "r", [[1] * 30], SamplingParams(max_tokens=3), 1, None),
    ("prompts[0]", "r", [[1]], SamplingParams(), 1, None),  # max_tokens 64 > the context of 32
    ("top_k", "r", [[1]], SamplingParams(top_k=9, max_tokens=4), 1, "selected"),
    ("temperature", "r", [[1]], SamplingParams(temperature=-1.0, max_tokens=4), 1, None),
])
def test_a_refused_request_names_its_field_and_queues_nothing(field, request_id, prompts, params, n, mask):
    intake = make_intake()
    with pytest.raises(InvalidArgument) as err:
        intake.add(request_id, prompts, params, n, mask, None)
    assert err.value.field == field
    assert intake.requests == {} and intake.num_unfinished == 0 and not intake.scheduler.has_unfinished()


def test_a_running_request_id_and_a_full_queue_are_refused():
    intake = make_intake()
    intake.add("a", [[1], [2]], SHORT, n=2, mask=None, grammar=None)
    with pytest.raises(Aborted, match="'a' is still running"):  # retryable: the one id check
        intake.add("a", [[3]], SHORT, 1, None, None)
    with pytest.raises(ResourceExhausted, match="max_queued_samples=6"):
        intake.add("b", [[3]], SHORT, n=3, mask=None, grammar=None)
    assert set(intake.requests) == {"a"} and intake.num_unfinished == 4 and len(intake.scheduler.waiting) == 2


def test_done_forgets_a_sample_and_then_its_request():
    intake = make_intake()
    intake.add("r", [[1]], SHORT, n=2, mask=None, grammar=None)
    first, second = intake.requests["r"]
    intake.done(first)
    intake.done(first)  # twice: nothing more
    assert intake.requests["r"] == [second] and intake.num_unfinished == 1
    assert intake.pop_unfinished("r") == [second]
    intake.done(second)
    assert intake.requests == {} and intake.num_unfinished == 0
