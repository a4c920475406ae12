"""Chat prompts: rollout.engine.chat renders a model's chat template to the same token ids as
transformers' `apply_chat_template(..., add_generation_prompt=True, tokenize=True)` on the same
directory (tokenizer_config.json's template, chat_template.jinja, a named list; the sandbox's
globals and filters); refusals name the prompt; and chat prompts through the client and the
server, whose prompt_token_ids are transformers' ids."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil

import grpc
import pytest
from tokenizers import Tokenizer

from rollout.engine.chat import ChatPrompt, ChatTemplate, prompt_token_ids
from rollout.engine.config import DEFAULT_MODEL
from rollout.errors import InvalidArgument
from trainer_client.client import build_request, prompt_list

CHATS = [
    [{"role": "user", "content": "def f(x):"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo, 世界 <|im_end|>"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "\n\n  again"}],
]  # fmt: skip

# Uses what transformers' sandbox adds: tojson (no HTML escaping), namespace, loop controls, the
# special tokens, a {% generation %} block, and trim_blocks / lstrip_blocks around the tags.
RICH_TEMPLATE = """{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- set ns.count = ns.count + 1 %}
    {%- if message.role == 'system' %}{{ 'SYS ' + message.content | tojson + eos_token }}{% continue %}{% endif %}
    {{ '<|im_start|>' + message.role + ' ' + ns.count | string + '\n' }}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
    {%- else %}{{ message.content | tojson }}{% endif %}
    {{ '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant ' + dict(a=1) | tojson + '\n' }}{% endif %}"""


def _hf_ids(path, messages) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _ours(path, messages) -> list[int]:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return prompt_token_ids(tokenizer, ChatTemplate.load(path), 0, ChatPrompt(messages))


@pytest.fixture
def model_dir(tmp_path):
    """The embedded model's tokenizer files (its ChatML template in tokenizer_config.json)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(DEFAULT_MODEL / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("messages", CHATS)
def test_the_embedded_template_gives_transformers_ids(model_dir, messages):
    ours = _ours(model_dir, messages)
    assert ours == _hf_ids(model_dir, messages)
    assert ours[:1] == [259] and ours[-11:] == [259, *b"assistant\n"]  # <|im_start|> ... assistant header


def test_a_jinja_file_wins_and_the_sandbox_matches_transformers(model_dir):
    (model_dir / "chat_template.jinja").write_text(RICH_TEMPLATE)
    for messages in CHATS:
        ours = _ours(model_dir, messages)
        assert ours == _hf_ids(model_dir, messages)
    text = ChatTemplate.load(model_dir).render(CHATS[1])
    assert text.startswith('SYS "Be brief."<|endoftext|>') and '<|im_start|>user 2\n"héllo, 世界 <|im_end|>"' in text
    assert "<|im_start|>assistant 3\nok" in text and text.endswith('<|im_start|>assistant {"a": 1}\n')


def test_a_named_template_list_uses_default(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                               {"name": "default", "template": RICH_TEMPLATE}]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert _ours(model_dir, CHATS[1]) == _hf_ids(model_dir, CHATS[1])


def test_a_tokenizer_that_adds_a_bos_adds_it_to_text_not_to_chats(model_dir):
    """Like a Llama tokenizer: its post-processor prepends BOS to text; a chat template writes the BOS
    itself, and the rendered chat is tokenised without special tokens (one BOS, not two)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<|reserved_0|> $A",
                                                             special_tokens=[("<|reserved_0|>", 261)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|reserved_0|>"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text("{{ bos_token }}" + config["chat_template"])
    ours = _ours(model_dir, CHATS[0])
    assert ours == _hf_ids(model_dir, CHATS[0]) and ours.count(261) == 1 and ours[0] == 261
    text = prompt_token_ids(Tokenizer.from_file(str(model_dir / "tokenizer.json")), None, 0, "hi")
    assert text == [261, *b"hi"] == AutoTokenizer.from_pretrained(str(model_dir))("hi")["input_ids"]


def test_refusals_name_the_prompt(model_dir):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = ChatTemplate.load(model_dir)
    with pytest.raises(InvalidArgument, match=r"prompts\[3\]\.messages.*not tool"):
        prompt_token_ids(tokenizer, template, 3, ChatPrompt([{"role": "tool", "content": "x"}]))
    with pytest.raises(InvalidArgument, match=r"prompts\[0\]\.messages.*no message"):
        prompt_token_ids(tokenizer, template, 0, ChatPrompt([]))
    with pytest.raises(InvalidArgument, match=r"prompts\[1\]\.messages.*no chat template"):
        prompt_token_ids(tokenizer, None, 1, ChatPrompt(CHATS[0]))
    unsafe = "{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}"
    (model_dir / "chat_template.jinja").write_text(unsafe)
    with pytest.raises(InvalidArgument, match=r"prompts\[0\]\.messages.*unsafe"):  # sandboxed
        prompt_token_ids(tokenizer, ChatTemplate.load(model_dir), 0, ChatPrompt(CHATS[0]))


def test_client_prompt_forms():
    chat = CHATS[1]
    assert prompt_list(chat) == [chat] and prompt_list([chat, "x"]) == [chat, "x"]
    assert prompt_list([1, 2]) == [[1, 2]] and prompt_list("x") == ["x"]
    request = build_request([chat, "text", [5, 6]], 1, None, None, None, None)
    kinds = [p.WhichOneof("kind") for p in request.prompts]
    assert kinds == ["messages", "text", "token_ids"]
    assert [(m.role, m.content) for m in request.prompts[0].messages.messages] == [tuple(m.values()) for m in chat]
    for bad, field in [([{"role": "user"}], r"prompts\[0\]\.messages\[0\]"),
                       ([{"role": "user", "content": "x", "name": "n"}], r"prompts\[0\]\.messages\[0\]"),
                       ([[{"role": "user", "content": 3}]], r"prompts\[0\]\.messages\[0\]"),
                       (["ok", [1, "a"]], r"prompts\[1\]")]:  # fmt: skip
        with pytest.raises(InvalidArgument, match=field):
            build_request(bad, 1, None, None, None, None)


async def _aio_generate(address: str, chat):
    from trainer_client import AsyncRolloutClient

    async with AsyncRolloutClient(address, timeout=120) as client:
        return await client.generate(chat, sampling=dict(max_tokens=2))


def test_chat_prompts_through_the_server(tiny_random_qwen3):
    from rollout import build_engine
    from rollout.engine.config import EngineConfig
    from rollout.server.app import BackgroundServer, ServeConfig
    from trainer_client import RolloutClient

    config = EngineConfig(model=str(tiny_random_qwen3), num_kv_blocks=64)
    # in an engine process: the chat template reaches the server's admission from the child
    with BackgroundServer(functools.partial(build_engine, config), ServeConfig(port=0)) as server:
        with RolloutClient(server.address, timeout=120) as client:
            table = client.generate(CHATS[1], n=2, sampling=dict(temperature=0.0, max_tokens=3))
            both = client.generate([CHATS[0], "plain"], sampling=dict(max_tokens=2))
            with pytest.raises(grpc.RpcError) as err:
                client.generate([{"role": "tool", "content": "x"}], sampling=dict(max_tokens=2))
        by_aio = asyncio.run(_aio_generate(server.address, CHATS[1]))
    expected = _hf_ids(tiny_random_qwen3, CHATS[1])
    assert table.column("prompt_token_ids").to_pylist() == [expected, expected]
    assert by_aio.column("prompt_token_ids").to_pylist() == [expected]
    assert both.column("prompt_token_ids").to_pylist() == [_hf_ids(tiny_random_qwen3, CHATS[0]), list(b"plain")]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[0].messages" in err.value.details() and "not tool" in err.value.details()
