"""Logits parity of the paged-KV TransformerLM with transformers' full forward (float32, CPU).

Random small Qwen3, Qwen3-MoE and Llama checkpoints (GQA and MHA, tied and untied, attention bias,
Llama 3 RoPE scaling, sparse and dense MoE layers, a sharded checkpoint) are saved with
transformers and loaded with `load_model`.
Several prompts of mixed lengths go through the paged cache (block size 4, scattered block ids)
in ragged chunks, then single-token decode steps; every logit row and the requested hidden
layers must match transformers on the full sequences.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import save_random_hf_model

from rollout.engine.attention import AttentionMetadata
from rollout.engine.loader import load_model

BLOCK_SIZE = 4
SMALL = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
CASES = {
    "qwen3-gqa-tied": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=True),
    "qwen3-mqa-bias-untied": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=32, attention_bias=True, tie_word_embeddings=False),
    "llama3-gqa-scaled": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "llama-mha-tied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4,
                           tie_word_embeddings=True, attention_bias=True),
    # layers 0 and 2 sparse (6 experts, top 2, renormalised), layer 1 dense
    "qwen3-moe-renorm": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    # only layer 1 sparse (decoder_sparse_step 2), 4 experts, top 3, not renormalised
    "qwen3-moe-step2-tied": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                 tie_word_embeddings=True, num_experts=4, num_experts_per_tok=3,
                                 moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2),
}  # fmt: skip


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


class PagedRunner:
    """Drives a model through the paged cache the way the engine does: per step, each active
    sequence brings its next few tokens; blocks come from a shuffled pool."""

    def __init__(self, model, seqs: list[list[int]], num_blocks: int = 64, seed: int = 0):
        cfg = model.config
        self.model, self.seqs = model, seqs
        shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
        pool = list(range(num_blocks))
        random.Random(seed).shuffle(pool)
        self.tables = []
        for seq in seqs:
            need = -(-len(seq) // BLOCK_SIZE)
            self.tables.append([pool.pop() for _ in range(need)])
        self.done = [0] * len(seqs)

    def metadata(self, chunks: dict[int, int]) -> tuple[torch.Tensor, AttentionMetadata]:
        ids, pos, slots, cu, ctx = [], [], [], [0], []
        for s, n in chunks.items():
            start = self.done[s]
            ids += self.seqs[s][start : start + n]
            for p in range(start, start + n):
                pos.append(p)
                slots.append(self.tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            cu.append(cu[-1] + n)
            ctx.append(start + n)
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        meta = AttentionMetadata(
            positions=torch.tensor(pos), slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu),
            context_lens=torch.tensor(ctx), block_tables=torch.tensor(tables),
            max_query_len=max(chunks.values()), max_context_len=max(ctx), block_size=BLOCK_SIZE,
        )  # fmt: skip
        return torch.tensor(ids), meta

    def step(self, chunks: dict[int, int], layer_ids: tuple[int, ...]):
        """Run one step; returns {seq: (logits [n, V], aux [n, k*H])} for the tokens it computed."""
        input_ids, meta = self.metadata(chunks)
        with torch.no_grad():
            hidden, aux = self.model(input_ids, meta, self.kv_caches, hidden_layer_ids=layer_ids)
            logits = self.model.compute_logits(hidden)
        out, offset = {}, 0
        for s, n in chunks.items():
            out[s] = (logits[offset : offset + n], aux[offset : offset + n])
            offset += n
            self.done[s] += n
        return out, meta.is_decode


def run_schedule(model, prompts: list[list[int]], suffixes: list[list[int]], layer_ids, seed: int = 0):
    """Prefill every prompt in random chunks (1..6 tokens; sequences start at different steps),
    then decode the suffix tokens one at a time. Returns per-sequence logits, aux, step kinds."""
    rng = random.Random(seed)
    seqs = [p + s for p, s in zip(prompts, suffixes)]
    runner = PagedRunner(model, seqs, seed=seed)
    logits = [[] for _ in seqs]
    aux = [[] for _ in seqs]
    kinds = set()
    step = 0
    while any(d < len(s) for d, s in zip(runner.done, seqs)):
        chunks = {}
        for s, seq in enumerate(seqs):
            left = len(seq) - runner.done[s]
            if left == 0 or step < s:  # sequence s joins at step s
                continue
            in_prompt = runner.done[s] < len(prompts[s])
            n = min(rng.randint(1, 6), len(prompts[s]) - runner.done[s]) if in_prompt else 1
            chunks[s] = n
        out, is_decode = runner.step(chunks, layer_ids)
        kinds.add("decode" if is_decode else "mixed")
        for s, (lg, ax) in out.items():
            logits[s].append(lg)
            aux[s].append(ax)
        step += 1
    return [torch.cat(x) for x in logits], [torch.cat(x) for x in aux], kinds


def hf_reference(hf_model, seq: list[int]):
    with torch.no_grad():
        out = hf_model(torch.tensor([seq]), output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def check_parity(hf_model, path: Path, vocab_size: int, seed: int = 0, tol: float = 1e-4):
    loaded = load_model(path)
    model = loaded.model
    gen = torch.Generator().manual_seed(seed)
    lengths = [(9, 4), (3, 5), (14, 3), (1, 6)]
    prompts = [torch.randint(0, vocab_size, (p,), generator=gen).tolist() for p, _ in lengths]
    suffixes = [torch.randint(0, vocab_size, (d,), generator=gen).tolist() for _, d in lengths]
    # the last layer's tap is HF's hidden_states[-1], which is after the final norm (drafters
    # trained on HF hidden states read it that way)
    layer_ids = (model.config.num_hidden_layers - 2, 0, model.config.num_hidden_layers - 1)
    logits, aux, kinds = run_schedule(model, prompts, suffixes, layer_ids, seed=seed)
    assert kinds == {"decode", "mixed"}
    for s in range(len(prompts)):
        ref_logits, ref_hidden = hf_reference(hf_model, prompts[s] + suffixes[s])
        assert logits[s].dtype == torch.float32
        assert rel_err(logits[s], ref_logits) < tol, f"seq {s} logits"
        ref_aux = torch.cat([ref_hidden[i + 1] for i in layer_ids], dim=-1)
        assert rel_err(aux[s], ref_aux) < tol, f"seq {s} aux hidden states"
    return loaded


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_hidden_match_transformers(case, tmp_path):
    config = {**SMALL, **CASES[case]}
    hf_model = save_random_hf_model(tmp_path, seed=1, **config)
    loaded = check_parity(hf_model, tmp_path, config["vocab_size"])
    assert loaded.config.tie_word_embeddings == config["tie_word_embeddings"]
    assert (loaded.model.lm_head.weight is loaded.model.embed_tokens.weight) == config["tie_word_embeddings"]


def test_sharded_checkpoint_matches(tmp_path):
    config = {**SMALL, **CASES["qwen3-gqa-tied"]}
    hf_model = save_random_hf_model(tmp_path, seed=2, max_shard_size="40KB", **config)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    check_parity(hf_model, tmp_path, config["vocab_size"], seed=2)


def test_tiny_random_qwen3_fixture_loads(tiny_random_qwen3):
    loaded = load_model(tiny_random_qwen3)
    assert loaded.eos_token_ids == [256]
    assert loaded.tokenizer.encode("hé").ids == [104, 0xC3, 0xA9]
    assert loaded.name == tiny_random_qwen3.name


@pytest.mark.parametrize("case", ["qwen3-mqa-bias-untied", "llama-mha-tied"])
def test_project_kv_equals_the_kv_of_project_qkv(case, tmp_path):
    save_random_hf_model(tmp_path, seed=3, **{**SMALL, **CASES[case]})
    attn = load_model(tmp_path).model.layers[1].self_attn
    hidden, positions = torch.randn(7, SMALL["hidden_size"]), torch.tensor([0, 1, 2, 9, 10, 40, 41])
    _, k, v = attn.project_qkv(hidden, positions)
    k2, v2 = attn.project_kv(hidden, positions)
    torch.testing.assert_close(k2, k)
    torch.testing.assert_close(v2, v)


EMBEDDED = Path(__file__).resolve().parents[1] / "rollout" / "assets" / "tiny-qwen3"


@pytest.mark.skipif(not (EMBEDDED / "config.json").is_file(), reason="embedded tiny-qwen3 not built yet")
def test_embedded_tiny_qwen3_matches_transformers():
    import transformers

    hf_model = transformers.Qwen3ForCausalLM.from_pretrained(EMBEDDED, dtype=torch.float32).eval()
    loaded = check_parity(hf_model, EMBEDDED, hf_model.config.vocab_size)
    assert loaded.config.model_type == "qwen3" and loaded.config.tie_word_embeddings
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("def f(x):\n").ids) == "def f(x):\n"
    assert loaded.eos_token_ids == [256]
