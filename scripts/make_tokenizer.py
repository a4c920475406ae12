"""Writes the byte-level tokenizer of the embedded models (tokenizer.json and its configs).

Id i is byte i for i in 0..255: a BPE model with no merges over the byte-level alphabet
(each byte shown as one printable character, as GPT-2 does), behind the ByteLevel
pre-tokenizer and decoder, so any UTF-8 text encodes to exactly its bytes and decodes back.
Special tokens follow the bytes: 256 `<|endoftext|>` (EOS), 257 `<|pad|>`, 258 `<|mask|>`
(the drafters' MASK token), 259 `<|im_start|>`, 260 `<|im_end|>`, 261..263 reserved. The
tokenizer_config.json carries a small ChatML chat template (`CHAT_TEMPLATE`) for chat prompts.
Vocabulary size 264. Run: `python scripts/make_tokenizer.py DIR`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# ChatML: <|im_start|>ROLE\nCONTENT<|im_end|>\n per message, then the assistant's header.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|pad|>", "<|mask|>", "<|im_start|>", "<|im_end|>",
    "<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>",
)
EOS_ID, PAD_ID, MASK_ID = 256, 257, 258
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def byte_alphabet() -> list[str]:
    """The printable character standing for each byte, indexed by byte value.

    Bytes that are visible Latin-1 characters stand for themselves; the others (controls,
    space, soft hyphen...) are shifted to code points 256, 257, ... in byte order.
    """
    visible = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in visible:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def build_tokenizer() -> Tokenizer:
    vocab = {ch: b for b, ch in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id("<|endoftext|>") != EOS_ID:
        raise RuntimeError("tokenizer ids do not follow the 256 bytes + specials layout")
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "mask_token": "<|mask|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out: Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    config = tokenizer_config()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {k: config[k] for k in ("eos_token", "pad_token", "mask_token",
                                        "additional_special_tokens")}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    write_tokenizer(parser.parse_args().out)


if __name__ == "__main__":
    main()
