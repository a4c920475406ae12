"""Checks the committed embedded target under rollout/assets/tiny-qwen3.

transformers must load it as Qwen3ForCausalLM, the weights must be small bfloat16
safetensors, the tokenizer must map id i to byte i with the documented special tokens, the
training record must carry the corpus hash and held-out loss, and the model must predict
held-out standard-library source far better than a uniform guess over bytes.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "rollout" / "assets" / "tiny-qwen3"
sys.path.insert(0, str(ROOT / "scripts"))

import corpus  # noqa: E402
from make_tokenizer import SPECIAL_TOKENS, byte_alphabet  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    m = transformers.Qwen3ForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(ASSET / "tokenizer.json"))


def test_config_is_the_documented_qwen3(model):
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (264, 256, 6)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.intermediate_size == 768 and cfg.tie_word_embeddings
    assert cfg.eos_token_id == 256 and cfg.bos_token_id == 256
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    raw = json.loads((ASSET / "config.json").read_text())
    assert raw["rope_theta"] == 10000.0 and raw["max_position_embeddings"] == 4096
    gen = json.loads((ASSET / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 256


def test_weights_are_small_bfloat16_safetensors():
    files = list(ASSET.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    assert files[0].stat().st_size <= 16 * 2**20
    with safe_open(files[0], framework="pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())


def test_token_id_i_is_byte_i(tok):
    alphabet = byte_alphabet()
    assert [tok.token_to_id(ch) for ch in alphabet] == list(range(256))
    # The BPE model alone (no merges) maps the 256 byte characters to ids 0..255 in order.
    assert [t.id for t in tok.model.tokenize("".join(alphabet))] == list(range(256))
    assert tok.get_vocab_size() == 264
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(256, 264))


def test_text_round_trips_through_its_bytes(tok):
    text = "def f(x):\n\treturn x\x00 + 'é€😀'\r\n" + "".join(map(chr, range(128)))
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    eos = tok.encode("a<|endoftext|>b<|mask|>").ids
    assert eos == [ord("a"), 256, ord("b"), 258]


def test_transformers_tokenizer_loads_with_specials():
    t = transformers.AutoTokenizer.from_pretrained(ASSET)
    assert (t.eos_token_id, t.pad_token_id, t.mask_token_id) == (256, 257, 258)
    assert t("héllo")["input_ids"] == list("héllo".encode())


def test_training_record():
    rec = json.loads((ASSET / "training.json").read_text())
    assert 0.3 < rec["heldout_loss_nats_per_byte"] < 1.2
    assert len(rec["corpus"]["file_list_sha256"]) == 64
    assert rec["corpus"]["num_heldout_files"] > 0 and rec["steps"] > 0


def test_predicts_heldout_source_better_than_uniform(model):
    path = corpus.heldout_files()[0]
    ids = torch.tensor([list(path.read_bytes()[:1024])])  # ids: [1, T]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # logits: [1, T, V]
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert loss < 2.0 < math.log(256)
