"""The target models: Qwen3 (q/k RMSNorm), Qwen3-MoE (Qwen3 with sparse expert MLPs, see moe.py)
and Llama 3 (llama3 RoPE scaling) as one decoder-only transformer with GQA, running a flattened
ragged batch against the paged KV cache.

Projections are packed for speed (`qkv_proj` = q|k|v, `gate_up_proj` = gate|up) and declare their
HF shard names, so the loader fills them from the usual `q_proj` / `k_proj` / ... tensors. The
pieces of a layer are exposed separately (`Attention.project_qkv`, `project_kv`, `o_proj`) so a
drafter can build Qwen3-style layers that attend to extra context K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollout.engine import triton_attention, triton_gemv, triton_ops, triton_prefix_attention
from rollout.engine.attention import AttentionMetadata, paged_attention
from rollout.engine.moe import MoeConfig, SparseMoeBlock
from rollout.engine.rope import ROPE_TYPES, RotaryEmbedding, apply_rope
from rollout.errors import LoadError

__all__ = [
    "MLP",
    "Attention",
    "DecoderLayer",
    "ModelConfig",
    "PackedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerLM",
    "apply_rope",
]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")
BACKENDS = ("torch", "triton")  # TransformerLM.set_kernel_backend
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "rms_norm_eps", "max_position_embeddings",
)  # fmt: skip
_POSITIVE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields of an HF config.json that the engine uses."""

    model_type: str  # "qwen3", "qwen3_moe" or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3" | "linear", ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    moe: MoeConfig | None = None  # qwen3_moe only

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise LoadError(f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if (self.model_type == "qwen3_moe") != (self.moe is not None):
            raise LoadError(f"config moe (num_experts, ...) goes with model_type 'qwen3_moe' only, "
                            f"got model_type {self.model_type!r} and moe {self.moe}")
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) <= 0:
                raise LoadError(f"config {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise LoadError(
                f"config num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise LoadError(f"config head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise LoadError(f"unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    def sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the experts MLP (SparseMoeBlock) instead of the dense one."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """Read an HF config.json dict (old `rope_theta`/`rope_scaling` or new `rope_parameters`)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LoadError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        missing = [key for key in _REQUIRED_KEYS if key not in d]
        if missing:
            raise LoadError(f"config.json is missing key(s) {missing}")
        _check_unsupported(d)
        rope_theta, rope_scaling = _rope_from_hf(d)
        heads = d["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d["max_position_embeddings"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            moe=MoeConfig.from_hf(d) if model_type == "qwen3_moe" else None,
        )


def _check_unsupported(d: dict) -> None:
    """Refuse config options the engine does not implement rather than computing something else."""
    if d.get("hidden_act", "silu") != "silu":
        raise LoadError(f"config hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("mlp_bias", False):
        raise LoadError("config mlp_bias=true is not supported")
    if d.get("use_sliding_window", False):
        raise LoadError("config use_sliding_window=true is not supported")


def _rope_from_hf(d: dict) -> tuple[float, dict | None]:
    params = d.get("rope_parameters")
    if params is None:
        scaling = d.get("rope_scaling")
        params = {**(scaling or {}), "rope_theta": d.get("rope_theta", 10000.0)}
    params = dict(params)
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


class RMSNorm(nn.Module):
    """y = weight * x / rms(x) over the last dim (torch's fused rms_norm; it normalises in float32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., size]
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class PackedLinear(nn.Linear):
    """A Linear whose output rows are several checkpoint tensors stacked, e.g. q|k|v.

    `shards` maps each checkpoint module name (e.g. "q_proj") to its number of output rows; the
    loader copies `<parent>.q_proj.weight` into the matching row range.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self, name: str) -> tuple[int, int]:
        """(start, size) of shard `name` in the output rows."""
        start = 0
        for shard, size in self.shards.items():
            if shard == name:
                return start, size
            start += size
        raise KeyError(name)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = PackedLinear(hidden_size, shards, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

        self.backend = "torch"  # "triton": fused silu * up (triton_ops.silu_mul), 1-token projections by triton_gemv

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, H]
        if self.backend == "triton":
            gate_up = triton_gemv.linear(x, self.gate_up_proj.weight)
            return triton_gemv.linear(triton_ops.silu_mul(gate_up), self.down_proj.weight)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """GQA self-attention with optional per-head q/k RMSNorm (Qwen3) and RoPE."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        shards = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        self.qkv_proj = PackedLinear(config.hidden_size, shards, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.rotary_eps = config.rms_norm_eps  # q/k norm epsilon
        self.backend = "torch"  # see TransformerLM.set_kernel_backend

    def _cos_sin(self, hidden: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor] | None):
        return cos_sin if cos_sin is not None else self.rotary.cos_sin(positions, hidden.dtype)

    def project_qkv(
        self, hidden: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """hidden: [T, H], positions: [T] -> q: [T, Hq, D], k, v: [T, Hkv, D]; q and k normed and rotated.

        `cos_sin` (from `rotary.cos_sin(positions, dtype)`) lets a caller share one lookup across layers.
        """
        cos, sin = self._cos_sin(hidden, positions, cos_sin)
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(-1, self.num_kv_heads, self.head_dim)

    def project_kv(
        self, hidden: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys and values only (e.g. a drafter's context): hidden: [N, H] -> k, v: [N, Hkv, D], k rotated."""
        cos, sin = self._cos_sin(hidden, positions, cos_sin)
        bias = self.qkv_proj.bias[self.q_size :] if self.qkv_proj.bias is not None else None
        kv = F.linear(hidden, self.qkv_proj.weight[self.q_size :], bias)  # [N, 2 * kv_size]
        k, v = kv.view(-1, 2 * self.num_kv_heads, self.head_dim).split(self.num_kv_heads, dim=1)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        hidden: Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[Tensor, Tensor],
        cos_sin: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        # hidden: [T, H] -> [T, H]; cos_sin: the torch path's shared RoPE lookup (the kernel reads the table)
        if self.backend == "triton":  # norms, RoPE and the cache write in one kernel, then paged attention
            qkv = triton_gemv.linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)  # [T, q + 2 kv]
            q = triton_ops.qk_norm_rope_store(
                qkv, meta.positions, self.rotary.table(hidden.device, hidden.dtype),
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None, self.rotary_eps,
                self.num_heads, self.num_kv_heads, self.head_dim, kv_cache[0], kv_cache[1], meta.slot_mapping)
            if meta.shared is not None:  # blocks shared by several sequences read once for all of them
                out = triton_prefix_attention.shared_prefix_attention_triton(
                    q, kv_cache[0], kv_cache[1], meta.block_tables, meta.positions, meta.shared, self.scale)
            else:
                out = triton_attention.paged_attention_triton(
                    q, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                    meta.max_query_len, meta.max_context_len, self.scale)
            return triton_gemv.linear(out.view(-1, self.q_size), self.o_proj.weight, self.o_proj.bias)
        q, k, v = self.project_qkv(hidden, meta.positions, cos_sin)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.view(-1, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)). `sparse`: the MLP is the
    mixture of experts of `config.moe`."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sparse: bool = False):
        super().__init__()
        self.self_attn = Attention(config, rotary)
        self.mlp = (SparseMoeBlock(config.hidden_size, config.moe) if sparse
                    else MLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[Tensor, Tensor],
        cos_sin: tuple[Tensor, Tensor],
    ) -> Tensor:
        # hidden: [T, H] -> [T, H] (the residual stream after this layer)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), meta, kv_cache, cos_sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, pending: Tensor | None, residual: Tensor, meta: AttentionMetadata,
                      kv_cache: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """`forward` with the residual adds fused into the norms (Triton): the residual stream
        is `residual + pending` (pending: the previous layer's MLP output, None before layer 0).
        Returns this layer's (pending, residual)."""
        attn, residual = self.attend_fused(pending, residual, meta, kv_cache)
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, SparseMoeBlock) and self.mlp.router_in_norm(residual.shape[0]):
            normed, residual, logits = triton_ops.add_rms_norm_router(attn, residual, norm.weight, norm.eps,
                                                                      self.mlp.gate.weight)
            return self.mlp(normed, logits), residual
        normed, residual = triton_ops.add_rms_norm(attn, residual, norm.weight, norm.eps)
        return self.mlp(normed), residual

    def attend_fused(self, pending: Tensor | None, residual: Tensor, meta: AttentionMetadata,
                     kv_cache: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """`forward_fused`'s attention: (its output, the residual stream it adds to)."""
        eps = self.input_layernorm.eps
        if pending is None:
            normed = self.input_layernorm(residual)
        else:
            normed, residual = triton_ops.add_rms_norm(pending, residual, self.input_layernorm.weight, eps)
        return self.self_attn(normed, meta, kv_cache, None), residual


class TransformerLM(nn.Module):
    """Qwen3 / Qwen3-MoE / Llama 3 causal LM over a flattened ragged batch and a paged KV cache."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary, config.sparse_layer(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.backend = "torch"  # see set_kernel_backend
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them (re-run after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def set_kernel_backend(self, backend: str) -> None:
        """"triton": every layer runs the fused kernels of triton_ops / triton_attention; "torch":
        the reference ops (attention.py, this file), which the kernels are tested against."""
        if backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        for layer in self.layers:
            layer.self_attn.backend = layer.mlp.backend = backend

    def checkpoint_name(self, name: str) -> str:
        """HF checkpoint name of a module-relative parameter name (all but lm_head live under `model.`)."""
        return name if name.startswith("lm_head.") else f"model.{name}"

    def forward(
        self,
        input_ids: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[Tensor, Tensor]],
        hidden_layer_ids: tuple[int, ...] = (),
    ) -> tuple[Tensor, Tensor | None]:
        """input_ids: [T] -> (hidden [T, H] after the final norm, aux [T, len(ids) * H] or None).

        kv_caches: one (k_cache, v_cache) per layer, each [NB, BS, Hkv, D]. `aux` concatenates, in
        the order given, the outputs of decoder layers `hidden_layer_ids` (0-based) exactly as HF's
        `hidden_states[i + 1]`: the residual stream after layer i, except for the last layer, whose
        entry HF stores after the final norm. Drafters are trained on HF's hidden states, so a
        drafter reading the last layer gets the normed output here too.
        """
        hidden = self.embed_tokens(input_ids)  # [T, H]
        wanted = set(hidden_layer_ids)
        if not wanted <= set(range(len(self.layers))):
            raise ValueError(f"hidden_layer_ids {hidden_layer_ids} out of range [0, {len(self.layers)})")
        taps: dict[int, Tensor] = {}
        last = len(self.layers) - 1
        if self.backend == "triton":
            pending = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                pending, hidden = layer.forward_fused(pending, hidden, meta, kv_cache)
                if i in wanted and i < last:
                    taps[i] = hidden + pending
            out, _ = triton_ops.add_rms_norm(pending, hidden, self.norm.weight, self.norm.eps)
        else:
            cos_sin = self.rotary.cos_sin(meta.positions, hidden.dtype)
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                hidden = layer(hidden, meta, kv_cache, cos_sin)
                if i in wanted and i < last:
                    taps[i] = hidden
            out = self.norm(hidden)
        if last in wanted:
            taps[last] = out
        aux = torch.cat([taps[i] for i in hidden_layer_ids], dim=-1) if taps else None
        return out, aux

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [N, H] -> logits [N, V] in float32."""
        if self.backend == "triton":
            return triton_gemv.linear(hidden, self.lm_head.weight, self.lm_head.bias).float()
        return self.lm_head(hidden).float()
