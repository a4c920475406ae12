"""Prompts to token ids: text through the model's tokenizer, chat messages through its chat template.

A chat prompt is a list of {"role", "content"} messages. The server renders it with the model's
own template, the way transformers' `apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)` does, so the ids are the same as a trainer's transformers tokenizer gives:

* the template: `chat_template.jinja` in the model directory, else `chat_template` in
  tokenizer_config.json (a string, or a list of named templates whose "default" is used);
* a jinja2 `ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the loopcontrols
  extension, a `{% generation %}` block (which marks assistant text for transformers and renders
  its body here), the globals `raise_exception`, `strftime_now`, `dict` and `namespace` (which
  refuses underscore names) and a `tojson` filter that does not escape HTML;
* the template sees `messages`, `add_generation_prompt=True`, `tools=None`, `documents=None` and
  the tokenizer's named special tokens (`bos_token`, `eos_token`, ... as strings) from
  tokenizer_config.json (else special_tokens_map.json);
* the text is tokenised without adding special tokens (the template writes the ones it wants).

Text prompts are tokenised as they are (with the tokenizer's own special tokens, e.g. a BOS).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from rollout.errors import InvalidArgument, LoadError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt given as chat messages, each {"role": str, "content": str}."""

    messages: Messages


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template and the special tokens it may refer to (picklable: the compiled
    template is cached per source)."""

    source: str
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text), e.g. ("eos_token", "<|endoftext|>")

    @classmethod
    def load(cls, root: Path) -> ChatTemplate | None:
        """The template of a model directory, None when it has none. Raises LoadError when the
        template is unreadable or does not compile."""
        config = _read_json(root / "tokenizer_config.json")
        source = _template_source(root, config)
        if source is None:
            return None
        try:
            _compile(source)
        except Exception as e:  # jinja2.TemplateSyntaxError, or a bad extension use
            raise LoadError(f"the chat template of {root} does not compile: {e}") from e
        return cls(source, _special_tokens(root, config))

    def render(self, messages: Messages, field: str = "messages") -> str:
        """The conversation as text, ending with the generation prompt. InvalidArgument (naming
        `field`) when the template refuses it (raise_exception) or fails on it."""
        import jinja2

        try:
            return _compile(self.source).render(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=True, **dict(self.special_tokens))
        except jinja2.TemplateError as e:
            raise InvalidArgument(field, f"the model's chat template refused them: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InvalidArgument(field, f"the model's chat template failed on them: {e!r}") from None


def prompt_token_ids(tokenizer: Any, template: ChatTemplate | None, index: int,
                     prompt: list[int] | str | ChatPrompt) -> list[int]:
    """One prompt of a request (token ids, text or chat messages) as token ids; errors name
    `prompts[index]`."""
    if not isinstance(prompt, str | ChatPrompt):
        return prompt
    field = f"prompts[{index}]." + ("text" if isinstance(prompt, str) else "messages")
    if tokenizer is None:
        raise InvalidArgument(field, "the model has no tokenizer (tokenizer.json): send token_ids")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt).ids
    if template is None:
        raise InvalidArgument(field, f"the model has no chat template ({TEMPLATE_FILE}, or chat_template in "
                                     f"tokenizer_config.json): send text or token_ids")
    if not prompt.messages:
        raise InvalidArgument(field, "holds no message")
    return tokenizer.encode(template.render(prompt.messages, field), add_special_tokens=False).ids


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read {path}: {e}") from e


def _template_source(root: Path, config: dict) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (named list: "default")."""
    file = root / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) and source else None


def _special_tokens(root: Path, config: dict) -> tuple[tuple[str, str], ...]:
    """The named special tokens as text: tokenizer_config.json, then special_tokens_map.json."""
    fallback = _read_json(root / "special_tokens_map.json")
    out = []
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name, fallback.get(name))
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out.append((name, value))
    return tuple(out)


@lru_cache(maxsize=8)
def _compile(source: str):
    """The template in transformers' sandbox (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_block(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_namespace_class())
    return env.from_string(source)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type's other attributes."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _namespace_class():
    """jinja2's `namespace` refusing attribute names that start with an underscore."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja2's own signature trick: `namespace(self=...)` works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


@lru_cache(maxsize=1)
def _generation_block():
    """The `{% generation %}...{% endgeneration %}` tag of transformers' templates: renders its body."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock
