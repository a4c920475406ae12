"""Checks the stdlib training corpus helpers of scripts/corpus.py.

The split must be deterministic and disjoint, test suites and generated files must be left
out, and the window helpers must cut the EOS-separated byte stream as documented.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import corpus  # noqa: E402


@pytest.fixture(scope="module")
def stdlib():
    return corpus.load_corpus()


def test_split_is_deterministic_and_disjoint(stdlib):
    again = corpus.load_corpus()
    assert again.file_list_sha256 == stdlib.file_list_sha256
    assert again.heldout == stdlib.heldout and stdlib.heldout
    assert not set(stdlib.train) & set(stdlib.heldout)
    everything = sorted(stdlib.train + stdlib.heldout)
    assert corpus.file_list_sha256(everything) == stdlib.file_list_sha256
    fraction = len(stdlib.heldout) / len(everything)
    assert 0.02 < fraction < 0.09
    assert corpus.heldout_files() == stdlib.paths("heldout")


def test_tests_generated_and_site_packages_are_excluded(stdlib):
    rels = stdlib.train + stdlib.heldout
    assert "os.py" in rels and "json/decoder.py" in rels
    for rel in rels:
        parts = rel.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), rel
        assert not parts[-1].startswith("_sysconfigdata"), rel
    assert "token.py" not in rels and "encodings/cp1252.py" not in rels


def test_token_stream_separates_documents_with_eos():
    stream = corpus.token_stream([b"ab", b"", b"\xff"])
    assert stream.tolist() == [97, 98, 256, 256, 255, 256]


def test_eval_windows_target_every_id_once():
    stream = torch.arange(23)
    windows = corpus.eval_windows(stream, 5)  # windows: [W, 6]
    targets = windows[:, 1:].flatten()
    assert targets[targets >= 0].tolist() == list(range(1, 23))
    assert torch.equal(windows[1:, 0], windows[:-1, -1])


def test_sample_windows_are_consecutive_and_seeded():
    stream = torch.arange(1000)
    a = corpus.sample_windows(stream, 4, 16, torch.Generator().manual_seed(3))  # a: [4, 17]
    b = corpus.sample_windows(stream, 4, 16, torch.Generator().manual_seed(3))
    assert a.shape == (4, 17) and torch.equal(a, b)
    assert torch.all(a[:, 1:] - a[:, :-1] == 1)
