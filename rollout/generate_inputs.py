"""What `rollout generate` reads besides its sampling options: prompts (arguments, --messages chats,
a JSONL file) and the grammar (--grammar text or @FILE, its kind given or inferred). Every refusal
is an InvalidArgument naming the argument, and where it came from (file:line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.errors import InvalidArgument

JSONL_KEYS = ("prompt", "token_ids", "messages")


def read_prompts(texts: list[str], jsonl: str | None, messages: list[str] = ()) -> list[str | list]:
    """Prompts from arguments, chats from --messages (a JSON list of {"role", "content"}, or @FILE
    holding one), then from a JSONL file whose lines are a string, a list of token ids, or an
    object with one of JSONL_KEYS ("prompt": text, "token_ids", "messages": a chat)."""
    prompts: list[str | list] = list(texts)
    for i, chat in enumerate(messages):
        prompts.append(_chat(_json_argument(chat, f"messages[{i}]"), f"--messages #{i + 1}"))
    if jsonl:
        for lineno, line in enumerate(Path(jsonl).read_text().splitlines(), 1):
            if line.strip():
                prompts.append(_jsonl_prompt(_json_line(line, f"{jsonl}:{lineno}"), f"{jsonl}:{lineno}"))
    if not prompts:
        raise InvalidArgument("prompts", "give prompts as arguments, with --messages or with --prompts-file")
    return prompts


def _jsonl_prompt(item: Any, where: str) -> str | list:
    if isinstance(item, dict):
        keys = [k for k in JSONL_KEYS if k in item]
        if len(keys) != 1 or len(item) != 1:
            raise InvalidArgument("prompts", f"{where}: an object needs exactly one of the keys {JSONL_KEYS}, "
                                             f"got {sorted(item)}")
        if keys[0] == "messages":
            return _chat(item["messages"], where)
        item = item[keys[0]]
    if isinstance(item, str) or (isinstance(item, list) and all(isinstance(t, int) for t in item)):
        return item
    raise InvalidArgument(
        "prompts", f"{where}: expected a string, a list of token ids, or an object with one of {JSONL_KEYS}"
    )


def _chat(messages: Any, where: str) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
        for m in messages)
    if not ok:
        raise InvalidArgument("messages", f"{where}: expected a non-empty list of {{\"role\": str, \"content\": str}}")
    return messages


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgument("prompts", f"{where}: not JSON: {e}") from None


def _read_at(value: str, field: str) -> str:
    """An argument's text, or the contents of the file it names as @PATH."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as e:
        raise InvalidArgument(field, f"cannot read {value[1:]}: {e.strerror or e}") from None


def _json_argument(value: str, field: str) -> Any:
    try:
        return json.loads(_read_at(value, field))
    except json.JSONDecodeError as e:
        raise InvalidArgument(field, f"not JSON: {e}") from None


def cli_grammar(text: str | None, kind: str | None) -> tuple[str, str] | None:
    """--grammar (text or @FILE) and --grammar-kind -> (kind, value). Without a kind the grammar
    must be a JSON object, read as a JSON schema (a regex or EBNF grammar needs its kind)."""
    if text is None:
        if kind is not None:
            raise InvalidArgument("grammar_kind", "given without --grammar")
        return None
    value = _read_at(text, "grammar")
    if kind is None:
        try:
            is_object = isinstance(json.loads(value), dict)
        except json.JSONDecodeError:
            is_object = False
        if not is_object:
            raise InvalidArgument("grammar", "is not a JSON schema object; give --grammar-kind regex or ebnf for "
                                             "other grammars")
        kind = "json_schema"
    return kind, value
