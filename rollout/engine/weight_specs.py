"""What a weight update may carry: every tensor the target (and the drafter) accepts, by name,
with its shape and the dtype it is stored in.

Names are checkpoint names (`model.layers.0.mlp.down_proj.weight`); a leading `model.` is
dropped to get the key. A tied alias (`lm_head.weight` of a model with tied embeddings) is
accepted with the shape of the parameter it shares; its value is checked against that
parameter's, never loaded on its own (rollout.engine.weight_stage). The specs are plain data:
the server's process keeps a copy to check each tensor from the first piece of it that arrives,
before any of its bytes are held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from rollout.engine.loader import param_slots
from rollout.errors import InvalidArgument

# The dtypes a tensor may arrive in (it is cast to the parameter's dtype as it lands).
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}  # fmt: skip
ALIGN = 4096  # staging offsets are page aligned


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """One accepted tensor: its shape, the dtype it is stored in, and for a tied alias the key of
    the tensor it must equal."""

    shape: tuple[int, ...]
    dtype: str
    alias_of: str | None = None
    # a parameter that comes whole or in parts (fused experts: `experts.gate_up_proj` or each expert's
    # gate and up): the whole one's key, on the whole and on every part
    either_of: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * FLOAT_DTYPES[self.dtype].itemsize


def model_specs(model: nn.Module) -> dict[str, TensorSpec]:
    """Key -> spec for every parameter of `model` (packed projections by their shard names) and
    every tied alias."""
    slots, aliases = param_slots(model)
    whole = {id(param): key for key, (param, rows) in slots.items() if rows is None}
    in_parts = {id(param) for param, rows in slots.values() if rows is not None}
    specs = {}
    for key, (param, rows) in slots.items():
        dest = param.data if rows is None else param.data[rows]
        either = whole.get(id(param)) if rows is not None else (key if id(param) in in_parts else None)
        specs[key] = TensorSpec(tuple(dest.shape), dtype_name(param.dtype), either_of=either)
    for alias, key in aliases.items():
        specs[alias] = TensorSpec(specs[key].shape, specs[key].dtype, alias_of=key)
    return specs


def tensor_specs(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Specs of plain named tensors (an engine that is not a TransformerLM, e.g. a test double)."""
    return {name: TensorSpec(tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}


@dataclass(frozen=True)
class WeightSpecs:
    """The target's specs and the drafter's (None: no loadable drafter)."""

    target: dict[str, TensorSpec]
    draft: dict[str, TensorSpec] | None = None

    def check(self, name: str, dtype: str, shape, draft: bool) -> tuple[str, TensorSpec]:
        """(key, spec) of a tensor arriving as `name`, `dtype`, `shape`; InvalidArgument naming the
        tensor (field `weights`, or `draft_weights` for the drafter) if it does not fit."""
        field = "draft_weights" if draft else "weights"
        table = self.draft if draft else self.target
        if table is None:
            raise InvalidArgument(field, "this server runs no drafter with weights (--spec none or history)")
        key = name.removeprefix("model.")
        spec = table.get(key)
        if spec is None:
            raise InvalidArgument(field, f"unknown tensor {name!r}")
        if dtype not in FLOAT_DTYPES:
            raise InvalidArgument(field, f"tensor {name!r} must be a floating tensor "
                                         f"({'/'.join(FLOAT_DTYPES)}), got {dtype}")
        if tuple(shape) != spec.shape:
            raise InvalidArgument(field, f"tensor {name!r} has shape {tuple(shape)}, expected {spec.shape}")
        return key, spec

    def budget(self) -> int:
        """Bytes a staging of every accepted tensor takes (aliases too), offsets page aligned: the
        bound on what one update may hold. A parameter that comes whole or in parts counts once, as
        the larger of the two."""
        total = 0
        for table in (self.target, self.draft or {}):
            either: dict[str, list[int]] = {}  # whole key -> [whole bytes, parts' bytes]
            for key, spec in table.items():
                size = -(-spec.nbytes // ALIGN) * ALIGN
                if spec.either_of is None:
                    total += size
                else:
                    either.setdefault(spec.either_of, [0, 0])[key != spec.either_of] += size
            total += sum(max(sizes) for sizes in either.values())
        return total
