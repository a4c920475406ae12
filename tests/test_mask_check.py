"""The mask contract's validator (docs/masks.md): clean rollouts pass, each broken rule is named at its position,
and `rollout validate` reads IPC files and streams with the documented exit codes."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from rollout.masks.check import check_table, main, read_table
from rollout.schema import ROLLOUT_SCHEMA, schema_with_metadata

VOCAB = 50


def _row(**values) -> SimpleNamespace:
    """One rollout row as plain, freely breakable Python values, one attribute per column of the
    schema (the validator reads Arrow only, so rows need not be valid engine outputs)."""
    return SimpleNamespace(**({f.name: None for f in ROLLOUT_SCHEMA} | values))


def _top_k_policy(rng: np.random.Generator, top_k: int):
    """One position's support (docs/sampling.md) at temperature 1 with top-k: (ids, logprobs), sorted."""
    z = rng.normal(size=VOCAB).astype(np.float32)
    z[3] = z[4] = 2.5  # a tie, broken by id
    order = sorted(range(VOCAB), key=lambda t: (-z[t], t))[:top_k]
    kept = z[order].astype(np.float64)
    logp = kept - np.log(np.exp(kept - kept.max()).sum()) - kept.max()
    return order, logp.astype(np.float32).tolist()


def _sample(rng, request_id="r0", n_tokens=6, top_k=5, greedy_at=(), mode="support") -> SimpleNamespace:
    s = _row(request_id=request_id, prompt_index=0, sample_index=1, prompt_token_ids=[1, 2, 3], token_ids=[],
             token_logprobs=[], support_ids=[], support_logprobs=[], policy_version=0)
    for j in range(n_tokens):
        ids, logp = ([7], [0.0]) if j in greedy_at else _top_k_policy(rng, top_k)
        pick = int(rng.integers(len(ids)))
        s.token_ids.append(ids[pick])
        s.token_logprobs.append(logp[pick])
        s.support_ids.append(ids)
        s.support_logprobs.append(logp)
    if mode == "selected":
        s.support_logprobs = None
    s.finish_reason, s.accept_lengths = "length", [n_tokens]
    return s


def _table(samples, mode="support", **extra) -> pa.Table:
    schema = schema_with_metadata("tiny", "dflash", "dflash", mode)
    if extra:
        schema = schema.with_metadata(
            {**schema.metadata, **{k.encode(): str(v).encode() for k, v in extra.items()}}
        )
    return pa.Table.from_pylist([vars(s) for s in samples], schema=schema)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_clean_rollout_passes(rng):
    samples = [_sample(rng, f"r{i}", greedy_at=(0, 3)) for i in range(4)]
    report = check_table(_table(samples), max_width=5)
    assert report.ok, report.summary()
    assert (report.samples, report.tokens, report.masked_tokens, report.max_support_width) == (4, 24, 24, 5)
    assert report.mean_support_width == pytest.approx((4 * 4 * 5 + 4 * 2) / 24)
    sel = [_sample(rng, mode="selected", greedy_at=(1,))]
    assert check_table(_table(sel, mode="selected")).ok
    plain = _sample(rng)
    plain.support_ids = plain.support_logprobs = None
    assert check_table(_table([plain], mode="")).ok


def _broken(rng, edit, **kw):
    s = _sample(rng, greedy_at=(2,))
    edit(s)
    report = check_table(_table([s]), **kw)
    return {(v.rule, v.position) for v in report.violations}, report


def _swap_first(s):
    s.support_ids[1][:2] = s.support_ids[1][1::-1]
    s.support_logprobs[1][:2] = s.support_logprobs[1][1::-1]


def _tie_order(s):
    s.support_ids[3], s.support_logprobs[3] = [9, 8], [np.log(0.5)] * 2
    s.token_ids[3], s.token_logprobs[3] = 9, float(np.log(0.5))


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda s: s.support_ids.pop(), ("one mask per token", None)),
        (
            lambda s: s.token_ids.__setitem__(4, 49 if 49 not in s.support_ids[4] else 48),
            ("token in support", 4),
        ),
        (_swap_first, ("sorted", 1)),
        (_tie_order, ("sorted", 3)),
        (lambda s: s.support_ids[0].__setitem__(1, s.support_ids[0][0]), ("duplicates", 0)),
        (lambda s: s.support_logprobs[5].__setitem__(-1, s.support_logprobs[5][-1] + 0.5), ("normalised", 5)),
        (lambda s: s.token_logprobs.__setitem__(1, s.token_logprobs[1] - 0.01), ("token logprob", 1)),
        (
            lambda s: (s.support_logprobs.__setitem__(2, [-0.5]), s.token_logprobs.__setitem__(2, -0.5)),
            ("greedy singleton", 2),
        ),
        (lambda s: setattr(s, "finish_reason", "error"), ("finish_reason", None)),
        (lambda s: s.token_logprobs.__setitem__(0, float("nan")), ("token_logprobs", 0)),
        (lambda s: s.support_logprobs.__setitem__(0, s.support_logprobs[0][:-1]), ("support_logprobs", None)),
        (lambda s: s.support_ids.__setitem__(1, []), ("support", 1)),
    ],
)
def test_each_rule_names_sample_and_position(rng, edit, expected):
    found, report = _broken(rng, edit)
    assert expected in found, report.summary()
    v = next(v for v in report.violations if (v.rule, v.position) == expected)
    assert (v.request_id, v.prompt_index, v.sample_index) == ("r0", 0, 1)
    assert "r0[prompt 0, sample 1]" in str(v)


def test_width_bound_from_argument_and_metadata(rng):
    s = _sample(rng, top_k=5)
    assert ("support width", 0) in {
        (v.rule, v.position) for v in check_table(_table([s]), max_width=4).violations
    }
    report = check_table(_table([s], max_mask_tokens=3))
    assert report.num_violations == 6 and {v.rule for v in report.violations} == {"support width"}
    assert check_table(_table([s], max_mask_tokens=5)).ok
    assert not check_table(_table([s], mask_top_k=4)).ok  # the server writes the request's top_k
    assert check_table(_table([s], mask_top_k=5)).ok


def test_mode_requires_masks(rng):
    s = _sample(rng)
    s.support_ids = s.support_logprobs = None
    assert {v.rule for v in check_table(_table([s], mode="selected")).violations} == {"one mask per token"}
    t = _sample(rng, mode="selected")
    assert {v.rule for v in check_table(_table([t], mode="support")).violations} == {"support_logprobs"}
    u = _sample(rng, mode="support")
    assert {v.rule for v in check_table(_table([u], mode="selected")).violations} == {"support_logprobs"}


def test_schema_must_match(rng):
    table = _table([_sample(rng)])
    bad = table.cast(
        pa.schema([f.with_type(pa.list_(pa.int64())) if f.name == "token_ids" else f for f in ROLLOUT_SCHEMA])
    )
    report = check_table(bad)
    assert [v.rule for v in report.violations] == ["schema"]
    assert check_table(table.replace_schema_metadata(None)).ok  # metadata is not part of the check


def test_sliced_and_chunked_tables(rng):
    samples = [_sample(rng, f"r{i}") for i in range(5)]
    broken = copy.deepcopy(samples)
    broken[3].token_logprobs[2] += 1.0
    table = pa.concat_tables([_table(broken[:2]), _table(broken[2:])])
    report = check_table(table.slice(1, 3))
    assert report.samples == 3
    assert {(v.request_id, v.position) for v in report.violations if v.rule == "token logprob"} == {("r3", 2)}


def test_cli_file_stream_and_exit_codes(rng, tmp_path, capsys):
    good = _table([_sample(rng, f"r{i}") for i in range(3)])
    bad_sample = _sample(rng, "bad")
    bad_sample.token_logprobs[0] = 0.5
    bad = _table([bad_sample])
    paths = {}
    for name, table, writer in [
        ("good.arrow", good, pa.ipc.new_file),
        ("bad.arrows", bad, pa.ipc.new_stream),
    ]:
        paths[name] = tmp_path / name
        with writer(str(paths[name]), table.schema) as w:
            w.write_table(table)
    assert read_table(str(paths["good.arrow"])).equals(good)
    assert main([str(paths["good.arrow"])]) == 0
    assert "3 samples" in capsys.readouterr().out
    assert main([str(paths["bad.arrows"])]) == 1
    assert "bad[prompt 0, sample 1] position 0" in capsys.readouterr().out
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    assert main([str(tmp_path / "junk.arrow")]) == 2
    assert main([str(tmp_path / "missing.arrow")]) == 2


def test_ids_outside_the_vocabulary_are_violations(rng):
    s = _sample(rng, greedy_at=(2,))
    s.support_ids[1][-1], s.support_ids[3][0] = -3, 2_080_374_867
    s.token_ids[4] = s.support_ids[4][0] = VOCAB
    s.prompt_token_ids[0] = -1
    found = {(v.rule, v.position) for v in check_table(_table([s], vocab_size=VOCAB)).violations}
    assert {("vocabulary", p) for p in (None, 1, 3, 4)} <= found
    unbounded = check_table(_table([s]))  # without vocab_size only negative ids are caught
    assert {(v.rule, v.position) for v in unbounded.violations if v.rule == "vocabulary"} == {
        ("vocabulary", None), ("vocabulary", 1)}
    assert "not checked against a vocabulary size" in unbounded.summary()
    assert "not checked" not in check_table(_table([_sample(rng)], vocab_size=VOCAB)).summary()


@pytest.mark.parametrize("key, value", [
    ("mask_top_k", b"abc"), ("mask_top_k", b"-2"), ("max_mask_tokens", b"4.5"), ("vocab_size", b"0"),
    ("mask_mode", b"\xff\xfeselected"), ("mask_mode", b"everything"),
])  # fmt: skip
def test_malformed_metadata_exits_2_naming_the_key(rng, tmp_path, capsys, key, value):
    table = _table([_sample(rng)])
    table = table.replace_schema_metadata({**table.schema.metadata, key.encode(): value})
    with pa.ipc.new_file(str(tmp_path / "m.arrow"), table.schema) as w:
        w.write_table(table)
    assert main([str(tmp_path / "m.arrow")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"schema metadata {key}" in err, err
