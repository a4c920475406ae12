"""Per-sample request state: tokens, KV bookkeeping, captured masks. Pure Python, no torch.

A `Sequence` is one (prompt, sample) of a request. The n samples of one prompt start as a
single sequence (sample 0) that prefills the prompt once; when its prompt is computed the
engine forks the other n-1 from it, sharing the prompt's KV blocks (see BlockManager.fork).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rollout.engine.params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # an entity: compared by identity (field-wise == made list.remove O(n * fields))
class Sequence:
    seq_id: int
    request_id: str
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    mask: str | None = None
    grammar: Any = None  # rollout.engine.grammar.GrammarState
    grammar_kind: str | None = None
    stop_matcher: Any = None  # rollout.engine.stops.StopMatcher when params.stop is set
    stop_reason: str | None = None  # the stop string that finished the sample
    return_text: bool = False  # decode the output into SampleOutput.text at the finish
    children: list[Sequence] = field(default_factory=list)  # samples forked once the prompt is computed
    started: bool = False  # admitted at least once (its tokens belong to policy_version)
    end_ids: tuple[int, ...] = ()  # EOS + stop_token_ids: banned by min_tokens, a grammar's ends
    stop_ids: frozenset[int] = frozenset()  # the tokens that finish this sample (EOS unless ignore_eos)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    support_parts: list | None = None  # per step: (PackedRows, first row, count) of committed tokens
    mask_bound: int = 0  # its support's bound when it asked for masks (top_k, 1 if greedy), else 0
    mask_error: str | None = None  # a committed support overflowed its bound: the sample fails
    accept_lengths: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # overlapped scheduling (rollout.engine.overlap): the entry of the step in flight whose sampled
    # token is this sample's next one, not read back yet (its slot holds a placeholder); -1: none
    pending_entry: int = -1
    # drafts that entry verifies: the sample commits up to this many tokens before its pending one, so
    # its length and positions from the pending token on are lower bounds by up to this many until then
    pending_drafts: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None

    def __post_init__(self):
        if self.mask:
            self.support_parts = []
            self.mask_bound = self.params.support_bound

    @property
    def num_tokens(self) -> int:
        """Prompt, output and the pending token, if any (its id is on the device only)."""
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Committed output tokens plus the pending one (`pending_entry`)."""
        return len(self.output_token_ids) + (self.pending_entry >= 0)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying both; the pending
        token's position holds a placeholder 0 (filled on the device: rollout.engine.overlap)."""
        n, known = len(self.prompt_token_ids), len(self.prompt_token_ids) + len(self.output_token_ids)
        if end > known:
            return self.tokens(start, known) + [0] * (end - max(start, known))
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output_tokens

    def behind_and_remaining(self) -> tuple[int, int]:
        """(tokens not computed yet, output tokens left): num_tokens - num_computed_tokens and
        remaining_tokens in one call (the draft budget reads both for every sample every step)."""
        output = self.num_output_tokens
        return len(self.prompt_token_ids) + output - self.num_computed_tokens, self.params.max_tokens - output
