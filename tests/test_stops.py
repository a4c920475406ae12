"""Stop strings: the matcher on its own (strings spanning tokens, inside one token, multi-byte
characters, min_tokens, which string wins, short decodes only), and in the engine, where a sample
keeps the tokens up to the one completing a stop string, with log-probs, masks and acceptance
lengths aligned, the same when a drafter's accepted block holds the stop; `text` is the decoded
output; bad stop strings are refused naming the field."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from spec_helpers import RepeatDrafter, factory_of
from tokenizers import Tokenizer

from rollout.engine.config import DEFAULT_MODEL, EngineConfig
from rollout.engine.drafter import Drafts
from rollout.engine.engine import LLMEngine
from rollout.engine.params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams
from rollout.engine.stops import CONTEXT_TOKENS, MAX_PENDING_TOKENS, StopMatcher
from rollout.errors import InvalidArgument
from rollout.masks.check import check_table
from rollout.schema import schema_with_metadata, to_record_batch

LETTERS = {t: 100.0 for t in range(ord("a"), ord("z") + 1)}  # bias the random model to lowercase text
PROMPT = [40, 50, 60, 70, 80, 90]


def _piece_decoder(pieces: dict[int, str], calls: list[int] | None = None):
    """decode() of a toy vocabulary whose tokens are whole strings."""

    def decode(ids: list[int]) -> str:
        if calls is not None:
            calls.append(len(ids))
        return "".join(pieces[i] for i in ids)

    return decode


def test_a_stop_string_across_tokens_and_inside_one():
    decode = _piece_decoder({0: "ab", 1: "c\nd", 2: "END", 3: "x"})
    matcher = StopMatcher(["\n", "bc"], decode)
    assert matcher.scan([3, 3], 0, 0) is None
    assert matcher.scan([0, 3, 0, 1, 2], 2, 0) == (3, "bc")  # "bc" ends before "\n" in token 1's text
    matcher = StopMatcher(["DEN"], decode)
    assert matcher.scan([1, 2], 0, 0) is None and matcher.scan([3, 2], 0, 0) is None
    assert StopMatcher(["dEN"], decode).scan([1, 2, 3], 0, 0) == (1, "dEN")


def test_multibyte_characters_and_min_tokens():
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))  # one token per byte
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    tokens = list("aé€b".encode())  # 1 + 2 + 3 + 1 byte tokens
    assert StopMatcher(["é"], decode).scan(tokens, 0, 0) == (2, "é")  # its second byte completes it
    assert StopMatcher(["€b"], decode).scan(tokens, 0, 0) == (6, "€b")
    assert StopMatcher(["a"], decode).scan(tokens + [97], 0, 1) == (7, "a")  # the first "a" is before min_tokens
    assert StopMatcher(["a"], decode).scan(tokens + [97], 10, 18) is None  # positions 10..17, min_tokens 18
    bad = [0xE2, 0x82, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]  # invalid UTF-8 is text after MAX_PENDING_TOKENS
    assert StopMatcher(["\ufffd"], decode).scan(bad, 0, 0) == (MAX_PENDING_TOKENS, "\ufffd")


def test_decoding_stays_a_few_tokens_long():
    calls: list[int] = []
    decode = _piece_decoder({i: chr(97 + i) for i in range(26)}, calls)
    matcher = StopMatcher(["never", "zz"], decode)
    assert matcher.scan([i % 25 for i in range(5000)], 0, 0) is None
    assert max(calls) <= 2 * CONTEXT_TOKENS + 1 and len(calls) < 5000 * 1.3  # a few ids, ~1.25 decodes a token
    assert len(matcher.tail) == len("never") - 1


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256, **kw))


def _run(eng: LLMEngine, params: SamplingParams, n: int = 1, mask: str | None = None, **kw):
    eng.add_request("r", [PROMPT], params, n=n, mask=mask, **kw)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.kv_blocks()[0] == eng.kv_blocks()[1]
    return sorted(outs, key=lambda o: o.sample_index)


@pytest.fixture(scope="module")
def free_run(tiny_random_qwen3):
    """The greedy tokens and text without stop strings (lowercase letters, one token each)."""
    eng = _engine(tiny_random_qwen3)
    out = _run(eng, SamplingParams(temperature=0.0, max_tokens=24, logit_bias=LETTERS), return_text=True)[0]
    assert out.text == bytes(out.token_ids).decode() and len(out.text) == 24
    return out


class OracleDrafter(RepeatDrafter):
    """Drafts the known greedy continuation: every draft is accepted, so a step commits a whole block
    and the stop string is completed in the middle of one."""

    def __init__(self, block_size: int, continuation: list[int]):
        super().__init__(block_size)
        self.continuation = continuation + [0] * block_size

    def propose(self, items, block_table) -> Drafts:
        flat = [t for it in items for t in
                self.continuation[it.seq.num_output_tokens : it.seq.num_output_tokens + it.num_draft]]
        return Drafts(torch.tensor(flat, dtype=torch.int64), [it.num_draft for it in items])


@pytest.mark.parametrize("drafter", [None, "oracle"])
def test_the_sample_keeps_the_token_completing_the_stop_and_nothing_after(tiny_random_qwen3, free_run, drafter):
    oracle = OracleDrafter(8, free_run.token_ids) if drafter else None
    eng = LLMEngine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=256, spec_adaptive=False),
                    drafter_factory=factory_of(oracle))  # full blocks: the accept lengths below are whole blocks
    text = free_run.text  # a stop string of 3 letters first found ending inside the oracle's second block
    end = next(k for k in range(12, 17) if text.index(text[k - 3 : k]) == k - 3)
    stop = text[end - 3 : end]
    params = SamplingParams(temperature=0.0, max_tokens=24, logit_bias=LETTERS, stop=["nomatch", stop])
    out = _run(eng, params, n=2, mask="support", return_text=True)
    for o in out:
        assert o.token_ids == free_run.token_ids[:end] and o.text == free_run.text[:end]
        assert (o.finish_reason, o.stop_reason) == ("stop", stop)
        assert len(o.token_logprobs) == len(o.support_ids) == sum(o.accept_lengths) == end
        if drafter:  # the prefill's token, a whole block of 8, then a block cut at the stop
            assert o.accept_lengths == [1, 8, end - 9]
    table = pa.Table.from_batches([to_record_batch(out, schema_with_metadata("m", "", "none", "support", 1))])
    assert check_table(table).ok and table.column("stop_reason").to_pylist() == [stop, stop]


def test_sampled_samples_stop_at_the_first_occurrence(tiny_random_qwen3):
    eng = _engine(tiny_random_qwen3)
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=40, seed=3, logit_bias=LETTERS, stop=["e", "qq"])
    out = _run(eng, params, n=6, mask="support", return_text=True)
    stopped = [o for o in out if o.finish_reason == "stop"]
    assert len(stopped) >= 3
    for o in out:
        assert o.text == bytes(o.token_ids).decode() and len(o.support_ids) == len(o.token_ids)
        if o.finish_reason == "stop":
            assert o.text.endswith(o.stop_reason) and all(s not in o.text[:-1] for s in params.stop)
        else:
            assert o.stop_reason is None and all(s not in o.text for s in params.stop)
    table = pa.Table.from_batches([to_record_batch(out, schema_with_metadata("m", "", "none", "support", 8))])
    assert check_table(table).ok


def test_stop_strings_wait_for_min_tokens(tiny_random_qwen3, free_run):
    eng = _engine(tiny_random_qwen3)
    first = free_run.text[0]
    later = free_run.text.find(first, 5)
    params = SamplingParams(temperature=0.0, max_tokens=24, logit_bias=LETTERS, stop=[first], min_tokens=5)
    out = _run(eng, params)[0]
    if later < 0:
        assert out.finish_reason == "length" and out.token_ids == free_run.token_ids
    else:
        assert out.token_ids == free_run.token_ids[: later + 1] and out.stop_reason == first


def test_text_is_none_unless_asked(tiny_random_qwen3):
    out = _run(_engine(tiny_random_qwen3), SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.text is None and out.stop_reason is None


@pytest.mark.parametrize("stop, field", [
    ([""], r"stop\[0\]"), (["ok", 3], r"stop\[1\]"), (["x" * (MAX_STOP_LENGTH + 1)], r"stop\[0\]"),
    (["s"] * (MAX_STOP_STRINGS + 1), "stop"), ("abc", "stop"),
])  # fmt: skip
def test_bad_stop_strings_are_refused_naming_the_field(stop, field):
    with pytest.raises(InvalidArgument, match=rf"^{field}: must be"):
        SamplingParams(stop=stop).validate(264)
