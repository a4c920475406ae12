"""Command-line options: every EngineConfig / ServeConfig field is a `rollout serve` flag whose
default is the field's (rollout.options generates them); every option's help shows its default; a
typo in a subcommand's flag prints that subcommand's usage; the README's table of `rollout serve`
options is the parser's; `--draft` without a drafter kind is refused and a missing drafter
directory is named as missing."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from rollout.cli import HelpFormatter, build_parser, main
from rollout.engine.config import EngineConfig
from rollout.errors import InvalidArgument, LoadError
from rollout.options import from_options, markdown_table, option
from rollout.server.config import FlushPolicy, ServeConfig

README = Path(__file__).resolve().parents[1] / "README.md"
TABLE = re.compile(r"<!-- BEGIN serve options.*?-->\n(.*?)<!-- END serve options -->", re.S)


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def _leaf_fields(cls, prefix: str = ""):
    """(namespace name, default) of every field, nested dataclasses flattened under their name."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], f"{prefix}{f.name}_")
        else:
            yield prefix + f.name, default


@pytest.mark.parametrize("cls", [EngineConfig, ServeConfig])
def test_every_config_field_is_a_serve_flag_with_the_fields_default(cls):
    actions = {a.dest: a for a in _subparser("serve")._actions}
    fields = list(_leaf_fields(cls))
    assert fields
    for name, default in fields:
        assert name in actions, f"{cls.__name__}.{name} has no `rollout serve` flag"
        action = actions[name]
        assert action.default == default, f"--{name}: default {action.default!r}, the field's {default!r}"
        assert "(default: " in HelpFormatter("rollout")._get_help_string(action), f"{name}: no default in help"
    assert from_options(cls, _subparser("serve").parse_args([])) == cls()


def test_flags_parse_into_the_config_and_renamed_fields_do_not_fall_back():
    args = _subparser("serve").parse_args(["--spec", "dflash", "--no-cuda-graphs", "--engine-thread",
                                           "--flush-rows", "3", "--metrics-port", "0", "--max-model-len", "99"])
    engine, serve = from_options(EngineConfig, args), from_options(ServeConfig, args)
    assert (engine.spec, engine.cuda_graphs, engine.max_model_len) == ("dflash", False, 99)
    assert (serve.engine_process, serve.flush, serve.metrics_port) == (False, FlushPolicy(rows=3), 0)

    @dataclasses.dataclass(frozen=True)
    class Renamed:
        max_num_seqz: int = option(1, "a field whose flag the parser lacks")

    with pytest.raises(AttributeError, match="max_num_seqz"):
        from_options(Renamed, args)


def test_every_option_of_every_command_shows_its_default_in_help():
    for name in ("serve", "generate", "demo"):
        parser = _subparser(name)
        options = [a for a in parser._actions if a.option_strings and a.dest != "help" and not a.required]
        for action in options:
            assert action.help, f"rollout {name} {action.option_strings[-1]} has no help"
            assert "(default: " in HelpFormatter("rollout")._get_help_string(action), action.option_strings
        assert " ".join(parser.format_help().split()).count("(default: ") == len(options)
    mask = " ".join(_subparser("generate").format_help().split())
    assert "'selected' returns support_ids" in mask and "'support' adds support_logprobs" in mask


@pytest.mark.parametrize("argv, usage", [
    (["serve", "--spec-blok-size", "4"], "usage: rollout serve"),
    (["generate", "hi", "--out", "x.arrow", "--tmperature", "1"], "usage: rollout generate"),
    (["demo", "--n-samples", "3"], "usage: rollout demo"),
])  # fmt: skip
def test_a_typo_in_a_subcommands_flag_prints_that_subcommands_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(usage) and f"unrecognized arguments: {argv[-2]}" in err


def test_readme_table_of_serve_options_is_the_parsers():
    found = TABLE.search(README.read_text())
    assert found, "README.md lacks the <!-- BEGIN serve options --> ... <!-- END serve options --> table"
    expected = markdown_table(_subparser("serve"))
    assert found.group(1) == expected, "stale: run `python scripts/readme_options.py` to regenerate it"
    for flag in ("--spec", "--metrics-port", "--stats-interval", "--engine-thread", "--flush-seconds"):
        assert f"| `{flag}` |" in expected


def test_draft_with_spec_none_is_refused_naming_the_field(tmp_path, capsys):
    with pytest.raises(InvalidArgument, match="draft: a drafter needs --spec dflash or --spec dspark"):
        EngineConfig(draft=str(tmp_path))
    assert main(["serve", "--draft", str(tmp_path)]) == 2
    assert "rollout serve: draft: " in capsys.readouterr().err


def test_a_missing_drafter_directory_is_reported_as_missing(tmp_path):
    from rollout import build_engine

    with pytest.raises(LoadError, match=r"drafter directory '.*nowhere' does not exist"):
        build_engine(EngineConfig(spec="dflash", draft=str(tmp_path / "nowhere")))
