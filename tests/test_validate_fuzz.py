"""`rollout validate` on corrupted input: a valid rollout file broken in 120 seeded random ways
(bytes overwritten, truncation, malformed schema metadata, corrupted list offsets, token ids
outside the vocabulary, not Arrow at all) never raises: it exits 0 (clean), 1 (violations) or 2
(cannot be checked, with a one-line reason), and each structured corruption gets its own code."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from rollout.masks.check import main
from rollout.schema import ROLLOUT_SCHEMA, schema_with_metadata

VOCAB, TOP_K, CASES = 50, 4, 120
BAD_META = [b"abc", b"\xff\xfe\x00", b"-3", b"0", b"1e3", b" 4", b"0x10"]
BAD_IDS = [-1, -2**31, VOCAB, 2_080_374_867]
LIST_COLUMNS = ["prompt_token_ids", "token_ids", "token_logprobs", "support_ids", "support_logprobs",
                "accept_lengths"]


def _rollout(rng: np.random.Generator, num_samples: int = 6) -> pa.Table:
    """A clean support-mode rollout: top-k supports of random logits, sorted, token inside."""
    rows = []
    for i in range(num_samples):
        ids, logps, tokens, token_lps = [], [], [], []
        for _ in range(int(rng.integers(1, 6))):
            z = rng.normal(size=VOCAB)
            order = sorted(range(VOCAB), key=lambda t: (-z[t], t))[:TOP_K]
            kept = z[order] - np.logaddexp.reduce(z[order])
            pick = int(rng.integers(TOP_K))
            ids.append(order), logps.append(kept.astype(np.float32).tolist())
            tokens.append(order[pick]), token_lps.append(float(np.float32(kept[pick])))
        rows.append(dict(request_id=f"r{i}", prompt_index=i, sample_index=0, prompt_token_ids=[1, 2, 3],
                         token_ids=tokens, token_logprobs=token_lps, support_ids=ids, support_logprobs=logps,
                         finish_reason="length", accept_lengths=[1] * len(tokens), policy_version=0,
                         temperature=1.0, top_k=TOP_K, top_p=1.0, min_p=0.0, mask_mode="support"))
    schema = schema_with_metadata("tiny", "none", "none", "support", TOP_K, VOCAB)
    return pa.Table.from_pylist(rows, schema=schema)


def _write(table: pa.Table, path, stream: bool) -> bytes:
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(str(path), table.schema) as writer:
        writer.write_table(table)
    return path.read_bytes()


def _bad_metadata(table: pa.Table, rnd: random.Random) -> tuple[pa.Table, int, str]:
    key = rnd.choice([b"mask_top_k", b"vocab_size", b"mask_mode", b"max_mask_tokens"])
    meta = {**table.schema.metadata, key: rnd.choice(BAD_META)}
    return table.replace_schema_metadata(meta), 2, key.decode()


def _bad_offsets(table: pa.Table, rnd: random.Random) -> tuple[pa.Table, int, str]:
    """One list column with an offset moved out of order or past its values."""
    name = rnd.choice(LIST_COLUMNS)
    arr = table.column(name).chunk(0)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[: len(arr) + 1].copy()
    slot = rnd.randrange(1, len(offsets) - 1)  # (an interior one: pyarrow checks the last when building)
    offsets[slot] = rnd.choice([offsets[-1] + rnd.randint(1, 10**6), -rnd.randint(1, 100), 2**31 - 1])
    bad = pa.Array.from_buffers(arr.type, len(arr), [arr.buffers()[0], pa.py_buffer(offsets.tobytes())],
                                children=[arr.values])
    columns = [bad if f.name == name else table.column(f.name) for f in ROLLOUT_SCHEMA]
    return pa.Table.from_arrays(columns, schema=table.schema), 2, "offset"


def _bad_ids(table: pa.Table, rnd: random.Random) -> tuple[pa.Table, int, str]:
    """A token, support or prompt id outside [0, VOCAB): valid Arrow, a violation."""
    rows = table.to_pylist()
    row = rnd.choice(rows)
    column = rnd.choice(["token_ids", "support_ids", "prompt_token_ids"])
    j = rnd.randrange(len(row[column]))
    if column == "support_ids":
        row[column][j][rnd.randrange(len(row[column][j]))] = rnd.choice(BAD_IDS)
    else:
        row[column][j] = rnd.choice(BAD_IDS)
    return pa.Table.from_pylist(rows, schema=table.schema), 1, "vocabulary"


def _case(seed: int, base: pa.Table, tmp_path) -> tuple[bytes, set[int], str]:
    """The corrupted bytes of case `seed`, the exit codes allowed and a word the output must hold."""
    rnd = random.Random(seed)
    kind, stream = seed % 6, rnd.random() < 0.5
    if kind in (0, 1, 2):
        broken, code, word = [_bad_metadata, _bad_offsets, _bad_ids][kind](base, rnd)
        return _write(broken, tmp_path / "case", stream), {code}, word
    data = bytearray(_write(base, tmp_path / "case", stream))
    if kind == 3:
        for _ in range(rnd.randint(1, 8)):
            data[rnd.randrange(len(data))] = rnd.randrange(256)
        return bytes(data), {0, 1, 2}, ""
    if kind == 4:  # cut before the end (an IPC file loses its footer; a stream its last message)
        return bytes(data[: rnd.randrange(len(data) - 8)]), {2}, ""
    return rnd.choice([b"", b"not arrow at all", bytes(rnd.randrange(256) for _ in range(300)),
                       b"ARROW1" + bytes(100)]), {2}, ""


@pytest.fixture(scope="module")
def base():
    return _rollout(np.random.default_rng(0))


def test_the_uncorrupted_file_is_clean(base, tmp_path, capsys):
    for stream in (False, True):
        _write(base, tmp_path / "clean", stream)
        assert main([str(tmp_path / "clean")]) == 0
        assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(CASES))
def test_corrupted_file_exits_0_1_or_2_without_a_traceback(base, tmp_path, capsys, seed):
    data, allowed, word = _case(seed, base, tmp_path)
    path = tmp_path / "corrupted.arrow"
    path.write_bytes(data)
    code = main([str(path)])  # any exception fails the test: a traceback in `rollout validate`
    out, err = capsys.readouterr()
    assert code in allowed, (code, out, err)
    if code == 2:
        assert out == "" and err.count("\n") == 1 and err.startswith("rollout validate: cannot check "), err
    assert word in (err if code == 2 else out), (word, out, err)
