"""Requests entering the engine: validation before any work, samples and their seeds,
grammar states, and the bookkeeping of which samples each request still has running."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from rollout.engine.params import SamplingParams, validate_mask_request
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import Sequence
from rollout.errors import Aborted, InvalidArgument, ResourceExhausted

_M64 = (1 << 64) - 1


def sample_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """splitmix64 of (base, prompt, sample): distinct, reproducible per-sample seeds."""
    x = (base ^ (prompt_index * 0x9E3779B97F4A7C15) ^ (sample_index * 0xBF58476D1CE4E5B9)) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) >> 1  # 63 bits


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's vocabulary and context, the engine's bounds."""

    vocab_size: int
    max_model_len: int
    max_mask_tokens: int
    max_queued_samples: int


class Intake:
    """Admits requests into `scheduler` (n samples per prompt, the first of each prompt queued, the
    others forked from it once its prompt is computed). `tokenizer` and `eos_token_ids` build the
    grammar compiler on the first grammar request; `rng` draws the base seed of unseeded ones."""

    def __init__(self, scheduler: Scheduler, limits: Limits, eos_token_ids: Iterable[int], tokenizer=None,
                 rng: random.Random | None = None):
        self.scheduler, self.limits = scheduler, limits
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.rng = rng or random.Random()
        self.requests: dict[str, list[Sequence]] = {}
        self.num_unfinished = 0
        self._next_id = 0
        self._grammars = None

    def add(self, request_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
            mask: str | None, grammar) -> None:
        limits = self.limits
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id", "must be a non-empty string")
        if request_id in self.requests:  # (the one check: the server's layers rely on it)
            raise Aborted(f"request_id: {request_id!r} is still running; retry once it has finished or "
                          f"its abort has been handled")
        if not prompts:
            raise InvalidArgument("prompts", "at least one prompt is required")
        if not isinstance(n, int) or n < 1:
            raise InvalidArgument("n", f"must be an integer >= 1, got {n!r}")
        params.validate(limits.vocab_size)
        validate_mask_request(mask or None, params, limits.max_mask_tokens)
        for i, prompt in enumerate(prompts):
            self._check_prompt(i, prompt, params)
        if grammar is not None:
            if params.ignore_eos:
                raise InvalidArgument("ignore_eos", "cannot be combined with a grammar: a grammar-constrained "
                                                    "sample ends where its grammar ends (EOS or a stop token)")
            self.grammars().compile(grammar)  # refuses a grammar that does not compile
        total = n * len(prompts)
        if self.num_unfinished + total > limits.max_queued_samples:
            raise ResourceExhausted(
                f"queue full: {self.num_unfinished} samples queued, {total} more would exceed "
                f"max_queued_samples={limits.max_queued_samples}")
        base = params.seed if params.seed is not None else self.rng.getrandbits(63)
        seqs = []
        for p, prompt in enumerate(prompts):
            group = [self.new_sequence(request_id=request_id, prompt_index=p, sample_index=s,
                                       prompt_token_ids=list(prompt), params=params,
                                       seed=sample_seed(base, p, s), mask=mask or None,
                                       grammar=None)
                     for s in range(n)]
            if grammar is not None:
                for seq in group:
                    seq.grammar = self.grammars().new_state(grammar, seq.end_ids)
            group[0].children = group[1:]
            self.scheduler.add(group[0])
            seqs += group
        self.requests[request_id] = seqs
        self.num_unfinished += total

    def _check_prompt(self, i: int, prompt, params: SamplingParams) -> None:
        vocab_size, max_model_len = self.limits.vocab_size, self.limits.max_model_len
        if not prompt:
            raise InvalidArgument(f"prompts[{i}]", "is empty")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"prompts[{i}]",
                                  f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
        if len(prompt) + params.max_tokens > max_model_len:
            raise InvalidArgument(
                f"prompts[{i}]", f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed "
                f"the context of {max_model_len} tokens")

    def new_sequence(self, **kw) -> Sequence:
        self._next_id += 1
        return new_sequence(self._next_id, self.eos_token_ids, **kw)

    def done(self, seq: Sequence) -> None:
        seqs = self.requests.get(seq.request_id)
        if seqs is None or seq not in seqs:
            return
        seqs.remove(seq)
        self.num_unfinished -= 1
        if not seqs:
            del self.requests[seq.request_id]

    def pop_unfinished(self, request_id: str) -> list[Sequence]:
        return list(self.requests.get(request_id, []))

    def grammars(self):
        if self._grammars is None:
            from rollout.engine.grammar import GrammarCompilerCache

            self._grammars = GrammarCompilerCache(self.tokenizer, self.limits.vocab_size, self.eos_token_ids)
        return self._grammars


def new_sequence(seq_id: int, eos_token_ids: tuple[int, ...], **kw) -> Sequence:
    """A `Sequence` (fields `kw`) with the token ids that end it: its stop tokens and, unless its
    params ignore EOS, the model's EOS tokens."""
    seq = Sequence(seq_id=seq_id, **kw)
    sp = seq.params
    seq.end_ids = tuple(dict.fromkeys([*eos_token_ids, *sp.stop_token_ids]))
    seq.stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(eos_token_ids))
    return seq
