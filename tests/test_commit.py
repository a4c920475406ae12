"""The step's bookkeeping after its host copy, without a model or an LLMEngine: the scheduler's
`advance` (computed counts, prefix registration, forks and the block copies they need) and
`truncate_drafts`, and the Committer (append up to the finish, fail a sample as a whole, emit
and release finished samples). The step layout is build_step's, on CPU; the host copy is
written by hand as the verifier would have left it."""

from __future__ import annotations

import torch

from rollout.engine.batch import build_step
from rollout.engine.block_manager import BlockManager
from rollout.engine.commit import Committer, HostStep
from rollout.engine.intake import Intake, Limits
from rollout.engine.params import SamplingParams
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import SeqStatus

EOS, STOP, BLOCK = 0, 9, 4


def make_parts(num_blocks: int = 16, num_spec: int = 0, max_model_len: int = 64, budget: int = 64):
    sched = Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs=8, max_num_batched_tokens=budget,
                      num_spec=num_spec)
    intake = Intake(sched, Limits(50, max_model_len, 8, 16), [EOS])
    return sched, intake, Committer(sched, intake, max_model_len, policy_version=lambda: 3)


def host(tokens, num_accepted=None, has_support=None) -> HostStep:
    """The host copy of a step whose entry e committed tokens[e] (num_accepted[e] drafts + 1)."""
    num_accepted = num_accepted or [len(t) - 1 for t in tokens]
    width = max(map(len, tokens))
    padded = [t + [-1] * (width - len(t)) for t in tokens]
    logprobs = [[-0.5 - 0.1 * j for j in range(width)] for _ in tokens]
    return HostStep(padded, logprobs, num_accepted, has_support or [True] * len(tokens), None)


def run_step(sched: Scheduler, committer: Committer, tokens, num_drafts=None, **kw):
    """One step's bookkeeping as LLMEngine.step orders it: advance, commit, truncate."""
    plan = sched.schedule()
    step = build_step(plan, num_drafts or [0] * len(plan), BLOCK, torch.device("cpu"))
    h = host(tokens, **kw) if tokens else None  # a step without entries has no host copy
    copies = sched.advance(plan, step.accepted_per_item(None if h is None else h.num_accepted))
    outputs = committer.commit(step.rows, h, None)
    sched.truncate_drafts(plan)
    return plan, copies, outputs


def test_a_prompts_last_chunk_forks_its_samples_with_the_block_copies_they_need():
    sched, intake, committer = make_parts()
    intake.add("r", [[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=4), n=3, mask=None, grammar=None)
    parent, *children = intake.requests["r"]
    plan, copies, outputs = run_step(sched, committer, [[11], [12], [13]])
    assert outputs == [] and sched.running == [parent, *children]
    # the prompt's full first block is shared, its partial second block copied into each child's own
    assert [c.block_table[0] for c in children] == [parent.block_table[0]] * 2
    assert copies == [(parent.block_table[1], c.block_table[1]) for c in children]
    assert all(c.num_computed_tokens == 6 and c.status is SeqStatus.RUNNING for c in children)
    assert parent.children == [] and parent.num_computed_tokens == 6
    assert [s.output_token_ids for s in (parent, *children)] == [[11], [12], [13]]
    assert len(sched.bm.hash_to_block) == 1  # the full prompt block is registered for reuse


def test_a_chunked_prompt_keeps_its_samples_until_its_last_chunk():
    sched, intake, committer = make_parts(budget=4)
    intake.add("r", [[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=4), n=2, mask=None, grammar=None)
    parent, child = intake.requests["r"]
    plan, copies, outputs = run_step(sched, committer, [])
    assert [it.num_new_tokens for it in plan] == [4]  # 4 of 6 prompt tokens: no sample yet
    assert copies == [] and parent.children == [child] and parent.num_computed_tokens == 4
    plan, copies, outputs = run_step(sched, committer, [[7], [8]])
    assert parent.children == [] and child in sched.running and len(copies) == 1


def test_accepted_drafts_advance_and_the_rest_of_the_reserved_blocks_is_freed():
    sched, intake, committer = make_parts(num_spec=6)
    intake.add("r", [[1, 2, 3]], SamplingParams(max_tokens=20), n=1, mask=None, grammar=None)
    (seq,) = intake.requests["r"]
    run_step(sched, committer, [[5]])  # prefill: 3 tokens, 1 block
    free = sched.bm.num_free_blocks
    plan, _, outputs = run_step(sched, committer, [[6, 7, 8]], num_drafts=[6])  # 2 of 6 drafts accepted
    assert plan[0].num_draft == 6 and outputs == []
    assert seq.num_computed_tokens == 3 + 1 + 2 and seq.output_token_ids == [5, 6, 7, 8]
    assert len(seq.block_table) == 2 and sched.bm.num_free_blocks == free - 1  # 7 tokens: 2 of the 3 blocks reserved


def test_a_stop_token_finishes_the_sample_and_releases_it():
    sched, intake, committer = make_parts()
    intake.add("r", [[1, 2]], SamplingParams(max_tokens=8, stop_token_ids=[STOP]), n=1, mask=None, grammar=None)
    (seq,) = intake.requests["r"]
    run_step(sched, committer, [[4]])
    _, _, outputs = run_step(sched, committer, [[5, STOP, 6]], num_drafts=[0])
    (out,) = outputs
    assert (out.token_ids, out.finish_reason, out.policy_version) == ([4, 5, STOP], "stop", 3)
    assert out.token_logprobs == [-0.5, -0.5, -0.6] and out.accept_lengths == [1, 2]
    assert seq.is_finished and seq.block_table == [] and sched.bm.num_free_blocks == 16
    assert intake.requests == {} and not sched.has_unfinished()


def test_max_tokens_and_the_context_cut_the_committed_tokens():
    sched, intake, committer = make_parts(max_model_len=5)
    intake.add("a", [[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True), n=1, mask=None, grammar=None)
    _, _, outputs = run_step(sched, committer, [[EOS, 7, 8, 9]], num_accepted=[3])
    (out,) = outputs
    assert (out.token_ids, out.finish_reason) == ([EOS, 7, 8], "length")
    sched, intake, committer = make_parts(max_model_len=4)
    intake.add("b", [[1, 2]], SamplingParams(max_tokens=2), n=1, mask=None, grammar=None)
    _, _, outputs = run_step(sched, committer, [[7, 8, 9]], num_accepted=[2])
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [([7, 8], "length")]


def test_a_row_without_support_fails_the_whole_sample():
    sched, intake, committer = make_parts()
    intake.add("r", [[1, 2]], SamplingParams(max_tokens=8), n=2, mask=None, grammar=None)
    _, _, outputs = run_step(sched, committer, [[4], [5]], has_support=[True, False])
    (out,) = outputs
    assert (out.sample_index, out.finish_reason, out.token_ids) == (1, "error", [])
    assert "no token is allowed at output position 0" in out.error
    assert [s.sample_index for s in intake.requests["r"]] == [0]
