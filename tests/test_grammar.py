"""Grammar masks for speculative verify: verify-block bitmasks equal a fresh matcher's after
each prefix, invalid drafts and stop tokens are handled, the matcher is left where it was,
special tokens never appear inside the grammar's text, and bad grammars are refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import xgrammar as xgr
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from rollout.engine.grammar import (
    GrammarCompilerCache,
    GrammarSpec,
    _apply_bitmask_torch,
    allocate_bitmask,
    apply_bitmask,
    byte_level_alphabet,
)
from rollout.errors import InvalidArgument

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|mask|>"] + [f"<|reserved_{i}|>" for i in range(5)]
EOS = 256
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
)
REGEX = r"(yes|no)-[0-9]{2,3}"


def byte_tokenizer() -> Tokenizer:
    """The embedded model's layout: ids 0..255 are bytes (ByteLevel), 256.. specials, vocab 264."""
    alphabet = byte_level_alphabet()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def bpe_tokenizer() -> Tokenizer:
    """A generic HF byte-level BPE with merges, specials first, and a non-special added token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [json.dumps({"name": w * k, "n": k * 37}) for k in range(1, 30) for w in ("ab", "yes", "the name")]
    tok.train_from_iterator(text, trainer)
    tok.add_tokens([AddedToken("é<x>", special=False)])
    return tok


@pytest.fixture(scope="module")
def cache():
    return GrammarCompilerCache(byte_tokenizer(), 264, [EOS], special_ids=[257, 258])


def allowed(bitmask: torch.Tensor, row: int, vocab: int = 264) -> set[int]:
    words = bitmask[row].numpy().view(np.uint32)
    return {t for t in range(vocab) if (words[t >> 5] >> (t & 31)) & 1}


def fresh_row(cache: GrammarCompilerCache, spec: GrammarSpec, prefix: list[int]) -> torch.Tensor:
    matcher = xgr.GrammarMatcher(cache.compile(spec))
    for t in prefix:
        assert matcher.accept_token(t)
    out = allocate_bitmask(1, cache.vocab_size)
    if matcher.is_terminated():
        out[0] = 0
        out[0, EOS >> 5] = 1 << (EOS & 31)
    else:
        matcher.fill_next_token_bitmask(out, 0)
    return out[0]


@pytest.mark.parametrize(
    "spec, text",
    [
        (GrammarSpec("json_schema", SCHEMA), '{"name": "héllo", "n": 12}'),
        (GrammarSpec("regex", REGEX), "yes-123"),
    ],
)
def test_verify_rows_equal_fresh_matcher(cache, spec, text):
    tokens = list(text.encode()) + [EOS]
    state = cache.new_state(spec)
    rng = np.random.default_rng(0)
    committed: list[int] = []
    bitmask = allocate_bitmask(16, 264)
    while len(committed) < len(tokens):
        drafts = tokens[len(committed) : len(committed) + 5]
        state.fill_verify_bitmask(drafts, bitmask, first_row=3)
        for i in range(len(drafts) + 1):
            assert torch.equal(bitmask[3 + i], fresh_row(cache, spec, committed + drafts[:i])), (committed, i)
        # the matcher is still at the committed prefix: an empty block gives the fresh row
        state.fill_verify_bitmask([], bitmask, first_row=0)
        assert torch.equal(bitmask[0], fresh_row(cache, spec, committed))
        n = int(rng.integers(1, len(drafts) + 1))
        state.commit(drafts[:n])
        committed += drafts[:n]
    assert state.is_terminated()


def test_invalid_draft_rows_copy_and_rollback(cache):
    spec = GrammarSpec("regex", REGEX)
    state = cache.new_state(spec)
    state.commit(list(b"ye"))
    bitmask = allocate_bitmask(6, 264)
    drafts = [ord("s"), ord("x"), ord("-"), ord("1"), ord("2")]
    state.fill_verify_bitmask(drafts, bitmask, first_row=0)
    assert allowed(bitmask, 0) == {ord("s")} and allowed(bitmask, 1) == {ord("-")}
    for row in range(2, 6):
        assert torch.equal(bitmask[row], bitmask[1])  # unreachable: verification rejects "x"
    assert torch.equal(fresh_row(cache, spec, list(b"ye")), _one_row(state))
    state.fill_verify_bitmask([1000, -3], bitmask, first_row=0)  # out-of-range ids are rejections
    assert torch.equal(bitmask[1], bitmask[0]) and torch.equal(bitmask[2], bitmask[0])


def _one_row(state) -> torch.Tensor:
    row = allocate_bitmask(1, 264)
    state.fill_verify_bitmask([], row, first_row=0)
    return row[0]


def test_stop_token_inside_a_draft(cache):
    state = cache.new_state(GrammarSpec("regex", "ab|ac"))
    bitmask = allocate_bitmask(5, 264)
    state.fill_verify_bitmask([ord("a"), ord("b"), EOS, ord("a")], bitmask, first_row=0)
    assert allowed(bitmask, 1) == {ord("b"), ord("c")}
    assert allowed(bitmask, 2) == {EOS} == allowed(bitmask, 3) == allowed(bitmask, 4)
    assert not state.is_terminated()
    state.commit([ord("a"), ord("b"), EOS])
    assert state.is_terminated()
    state.fill_verify_bitmask([EOS], bitmask, first_row=0)  # a finished sequence only stops
    assert allowed(bitmask, 0) == {EOS} == allowed(bitmask, 1)


def test_specials_never_inside_strings(cache):
    state = cache.new_state(GrammarSpec("json_schema", SCHEMA))
    state.commit(list(b'{"name": "a'))
    row = _one_row(state)
    inside = allowed(row[None], 0)
    assert {ord("b"), 0xC3, ord('"')} <= inside and not inside & set(range(256, 264))
    state.commit(list(b'", "n": 7}'))
    end = allowed(_one_row(state)[None], 0)
    assert EOS in end and not end & set(range(257, 264))
    info = cache.tokenizer_info
    assert set(info.special_token_ids) >= set(range(257, 264)) and info.stop_token_ids == [EOS]


def _walk(cache, spec, vocab, seed, eos=EOS, max_steps=200) -> list[int]:
    """Speculative decoding in miniature: random drafts (some invalid), verification accepts
    while the row allows the draft, then a token is sampled from the next row."""
    rng = np.random.default_rng(seed)
    state = cache.new_state(spec)
    bitmask = allocate_bitmask(5, vocab)
    out: list[int] = []
    for _ in range(max_steps):
        drafts = [int(t) for t in rng.integers(0, vocab, size=4)]
        state.fill_verify_bitmask(drafts, bitmask, first_row=0)
        n = 0
        while n < len(drafts) and drafts[n] in allowed(bitmask, n, vocab):
            n += 1
        choices = sorted(allowed(bitmask, n, vocab))
        pick = eos if eos in choices and rng.random() < 0.5 else int(rng.choice(choices))
        committed = drafts[:n] + [pick]
        if eos in committed:
            committed = committed[: committed.index(eos) + 1]
        state.commit(committed)
        out += committed
        if state.is_terminated():
            return out[:-1]
    raise AssertionError("grammar walk did not terminate")


def test_walks_match_grammar(cache):
    for seed in range(3):
        text = bytes(_walk(cache, GrammarSpec("regex", REGEX), 264, seed)).decode()
        assert re.fullmatch(REGEX, text), text


def test_generic_bpe_tokenizer_json_walk():
    tok = bpe_tokenizer()
    eos, vocab = tok.token_to_id("<|endoftext|>"), tok.get_vocab_size() + 3  # padded lm_head
    bpe_cache = GrammarCompilerCache(tok, vocab, [eos])
    info = bpe_cache.tokenizer_info
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.decoded_vocab[tok.token_to_id("é<x>")] == "é<x>".encode()
    merged = max(range(vocab - 3), key=lambda i: len(info.decoded_vocab[i]))
    assert info.decoded_vocab[merged] == tok.decode([merged]).encode() and len(info.decoded_vocab[merged]) > 2
    assert tok.token_to_id("<|pad|>") in info.special_token_ids and vocab - 1 in info.special_token_ids
    ids = _walk(bpe_cache, GrammarSpec("json_schema", SCHEMA), vocab, seed=1, eos=eos, max_steps=400)
    value = json.loads(tok.decode(ids))
    assert set(value) == {"name", "n"} and isinstance(value["name"], str) and isinstance(value["n"], int)


@pytest.mark.parametrize(
    "kind, value, words",
    [
        ("json_schema", "{not json", "json_schema"),
        ("json_schema", '{"type": "frobnicate"}', "frobnicate"),
        ("regex", "a(b", "parenthesis"),
        ("ebnf", "root ::= foo", "foo"),
    ],
)
def test_bad_grammar_is_refused(cache, kind, value, words):
    with pytest.raises(InvalidArgument, match=words) as err:
        cache.compile(GrammarSpec(kind, value))
    assert err.value.field == "grammar" and str(err.value).startswith("grammar:")


def test_spec_validation_and_cache():
    with pytest.raises(InvalidArgument, match="kind") as err:
        GrammarSpec("yaml", "a: 1")
    assert err.value.field == "grammar"
    with pytest.raises(InvalidArgument):
        GrammarSpec("regex", "  ")
    small = GrammarCompilerCache(byte_tokenizer(), 264, [EOS], capacity=2)
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = small.compile(a)
    assert small.compile(GrammarSpec("regex", "a+")) is first
    small.compile(b)
    small.compile(a)  # a is now the most recent: c evicts b
    small.compile(c)
    assert small.compile(a) is first and list(small._cache) == [c, a]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_xgrammar_and_torch_agree(cache, dtype):
    states = [
        cache.new_state(GrammarSpec("regex", REGEX)),
        cache.new_state(GrammarSpec("json_schema", SCHEMA)),
    ]
    bitmask = allocate_bitmask(3, 264)
    for row, state in enumerate(states):
        state.fill_verify_bitmask([], bitmask, first_row=row)
    bitmask[2] = 0  # row 2 has no grammar: its bits must be ignored
    has_grammar = torch.tensor([True, True, False])
    logits = torch.randn(3, 264, generator=torch.Generator().manual_seed(0)).to(dtype)
    via_xgr, via_torch = logits.clone(), logits.clone()
    apply_bitmask(via_xgr, bitmask, has_grammar)
    _apply_bitmask_torch(via_torch, bitmask, has_grammar)
    assert torch.equal(via_xgr, via_torch)
    assert torch.equal(via_xgr[2], logits[2])
    assert (
        {t for t in range(264) if torch.isfinite(via_xgr[0, t])}
        == allowed(bitmask, 0)
        == {ord("y"), ord("n")}
    )
    untouched = logits.clone()
    apply_bitmask(untouched, bitmask, torch.tensor([False, False, False]))
    assert torch.equal(untouched, logits)
    with pytest.raises(ValueError, match="bitmask"):
        apply_bitmask(logits[:, :200], bitmask)
