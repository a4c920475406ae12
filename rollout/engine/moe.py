"""Qwen3-MoE sparse feed-forward: a router picks `num_experts_per_tok` of `num_experts` SwiGLU
experts for each token and sums their outputs weighted by the router's probabilities.

Routing is transformers' (`Qwen3MoeTopKRouter`): softmax of the router logits in float32, the
k largest probabilities, divided by their sum when `norm_topk_prob`, cast to the model dtype.
Ties go to the lowest expert id (a stable descending sort). transformers calls `torch.topk`,
which leaves the order of equal values to the implementation (on CPU it is not the lowest id),
so the two agree whenever the k-th and (k+1)-th probabilities differ, and this module and its
Triton kernel always agree with each other.

Expert weights are stored fused as transformers 5 holds them (`experts.gate_up_proj`
[E, 2I, H] = gate | up, `experts.down_proj` [E, H, I]). `FusedExperts.expert_slots` names each
expert's slice the way published checkpoints store it (`experts.{e}.gate_proj.weight`, ...), so
the loader fills the fused tensors from either layout.

`experts_reference` is the torch path (CPU) and the kernel's reference: every expert runs over
every token and a dense [T, E] routing matrix (zero where a token did not pick the expert) weighs
the results, so shapes are static and nothing is read back to the host (CUDA graphs stay
possible); it costs E / k times the kernel's arithmetic. `triton_moe.fused_moe` is the kernel
path: per-pair GEMVs for small steps, tokens sorted by expert and grouped GEMMs for larger ones,
with launch parameters per step size from `moe_launch.LAUNCHES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollout.engine import moe_launch, triton_moe
from rollout.errors import LoadError

_REQUIRED_KEYS = ("num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class MoeConfig:
    """The sparse-MLP fields of a Qwen3-MoE config.json. Layer i is sparse unless it is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (transformers' rule);
    dense layers are the usual MLP of width `intermediate_size`."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise LoadError(f"config {name} must be > 0, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise LoadError(f"config num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                            f"num_experts ({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, d: dict) -> MoeConfig:
        """Read a qwen3_moe config.json dict (`num_experts`, or `num_local_experts` as
        transformers 5 writes it). Refuses the Qwen2-MoE shared expert."""
        missing = [key for key in _REQUIRED_KEYS if key not in d]
        if missing:
            raise LoadError(f"config.json is missing key(s) {missing}")
        if d.get("shared_expert_intermediate_size"):
            raise LoadError("config shared_expert_intermediate_size: a shared expert (Qwen2-MoE) is not supported")
        layers = d.get("mlp_only_layers") or []
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            raise LoadError(f"config mlp_only_layers must be a list of layer indices, got {layers!r}")
        return cls(
            num_experts=_num_experts(d),
            num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=d["moe_intermediate_size"],
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(layers),
        )


def _num_experts(d: dict) -> int:
    given = {key: d[key] for key in ("num_experts", "num_local_experts") if d.get(key) is not None}
    if not given:
        raise LoadError("config.json is missing key(s) ['num_experts']")
    if len(set(given.values())) > 1:
        raise LoadError(f"config num_experts and num_local_experts disagree: {given}")
    return next(iter(given.values()))


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """router_logits: [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64),
    by descending probability, ties to the lowest id."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(router_logits.dtype), ids


def experts_reference(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; weights, ids: [T, k] -> [T, H]:
    sum over the k picks of weight * down(silu(gate(x)) * up(x)), accumulated in expert order."""
    num_experts = gate_up.shape[0]
    dense = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device)
    dense.scatter_(1, ids, weights)  # [T, E]: a token's weight for each expert, 0 if not picked
    out = torch.zeros_like(x)
    for e in range(num_experts):
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)  # [T, I] each
        out += F.linear(F.silu(gate) * up, down[e]) * dense[:, e, None]
    return out


class FusedExperts(nn.Module):
    """All experts' SwiGLU weights of one layer, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert_slots(self, param_name: str) -> list[tuple[str, int | tuple[int, slice]]]:
        """The per-expert checkpoint names (relative to this module) that fill `param_name`,
        each with its index into the fused parameter."""
        num_experts, size = self.down_proj.shape[0], self.down_proj.shape[2]
        if param_name == "down_proj":
            return [(f"{e}.down_proj.weight", e) for e in range(num_experts)]
        halves = (("gate_proj", slice(0, size)), ("up_proj", slice(size, 2 * size)))
        return [(f"{e}.{name}.weight", (e, rows)) for e in range(num_experts) for name, rows in halves]


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a [E, H] linear) + experts; replaces the MLP in a Qwen3-MoE sparse layer."""

    def __init__(self, hidden_size: int, config: MoeConfig):
        super().__init__()
        self.gate = nn.Linear(hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, hidden_size, config.moe_intermediate_size)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.backend = "torch"  # "triton": triton_moe.fused_moe

    def router_in_norm(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` takes its router logits from the norm's launch
        (triton_ops.add_rms_norm_router) rather than from `gate`: the launch table's choice."""
        return self.backend == "triton" and moe_launch.launch_for(num_tokens).router_in_norm

    def forward(self, x: Tensor, logits: Tensor | None = None) -> Tensor:
        # x: [T, H] -> [T, H]; logits: the router's [T, E] when already computed
        if logits is None:
            logits = self.gate(x)  # [T, E]
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if self.backend == "triton":
            return triton_moe.fused_moe(x, logits, gate_up, down, self.top_k, self.renormalize)
        weights, ids = route(logits, self.top_k, self.renormalize)
        return experts_reference(x, gate_up, down, weights, ids)
