"""Admission of a Generate request in the server's process, before the engine sees it.

Prompts are measured before anything large is copied or tokenised, and refused at once when they
cannot fit the context: `token_ids` longer than it, and text too long for it. A token stands for
at most L bytes of text, L being the longest token of the vocabulary in UTF-8 bytes (its string
form is never shorter than the text it stands for: byte-level, metaspace and byte-fallback
vocabularies alike), times 3 when the tokenizer normalises (Unicode composition shrinks text by
at most that: three 3-byte Hangul jamo become one 3-byte syllable). So text of B bytes needs at
least ceil(B / L) tokens. Text that may fit is tokenised here, on a worker thread (`encode_batch`
releases the GIL), never on the engine's thread: a slow admission delays its own request, no step.
Chat messages are rendered with the model's chat template and tokenised on that thread too
(rollout.engine.chat.prompt_token_ids), then measured. The engine checks every prompt again,
exactly (with max_tokens), once it is tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout.engine.chat import ChatPrompt, ChatTemplate, prompt_token_ids
from rollout.errors import InvalidArgument
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.server.convert import GenerateCall, parse_generate

NORMALIZATION_SHRINK = 3


def longest_token_bytes(tokenizer: Any) -> int:
    """L above: the most bytes of input text one token can stand for."""
    longest = max(len(token.encode()) for token in tokenizer.get_vocab(with_added_tokens=True))
    return longest * (NORMALIZATION_SHRINK if tokenizer.normalizer is not None else 1)


def engine_prompt_setup(engine) -> tuple[Any, int, ChatTemplate | None]:
    """(tokenizer or None, context in tokens, chat template or None): module-level, it may run in
    the engine's process."""
    return engine.tokenizer, engine.max_model_len, engine.chat_template


class Admission:
    """Turns a GenerateRequest into a GenerateCall whose prompts are all token ids."""

    def __init__(self, tokenizer: Any, context: int, chat_template: ChatTemplate | None = None):
        self.tokenizer = tokenizer
        self.context = context
        self.chat_template = chat_template
        self.token_bytes = longest_token_bytes(tokenizer) if tokenizer is not None else 0

    def parse(self, request: pb.GenerateRequest) -> GenerateCall:
        """Refuses prompts that cannot fit (naming the prompt), then copies the request."""
        for index, prompt in enumerate(request.prompts):
            kind = prompt.WhichOneof("kind")
            if kind == "token_ids":
                self._check_tokens(f"prompts[{index}].token_ids", len(prompt.token_ids.ids))
            elif kind == "text":
                self._check_text(index, _utf8_length(prompt.text))
        return parse_generate(request)

    async def tokenize(self, call: GenerateCall) -> None:
        """Replaces the call's text and chat prompts by their token ids, on a worker thread."""
        pending = [i for i, prompt in enumerate(call.prompts) if isinstance(prompt, str | ChatPrompt)]
        if not pending:
            return
        token_ids = await asyncio.to_thread(self._token_ids, [(i, call.prompts[i]) for i in pending])
        for i, ids in zip(pending, token_ids):
            kind = "text" if isinstance(call.prompts[i], str) else "messages"
            self._check_tokens(f"prompts[{i}].{kind}", len(ids))
            call.prompts[i] = ids

    def _token_ids(self, prompts: list[tuple[int, str | ChatPrompt]]) -> list[list[int]]:
        """Texts in one `encode_batch`; chats rendered with the template, one by one."""
        texts = [prompt for _, prompt in prompts if isinstance(prompt, str)]
        encoded = iter(self.tokenizer.encode_batch(texts) if texts else ())
        return [next(encoded).ids if isinstance(prompt, str)
                else prompt_token_ids(self.tokenizer, self.chat_template, i, prompt)
                for i, prompt in prompts]  # fmt: skip

    def _check_tokens(self, field: str, count: int) -> None:
        if count > self.context:
            raise InvalidArgument(field, f"{count} tokens exceed the context of {self.context} tokens")

    def _check_text(self, index: int, nbytes: int) -> None:
        field = f"prompts[{index}].text"
        if self.tokenizer is None:
            raise InvalidArgument(field, "the model has no tokenizer (tokenizer.json): send token_ids")
        least = -(-nbytes // self.token_bytes)
        if least > self.context:
            raise InvalidArgument(
                field, f"{nbytes} bytes need at least {least} tokens (at most {self.token_bytes} bytes "
                f"a token), more than the context of {self.context} tokens")


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())
