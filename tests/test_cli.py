"""The `rollout` command line: `generate` writes an Arrow IPC file (prompts from arguments and
JSONL) that `validate` accepts, bad prompt files are refused, and `demo` runs end to end (here
on a random model and drafter)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from rollout import build_engine
from rollout.cli import main, read_prompts
from rollout.engine.config import EngineConfig
from rollout.engine.loader import load_model
from rollout.errors import InvalidArgument
from rollout.schema import ROLLOUT_SCHEMA
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.spec.draft_loader import random_drafter, save_drafter

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_random_qwen3):
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=256)
    with BackgroundServer(lambda: build_engine(config), ServeConfig(port=0, engine_process=False)) as srv:
        yield srv


def test_read_prompts_accepts_strings_token_lists_and_objects(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    lines = ['"plain"', "[1, 2, 3]", '{"prompt": "obj"}', '{"token_ids": [4, 5]}', ""]
    jsonl.write_text("\n".join(lines))
    assert read_prompts(["arg"], str(jsonl)) == ["arg", "plain", [1, 2, 3], "obj", [4, 5]]
    jsonl.write_text('{"text": 3}\n')
    with pytest.raises(InvalidArgument, match="p.jsonl:1"):
        read_prompts([], str(jsonl))
    with pytest.raises(InvalidArgument, match="prompts"):
        read_prompts([], None)


def test_generate_writes_an_arrow_file_that_validates(server, tmp_path, capsys):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"token_ids": [10, 11, 12]}) + "\n" + json.dumps("class A:\n") + "\n")
    out = tmp_path / "rollout.arrow"
    args = ["generate", "def f(x):", "--prompts-file", str(jsonl), "--address", server.address,
            "--out", str(out), "-n", "2", "--mask", "support", "--top-k", "8", "--temperature", "1.0",
            "--max-tokens", "6", "--seed", "1", "--quiet"]  # fmt: skip
    assert main(args) == 0
    assert "wrote 6 samples" in capsys.readouterr().out
    table = pa.ipc.open_file(str(out)).read_all()
    assert table.schema.remove_metadata() == ROLLOUT_SCHEMA and table.num_rows == 6
    assert table.schema.metadata[b"mask_mode"] == b"support"
    assert sorted(set(table.column("prompt_index").to_pylist())) == [0, 1, 2]
    assert main(["validate", str(out), "--max-width", "8"]) == 0


@pytest.mark.parametrize("flags, expected", [
    (["--top-p", "2"], "INVALID_ARGUMENT: top_p: must be in (0, 1]"),
    (["--grammar", "a(b", "--grammar-kind", "regex"], "INVALID_ARGUMENT: grammar"),
    (["--mask", "support"], "INVALID_ARGUMENT: top_k: a mask request at temperature > 0 needs 1 <= top_k"),
    (["--address", "127.0.0.1:1"], "UNAVAILABLE: "),
])  # fmt: skip
def test_generate_reports_server_errors_in_one_line(server, tmp_path, capsys, flags, expected):
    out = tmp_path / "x.arrow"
    assert main(["generate", "x", "--address", server.address, "--out", str(out), "--quiet", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rollout generate: {expected}") and err.count("\n") == 1, err
    assert pa.ipc.open_file(str(out)).read_all().num_rows == 0  # nothing arrived: a valid empty file


@pytest.fixture(scope="module")
def one_at_a_time(tiny_random_qwen3):
    """A server that runs one sample at a time: a request of many samples takes seconds."""
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=64, max_num_seqs=1)
    with BackgroundServer(lambda: build_engine(config), ServeConfig(port=0, engine_process=False)) as srv:
        yield srv


def test_ctrl_c_during_generate_keeps_the_samples_that_arrived(one_at_a_time, tmp_path):
    out = tmp_path / "partial.arrow"
    args = [sys.executable, "-m", "rollout.cli", "generate", "def f(x):", "--address", one_at_a_time.address,
            "--out", str(out), "-n", "24", "--max-tokens", "40", "--seed", "3"]  # fmt: skip
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not re.search(r" [1-9]\d*/24 ", "".join(seen)):  # the progress bar counted a sample
        assert proc.poll() is None and time.monotonic() < deadline, "".join(seen)
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    reader.join(10)
    err = "".join(seen)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    kept = int(re.search(r"interrupted; wrote the (\d+) of 24 samples that had arrived to ", err).group(1))
    table = pa.ipc.open_file(str(out)).read_all()  # closed valid
    assert 1 <= table.num_rows == kept < 24
    assert main(["validate", str(out)]) == 0


def test_demo_runs_end_to_end(tiny_random_qwen3, tmp_path, capsys):
    target = load_model(tiny_random_qwen3, "cpu")
    save_drafter(random_drafter(target, "dflash", block_size=4), tmp_path / "dflash")
    args = [
        "demo",
        "-n",
        "3",
        "--max-tokens",
        "8",
        "--model",
        str(tiny_random_qwen3),
        "--draft",
        str(tmp_path / "dflash"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "drafter dflash (dflash)" in out and "validate:" in out and ": OK" in out
    assert "tokens/s" in out and "to_torch" in out and "exit 0" in out


def test_serve_refuses_a_bad_switch_interval_and_names_it(capsys):
    from rollout.cli import main

    assert main(["serve", "--port", "0", "--gil-switch-ms", "0"]) == 2
    assert "gil_switch_ms" in capsys.readouterr().err


def test_demo_whose_server_cannot_start_says_so_without_a_traceback(monkeypatch, capsys):
    from rollout.server import demo
    from rollout.server.process import ServerStartError

    def fail(*args):
        raise ServerStartError("rollout serve did not start: rollout serve: model directory '/x' does not exist")

    monkeypatch.setattr(demo, "run_demo", fail)
    assert main(["demo", "--model", "/x"]) == 1
    assert capsys.readouterr().err == ("rollout demo: rollout serve did not start: rollout serve: model directory "
                                       "'/x' does not exist\n")
