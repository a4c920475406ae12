"""The `rollout` command line: `generate` writes an Arrow IPC file (prompts from arguments and
JSONL) that `validate` accepts, bad prompt files are refused, and `demo` runs end to end (here
on a random model and drafter)."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def server(tiny_random_qwen3):
    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=256)
    with BackgroundServer(lambda: build_engine(config), ServeConfig(port=0)) as srv:
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


def test_generate_reports_server_errors(server, tmp_path):
    import grpc

    out = tmp_path / "x.arrow"
    with pytest.raises(grpc.RpcError) as err:
        main(["generate", "x", "--address", server.address, "--out", str(out), "--top-p", "2", "--quiet"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()


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
