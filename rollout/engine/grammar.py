"""Grammar-constrained decoding through xgrammar, shaped for speculative verify.

A request may carry a `GrammarSpec` (a JSON schema, a regex or an EBNF grammar).
`GrammarCompilerCache` builds xgrammar's tokenizer info from the model's tokenizer once and
compiles each distinct grammar once (LRU). Every sequence with a grammar owns a
`GrammarState`: before verify it fills one bitmask row per verify position (the grammar
state after the committed prefix plus d_1..d_{i-1}), tentatively accepting the drafts and
rolling them back, so a draft the grammar rejects becomes an ordinary rejection; after
verify it commits what was accepted. `apply_bitmask` sets disallowed logits to -inf on the
device (docs/sampling.md, step 1: the grammar is one of the processors).

Special tokens (MASK, padding, reserved, EOS) enter xgrammar with an empty spelling, which
makes them special: never allowed inside the grammar's text; stop tokens only where the
grammar may end. Needs an xgrammar whose matcher rollback is unbounded (mlc-ai/xgrammar#385;
tested with 0.2.9): older releases bounded it by `max_rollback_tokens`.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer
from torch import Tensor

from rollout.errors import GrammarRejected, InvalidArgument

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgrammar():
    """xgrammar, imported on first use: it pulls in transformers, slow to import, which a process
    that never sees a grammar (every engine process, the CLI) should not pay for at start."""
    import xgrammar

    return xgrammar

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
# Whitespace between JSON elements is bounded: a sampled policy can otherwise spend its whole
# token budget on blanks the schema allows, a degenerate loop RL rollouts hit in practice.
MAX_JSON_WHITESPACE = 4
_XGR_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar: `kind` in GRAMMAR_KINDS, `value` the schema / regex / EBNF text."""

    kind: str
    value: str

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidArgument("grammar", f"kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str) or not self.value.strip():
            raise InvalidArgument("grammar", f"{self.kind} must be a non-empty string")


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map of byte-level BPE, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return [chars[b] for b in range(256)]


def build_tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], special_ids: Iterable[int] = ()
) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` over the model's `vocab_size` ids (the logits' width).

    Ids that are special (marked so in tokenizer.json, listed in `special_ids` or
    `eos_token_ids`, or beyond the tokenizer's vocabulary) get an empty spelling; non-special
    added tokens are spelled in the vocabulary's own encoding.
    """
    xgr = _xgrammar()
    # xgrammar's own reading of a tokenizer.json (vocab type, prefix space); private but stable.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    added = tokenizer.get_added_tokens_decoder()
    special = {i for i, tok in added.items() if tok.special} | set(special_ids) | set(eos_token_ids)
    alphabet = byte_level_alphabet() if meta["vocab_type"] == xgr.VocabType.BYTE_LEVEL else None
    encoded = []
    for i in range(vocab_size):
        token = tokenizer.id_to_token(i)
        if token is None or i in special:
            token = ""
        elif i in added and alphabet is not None:
            token = "".join(alphabet[b] for b in added[i].content.encode())
        encoded.append(token)
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
        add_prefix_space=meta["add_prefix_space"],
    )


class GrammarCompilerCache:
    """Compiles grammars for one tokenizer, once per distinct `GrammarSpec` (LRU, thread-safe)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        special_ids: Iterable[int] = (),
        capacity: int = 128,
        max_threads: int = 1,
    ):
        if not eos_token_ids:
            raise InvalidArgument("eos_token_ids", "a grammar needs at least one stop token")
        self.vocab_size = vocab_size
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, eos_token_ids, special_ids)
        self._compiler = _xgrammar().GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )
        self._capacity = capacity
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; raises InvalidArgument("grammar", ...) if it does not compile."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_schema":
                json.loads(spec.value)
                return self._compiler.compile_json_schema(spec.value, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            return self._compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as e:
            message = _XGR_LOG_PREFIX.sub("", str(e).strip()).splitlines()[0]
            raise InvalidArgument("grammar", f"{spec.kind} does not compile: {message}") from e

    def new_state(self, spec: GrammarSpec, stop_token_ids: Sequence[int] | None = None) -> GrammarState:
        """A fresh per-sequence state; `stop_token_ids` overrides the EOS ids as the grammar's ends."""
        return GrammarState(self.compile(spec), self.vocab_size, stop_token_ids)


class GrammarState:
    """One sequence's grammar matcher, kept at the committed prefix between steps."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_token_ids: Sequence[int] | None = None
    ):
        self._matcher = _xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.vocab_size = vocab_size
        self._stop_only = torch.zeros(bitmask_width(vocab_size), dtype=torch.int32)  # [W]
        for t in self._matcher.stop_token_ids:
            self._stop_only[t >> 5] |= _bit(t)

    def fill_verify_bitmask(self, draft_tokens: Sequence[int], bitmask: Tensor, first_row: int) -> None:
        """Fill rows first_row .. first_row + len(draft_tokens) of `bitmask` ([R, W] int32, CPU).

        Row i allows what the grammar allows after the committed prefix + draft_tokens[:i]. At
        the first draft the grammar rejects, the rows after it copy its row (verification rejects
        there, so they are never used); after an accepted stop token only stop tokens are
        allowed. The matcher ends where it started.
        """
        accepted = 0
        last = first_row + len(draft_tokens)
        for i, token in enumerate(draft_tokens):
            row = first_row + i
            self._fill_row(bitmask, row)
            ended = self._matcher.is_terminated()  # nothing follows a stop token
            if ended or not (self._allows(bitmask[row], token) and self._matcher.accept_token(token)):
                bitmask[row + 1 : last + 1] = bitmask[row]
                break
            accepted += 1
        else:
            self._fill_row(bitmask, last)
        if accepted:
            self._matcher.rollback(accepted)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance past the tokens verification committed (grammar-valid by construction)."""
        for token in tokens:
            if not self._matcher.accept_token(token):
                raise GrammarRejected(f"grammar rejected committed token {token}: its bitmask was not applied")

    def is_terminated(self) -> bool:
        """True once a stop token was committed."""
        return self._matcher.is_terminated()

    def _fill_row(self, bitmask: Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            bitmask[row] = self._stop_only
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _allows(self, row: Tensor, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool(row[token >> 5].item() & _bit(token))


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return math.ceil(vocab_size / 32)


def allocate_bitmask(rows: int, vocab_size: int) -> Tensor:
    """A host bitmask [rows, ceil(V/32)] int32, all allowed; pinned where CUDA is present so the
    upload can be asynchronous. Do not refill it before the step that read it has synchronised."""
    pin = torch.cuda.is_available()
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def upload_bitmask(bitmask: Tensor, device: torch.device | str) -> Tensor:
    """Host -> device copy that does not block the host (from pinned memory)."""
    return bitmask.to(device, non_blocking=True)


def apply_bitmask(logits: Tensor, bitmask: Tensor, row_has_grammar: Tensor | None = None) -> None:
    """In place: logits of tokens a row's bitmask disallows become -inf.

    logits: [N, V] float; bitmask: [N, ceil(V/32)] int32 on the logits' device;
    row_has_grammar: [N] bool (None = every row), rows without a grammar are left alone.
    CPU uses xgrammar's kernel; other devices a vectorised torch fallback with no host sync.
    """
    n, v = logits.shape
    if bitmask.shape != (n, bitmask_width(v)):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit logits {tuple(logits.shape)}")
    if logits.device.type == "cpu":
        indices = None if row_has_grammar is None else row_has_grammar.nonzero().flatten().tolist()
        if indices != []:
            _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=v, indices=indices)
    else:
        _apply_bitmask_torch(logits, bitmask, row_has_grammar)


def _apply_bitmask_torch(logits: Tensor, bitmask: Tensor, row_has_grammar: Tensor | None) -> None:
    """`apply_bitmask` in plain torch on any device: unpack the bits, one masked_fill."""
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[1]].bool()  # [N, V]
    if row_has_grammar is not None:
        allowed |= ~row_has_grammar[:, None]
    logits.masked_fill_(~allowed, float("-inf"))


def _bit(token: int) -> int:
    """The token's bit inside its int32 word, as a signed int32 value."""
    bit = 1 << (token & 31)
    return bit - (1 << 32) if bit >= 1 << 31 else bit
