"""Command-line options generated from configuration dataclasses, so each default, choice list and
help text lives once: beside its field.

    @dataclass(frozen=True)
    class ServeConfig:
        port: int = option(50051, "TCP port; 0 = pick a free one (printed)")

`add_options(parser, ServeConfig)` adds `--port` (its type from the annotation, `(default: 50051)`
appended to the help), and `from_options(ServeConfig, args)` builds the dataclass back from the
parsed namespace: every field is read by its own name, so a field without a flag is an error, not
a silent fallback to its default. Booleans are switches that flip the default (`--no-NAME` for a
True default, `--NAME` for a False one, or the field's `flag`); a field whose type is itself a
dataclass contributes its fields under its name (`flush: FlushPolicy` -> `--flush-rows`).
Adding an option to `rollout serve` is adding a field.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple | None = None,
           flag: str | None = None, metavar: str | None = None, default_text: str | None = None,
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is also a command-line option. `default_text` says what the default
    means when the value alone does not (None: "sized from memory"); `flag` overrides the name."""
    metadata = {"help": help, "choices": choices, "flag": flag, "metavar": metavar, "default_text": default_text}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One generated option: its flag, where it lands in the namespace, and how it parses."""

    flag: str
    dest: str
    default: Any
    kind: type  # int, float, str or bool (a switch)
    choices: tuple | None
    metavar: str | None
    help: str


def option_specs(cls: type, prefix: str = "") -> list[OptionSpec]:
    """The options of a configuration dataclass, nested dataclasses flattened under their name."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        kind = _scalar(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(kind):
            specs += option_specs(kind, f"{prefix}{f.name}_")
            continue
        meta = f.metadata
        if "help" not in meta:
            raise TypeError(f"{cls.__name__}.{f.name} is not an option(...): give it a help text")
        dest = prefix + f.name
        specs.append(OptionSpec(_flag(dest, kind, default, meta.get("flag")), dest, default, kind,
                                meta.get("choices"), meta.get("metavar"), _help(meta, kind, default)))
    return specs


def add_options(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Adds one flag per option of `cls` to `parser` (in a group titled `title`, if given)."""
    group = parser.add_argument_group(title) if title else parser
    for spec in option_specs(cls):
        if spec.kind is bool:
            action = "store_false" if spec.default else "store_true"
            group.add_argument(spec.flag, dest=spec.dest, action=action, default=spec.default, help=spec.help)
        else:
            group.add_argument(spec.flag, dest=spec.dest, type=spec.kind, default=spec.default,
                               choices=spec.choices, help=spec.help, metavar=_metavar(spec))


def from_options(cls: type, args: argparse.Namespace, prefix: str = "") -> Any:
    """`cls` built from the namespace `add_options(parser, cls)` filled (nested ones too)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        kind = _scalar(hints[f.name])
        if dataclasses.is_dataclass(kind):
            values[f.name] = from_options(kind, args, f"{prefix}{f.name}_")
        else:
            values[f.name] = getattr(args, prefix + f.name)  # AttributeError: a field without its flag
    return cls(**values)


def markdown_table(parser: argparse.ArgumentParser) -> str:
    """The parser's options as a Markdown table (flag, default, what it does), for the README."""
    rows = ["| option | default | what it does |", "| --- | --- | --- |"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        text, _, default = (action.help or "").replace("%%", "%").rpartition(" (default: ")
        choices = f" One of {', '.join(map(str, action.choices))}." if action.choices else ""
        rows.append(f"| `{action.option_strings[-1]}` | {default.removesuffix(')') or '-'} | "
                    f"{_sentence(text)}{choices} |")
    return "\n".join(rows) + "\n"


def _scalar(hint: Any) -> Any:
    """`int | None` -> int; other annotations unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _flag(dest: str, kind: type, default: Any, flag: str | None) -> str:
    if flag:
        return flag
    name = dest.replace("_", "-")
    return f"--no-{name}" if kind is bool and default else f"--{name}"


def _help(meta: typing.Mapping, kind: type, default: Any) -> str:
    text = meta.get("default_text")
    if text is None:
        if kind is bool:
            text = "on" if default else "off"
        else:
            text = "none" if default is None else str(default)
    return f"{meta['help']} (default: {text})".replace("%", "%%")  # (argparse formats help with %)


def _metavar(spec: OptionSpec) -> str | None:
    if spec.metavar or spec.choices:
        return spec.metavar or "{" + ",".join(map(str, spec.choices)) + "}"
    return spec.dest.upper().rpartition("_")[2] if spec.kind is str else spec.kind.__name__.upper()


def _sentence(text: str) -> str:
    text = text.replace("|", "\\|").strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
