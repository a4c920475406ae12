"""The `rollout` command line: `generate` writes an Arrow IPC file (prompts from arguments, chats and
JSONL; stop strings, text, a grammar whose kind is inferred) sorted like the client's tables, that
`validate` accepts; bad prompt files and grammars are refused naming them; `demo` runs end to end
(here on a random model and drafter) and keeps its rollout for `show`. Also leaves
.ci-artifacts/rollout.arrow for `make test`'s final `rollout validate` step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from rollout.cli import main
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.loader import load_model
from rollout.errors import InvalidArgument
from rollout.generate_inputs import cli_grammar, read_prompts
from rollout.schema import ROLLOUT_SCHEMA
from rollout.server.app import BackgroundServer, ServeConfig
from rollout.spec.draft_loader import random_drafter, save_drafter

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_random_qwen3):
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=256)
    with BackgroundServer(lambda: LLMEngine(config), ServeConfig(port=0)) as srv:
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
    artifacts = REPO / ".ci-artifacts"
    artifacts.mkdir(exist_ok=True)
    shutil.copy(out, artifacts / "rollout.arrow")


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


def test_generate_reports_server_errors(server, tmp_path):
    import grpc

    out = tmp_path / "x.arrow"
    with pytest.raises(grpc.RpcError) as err:
        main(["generate", "x", "--address", server.address, "--out", str(out), "--top-p", "2", "--quiet"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()


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
