"""Rotary position embeddings as Qwen3 and Llama use them: the half-split ("rotate_half") layout,
default inverse frequencies, and the "linear" and "llama3" frequency scalings.

`RotaryEmbedding` keeps one table `[max_position_embeddings, 2 * D]`, computed in float32 once
per (device, dtype) and then only indexed by position, so a forward step costs one gather for
all layers. Each row holds `cos = [c, c]` and a signed `sin = [-s, s]`, so that rotating is
`x * cos + roll(x, D/2) * sin`: three kernels instead of seven for the textbook
`cat(x1 c - x2 s, x2 c + x1 s)`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies [D/2] in float32 for a rope type in ROPE_TYPES."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin of positions; holds no parameters (nothing to load, nothing in state_dict)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._tables: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def table(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """[max_positions, 2 * D]: per position `[c, c, -s, s]` (c, s: cos, sin of the D/2 angles)."""
        key = (torch.device(device), dtype)
        if key not in self._tables:
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device, non_blocking=True)  # [D/2]
            freqs = torch.outer(torch.arange(self.max_positions, device=device).float(), inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
            self._tables[key] = torch.cat([cos, cos, -sin, sin], dim=-1).to(dtype)
        return self._tables[key]

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [T] int64 -> (cos, signed sin), each [T, D] in `dtype`, for `apply_rope`."""
        return self.table(positions.device, dtype)[positions].chunk(2, dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, theta={self.theta}"


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x: [T, H, D] (half-split layout) by `RotaryEmbedding.cos_sin`'s cos, signed sin: [T, D].

    Equals HF's `x * cos + rotate_half(x) * sin`: roll(x) = [x2, x1] times [-s, s] is [-x2 s, x1 s].
    """
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [T, H, D]
    return torch.addcmul(x * cos[:, None, :], rolled, sin[:, None, :])
