"""The `rollout` command line: `generate` writes an Arrow IPC file (prompts from arguments, chats and
JSONL; stop strings, text, a grammar whose kind is inferred) sorted like the client's tables, that
`validate` accepts; bad prompt files and grammars are refused naming them; server errors are one
line; Ctrl-C keeps what arrived; `demo` runs end to end (here on a random model and drafter) and
keeps its rollout for `show`."""

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
from rollout.cli import main
from rollout.cli_generate import cli_grammar, read_prompts
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
    with pytest.raises(InvalidArgument, match=r"p.jsonl:1: an object needs exactly one of the keys \('prompt', "
                                              r"'token_ids', 'messages'\), got \['text'\]"):
        read_prompts([], str(jsonl))
    with pytest.raises(InvalidArgument, match="prompts"):
        read_prompts([], None)


CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "def f(x):"}]


def test_chats_from_arguments_files_and_jsonl(tmp_path):
    (tmp_path / "chat.json").write_text(json.dumps(CHAT))
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"messages": CHAT}) + "\n")
    got = read_prompts(["t"], str(jsonl), [json.dumps(CHAT[1:]), f"@{tmp_path / 'chat.json'}"])
    assert got == ["t", CHAT[1:], CHAT, CHAT]
    for bad in ('[{"role": "user"}]', "[]", "{nope", f"@{tmp_path / 'missing.json'}"):
        with pytest.raises(InvalidArgument, match="^messages"):
            read_prompts([], None, [bad])
    jsonl.write_text(json.dumps({"messages": [{"role": "user", "content": 1}]}) + "\n")
    with pytest.raises(InvalidArgument, match="p.jsonl:1"):
        read_prompts([], str(jsonl))


def test_the_grammar_kind_is_inferred_or_given_never_defaulted(tmp_path):
    schema = '{"type": "object"}'
    (tmp_path / "g.json").write_text(schema)
    assert cli_grammar(schema, None) == ("json_schema", schema)
    assert cli_grammar(f"@{tmp_path / 'g.json'}", None) == ("json_schema", schema)
    assert cli_grammar("[0-9]+", "regex") == ("regex", "[0-9]+") and cli_grammar(None, None) is None
    with pytest.raises(InvalidArgument, match="^grammar: is not a JSON schema object; give --grammar-kind"):
        cli_grammar("[0-9]+", None)  # a regex is never compiled as a schema, nor a schema as a regex
    with pytest.raises(InvalidArgument, match="^grammar: cannot read"):
        cli_grammar("@/nonexistent/g.json", None)
    with pytest.raises(InvalidArgument, match="^grammar_kind"):
        cli_grammar(None, "regex")


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


def test_generate_chats_stops_text_grammar_and_sorted_rows(server, tmp_path, capsys):
    out = tmp_path / "chat.arrow"
    args = ["generate", "a" * 40, "b", "--messages", json.dumps(CHAT), "--address", server.address, "--out", str(out),
            "-n", "3", "--temperature", "1.0", "--max-tokens", "6", "--seed", "2", "--stop", "\n", "--stop", "e",
            "--text", "--quiet"]  # fmt: skip
    assert main(args) == 0
    table = pa.ipc.open_file(str(out)).read_all()
    keys = list(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist()))
    assert keys == [(p, s) for p in range(3) for s in range(3)]  # sorted like client.generate
    assert table.column("prompt_token_ids")[6].as_py()[0] == 259  # the chat, through the ChatML template
    for row in table.to_pylist():
        assert row["text"] == bytes(t for t in row["token_ids"] if t < 256).decode(errors="replace")
        assert (row["finish_reason"] == "stop") >= (row["stop_reason"] is not None)
    grammar = ["generate", "x", "--address", server.address, "--out", str(out), "--max-tokens", "8", "--quiet",
               "--temperature", "0", "--grammar", '{"type": "integer"}']  # fmt: skip
    assert main(grammar) == 0
    row = pa.ipc.open_file(str(out)).read_all().to_pylist()[0]
    assert row["grammar_kind"] == "json_schema" and bytes(row["token_ids"][:-1]).decode().lstrip("-").isdigit()
    assert main([*grammar[:-2], "--grammar", "[0-9]+"]) == 2
    assert "rollout generate: grammar: is not a JSON schema object" in capsys.readouterr().err


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
    kept = tmp_path / "demo.arrow"
    args = ["demo", "-n", "3", "--max-tokens", "8", "--model", str(tiny_random_qwen3), "--draft",
            str(tmp_path / "dflash"), "--keep", str(kept)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "drafter dflash (dflash)" in out and "validate:" in out and ": OK" in out
    assert "tokens/s" in out and "to_torch" in out and "exit 0" in out
    assert "the model's template renders '<|im_start|>user\\ndef fibonacci(n):" in out
    assert pa.ipc.open_file(str(kept)).read_all().num_rows == 3
    assert main(["show", str(kept), "--tokenizer", str(tiny_random_qwen3)]) == 0
    assert capsys.readouterr().out.count("── prompt 0 · sample") == 3


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


def test_demo_picks_an_embedded_drafter_for_each_spec(monkeypatch, tmp_path):
    from rollout.server import demo

    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "DEFAULT_DRAFTS", {"dflash": tmp_path / "dflash", "dspark": tmp_path / "dspark"})
    assert demo.pick_spec("history") == ("history", "")
    assert demo.pick_spec("dflash+history") == ("dflash+history", "")
    spec, note = demo.pick_spec("dspark+history")
    assert spec == "dflash+history" and "no embedded dspark drafter" in note
    assert demo.pick_spec("dspark")[0] == "dflash"
    assert demo.pick_spec("dspark", draft="/some/dspark") == ("dspark", "")
    monkeypatch.setattr(demo, "DEFAULT_DRAFTS", {"dflash": tmp_path / "none", "dspark": tmp_path / "dspark"})
    assert demo.pick_spec("dspark+history")[0] == "history" and demo.pick_spec("dflash")[0] == "none"
