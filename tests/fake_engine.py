"""A small fake engine for the server's tests: it obeys the engine API (rollout.engine.engine.
LLMEngine) with trivial arithmetic in place of a model, the real byte-level tokenizer of the
embedded models (id i = byte i) and the engine's refusals (InvalidArgument naming the field,
ResourceExhausted, Aborted for a running request id). Module-level, so that an engine process
can build one too."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from rollout.engine.params import validate_mask_request
from rollout.errors import Aborted, InvalidArgument, ResourceExhausted
from rollout.outputs import SampleOutput

VOCAB, EOS, MAX_LEN, TOTAL_BLOCKS, MAX_QUEUED = 264, 256, 64, 512, 300
BYTE_TOKENIZER = Path(__file__).resolve().parents[1] / "rollout" / "assets" / "tiny-qwen3" / "tokenizer.json"
FAIL_TOKEN = 13  # a logit_bias on this id makes the fake fail the sample (a "mask overflow")


class FakeEngine:
    """Each step appends one token to every running sample: token = f(prompt, sample, position,
    weights). One KV block per running sample. Weight updates wait for running samples to drain."""

    vocab_size, eos_token_ids, model_name, drafter_name, max_model_len = VOCAB, [EOS], "fake", "none", MAX_LEN

    def __init__(self, step_s: float = 0.002):
        self.tokenizer = Tokenizer.from_file(str(BYTE_TOKENIZER))  # id i = byte i, like the fake's vocabulary
        self.policy_version, self.weights, self.pending = 0, {"w": torch.zeros(4, 4)}, None
        self.running: dict[tuple[str, int, int], dict] = {}
        self.step_s, self.thread = step_s, None

    def _check_thread(self) -> None:
        self.thread = self.thread or threading.get_ident()
        assert self.thread == threading.get_ident(), "engine called from two threads"

    def add_request(self, request_id, prompts, params, n=1, mask=None, grammar=None) -> None:
        self._check_thread()
        if any(key[0] == request_id for key in self.running):
            raise Aborted(f"request_id: {request_id!r} is still running")
        params.validate(VOCAB)
        validate_mask_request(mask, params, 8)
        if not prompts:
            raise InvalidArgument("prompts", "must not be empty")
        if n < 1:
            raise InvalidArgument("n", f"must be >= 1, got {n}")
        for i, prompt in enumerate(prompts):
            if not prompt or len(prompt) + params.max_tokens > MAX_LEN:
                raise InvalidArgument(f"prompts[{i}]", "empty or too long for the context")
            if any(not 0 <= t < VOCAB for t in prompt):
                raise InvalidArgument(f"prompts[{i}]", "token id outside the vocabulary")
        if grammar is not None and grammar.kind not in ("json_schema", "regex", "ebnf"):
            raise InvalidArgument("grammar", f"unknown kind {grammar.kind!r}")
        if len(self.running) + len(prompts) * n > MAX_QUEUED:
            raise ResourceExhausted("queue full")
        for p, prompt in enumerate(prompts):
            for s in range(n):
                self.running[(request_id, p, s)] = dict(
                    prompt=list(prompt), params=params, mask=mask, tokens=[]
                )

    def step(self) -> list[SampleOutput]:
        self._check_thread()
        time.sleep(self.step_s)
        if self.pending is not None and not self.running:
            self.weights.update(self.pending)
            self.pending, self.policy_version = None, self.policy_version + 1
        finished = []
        for key, st in list(self.running.items()):
            shift = int(self.weights["w"].sum().item())
            st["tokens"].append((sum(st["prompt"]) + key[2] + len(st["tokens"]) + shift) % 200)
            if FAIL_TOKEN in st["params"].logit_bias or len(st["tokens"]) >= st["params"].max_tokens:
                finished.append(self._output(key, self.running.pop(key), "length"))
        return finished

    def _output(self, key, st, reason) -> SampleOutput:
        out = SampleOutput(key[0], key[1], key[2], st["prompt"], st["tokens"], [-0.5] * len(st["tokens"]))
        out.finish_reason, out.accept_lengths, out.policy_version = (
            reason,
            [1] * len(st["tokens"]),
            self.policy_version,
        )
        if st["mask"]:
            out.support_ids = [[t, t + 1] for t in st["tokens"]]
        if st["mask"] == "support":
            out.support_logprobs = [[math.log(0.6), math.log(0.4)] for _ in st["tokens"]]
        if FAIL_TOKEN in st["params"].logit_bias:
            out.error, out.finish_reason = "support wider than max_mask_tokens", "error"
        return out

    def abort(self, request_id) -> list[SampleOutput]:
        self._check_thread()
        keys = [k for k in self.running if k[0] == request_id]
        return [self._output(k, self.running.pop(k), "abort") for k in keys]

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def kv_blocks(self) -> tuple[int, int]:
        return TOTAL_BLOCKS - len(self.running), TOTAL_BLOCKS

    def info(self) -> dict:
        limits = dict(max_mask_tokens=8, max_queued_samples=MAX_QUEUED, max_model_len=MAX_LEN)
        return dict(model="fake", vocab_size=VOCAB, eos_token_ids=[EOS], spec_method="none", block_size=16,
                    limits=limits, policy_version=self.policy_version, kv=self.kv_blocks())  # fmt: skip

    def update_weights(self, state, draft_state=None) -> None:
        self._check_thread()
        for name, t in state.items():
            if name not in self.weights or t.shape != self.weights[name].shape:
                raise InvalidArgument(f"tensor {name}", f"unknown or wrong shape {list(t.shape)}")
        self.pending = dict(state)

    def weight_update_pending(self) -> bool:
        return self.pending is not None

    def compiled(self) -> dict[str, int]:
        return dict(graphs=0, kernels=0)
