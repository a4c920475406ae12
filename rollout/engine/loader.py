"""Load a target model from an HF checkpoint directory: config.json, safetensors (single file or
sharded index), tokenizer.json and the EOS ids.

Checkpoint tensor names are HF's (`model.layers.N.self_attn.q_proj.weight`, ...). A leading
`model.` is dropped to get the module path, and a tensor whose module is a shard of a
`PackedLinear` (q_proj inside qkv_proj, gate_proj inside gate_up_proj) is copied into its row
range. A Qwen3-MoE layer's fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I], transformers 5's layout) are filled either whole or from the
per-expert tensors of published checkpoints (`mlp.experts.{e}.{gate,up,down}_proj.weight`).
Every mismatch raises `LoadError` naming the checkpoint tensor, so the same `load_state_into`
serves drafters built from the same blocks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from safetensors import safe_open
from torch import Tensor, nn

from rollout.engine.model import ModelConfig, PackedLinear, TransformerLM
from rollout.engine.moe import FusedExperts
from rollout.errors import LoadError

# Non-parameter tensors some checkpoints carry (old Llama exports save RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """A target model ready to run (eval mode, no grad) with what the engine needs around it."""

    model: TransformerLM
    config: ModelConfig
    tokenizer: tokenizers.Tokenizer | None
    eos_token_ids: list[int]
    path: str
    name: str  # the checkpoint directory's name


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read {path}: {e}") from e


def _checkpoint_dir(path: str | Path) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise LoadError(f"model directory {str(root)!r} does not exist")
    if not (root / "config.json").is_file():
        raise LoadError(f"model directory {str(root)!r} has no config.json")
    return root


# `progress(items, description)` wraps the list of tensors a load reads (e.g. a tqdm bar); None: none
LoadProgress = Callable[[list, str], Iterable]


def read_state_dict(path: str | Path, progress: LoadProgress | None = None) -> dict[str, Tensor]:
    """All tensors of `model.safetensors` or of the shards listed in `model.safetensors.index.json`."""
    root = Path(path)
    state: dict[str, Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in _weight_files(root)]
        names = [(handle, name) for handle in handles for name in handle.keys()]
        for handle, name in progress(names, f"loading {root.name}") if progress else names:
            state[name] = handle.get_tensor(name)
    return state


def _weight_files(root: Path) -> list[Path]:
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise LoadError(f"{str(root)!r} has neither model.safetensors nor model.safetensors.index.json")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise LoadError(f"{index} has no weight_map")
    files = [root / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise LoadError(f"weight shard {file.name} listed in the index is missing from {str(root)!r}")
    return files


# Where a checkpoint tensor goes in its parameter: None = the whole parameter, else an index
# (the rows of a packed shard, one expert's slice of a fused expert tensor).
Index = slice | int | tuple[int, slice] | None


def _checkpoint_names(path: str, param_name: str, module: nn.Module) -> list[tuple[str, Index]]:
    """Checkpoint names (without `model.`) that fill one parameter, with their indices into it."""
    if isinstance(module, FusedExperts):  # the fused tensor, or the per-expert ones
        names = [(f"{path}.{param_name}", None)]
        return names + [(f"{path}.{name}", index) for name, index in module.expert_slots(param_name)]
    if not isinstance(module, PackedLinear):
        return [(f"{path}.{param_name}" if path else param_name, None)]
    parent = path.rpartition(".")[0]
    names = []
    for shard in module.shards:
        start, size = module.shard_rows(shard)
        names.append(
            (
                f"{parent}.{shard}.{param_name}" if parent else f"{shard}.{param_name}",
                slice(start, start + size),
            )
        )
    return names


def param_slots(model: nn.Module) -> tuple[dict[str, tuple[nn.Parameter, Index]], set[str]]:
    """Checkpoint name -> (parameter, index) for every parameter, and the names of tied aliases
    (e.g. `lm_head.weight` of a tied model), which a checkpoint may carry or omit. A parameter
    may have both a whole name and part names (fused experts): either fills it."""
    slots: dict[str, tuple[nn.Parameter, Index]] = {}
    aliases: set[str] = set()
    seen: set[int] = set()
    for path, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            names = _checkpoint_names(path, param_name, module)
            if id(param) in seen:
                aliases.update(name for name, _ in names)
                continue
            seen.add(id(param))
            slots.update((name, (param, rows)) for name, rows in names)
    return slots, aliases


def load_state_into(model: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
    """Copy checkpoint tensors into `model`'s parameters, casting to their dtype and device.

    A leading `model.` of checkpoint names is ignored. Shapes are always checked; strict also
    requires every parameter to be filled and no tensor to be left over. Raises LoadError naming
    the missing / unexpected / mis-shaped tensor; nothing is copied if validation fails.
    """
    slots, aliases = param_slots(model)
    full_name = getattr(model, "checkpoint_name", lambda name: name)
    by_name = {name.removeprefix("model."): name for name in state}
    if strict:
        unexpected = [
            hf for name, hf in by_name.items()
            if name not in slots and name not in aliases and not hf.endswith(_IGNORED_SUFFIXES)
        ]  # fmt: skip
        if unexpected:
            raise LoadError(f"unexpected tensor(s) in checkpoint: {sorted(unexpected)[:8]}")
        missing = [full_name(name) for name in _unfilled(slots, by_name)]
        if missing:
            raise LoadError(f"missing tensor(s) in checkpoint: {missing[:8]}")
    copies = []
    for name, (param, rows) in slots.items():
        if name not in by_name:
            continue
        tensor, dest = state[by_name[name]], (param.data if rows is None else param.data[rows])
        if tuple(tensor.shape) != tuple(dest.shape):
            raise LoadError(
                f"tensor {by_name[name]} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        copies.append((dest, tensor))
    with torch.no_grad():
        for dest, tensor in copies:
            dest.copy_(tensor)


def _unfilled(slots: dict[str, tuple[nn.Parameter, Index]], given: dict[str, str]) -> list[str]:
    """Slot names absent from `given` whose parameter stays (partly) unfilled: a parameter is
    filled by its whole name, or by all of its part names when it has parts."""
    whole = {id(param) for name, (param, index) in slots.items() if index is None and name in given}
    has_parts = {id(param) for param, index in slots.values() if index is not None}
    return [name for name, (param, index) in slots.items()
            if name not in given and id(param) not in whole and (index is not None or id(param) not in has_parts)]


def _load_tokenizer(root: Path, vocab_size: int) -> tokenizers.Tokenizer | None:
    file = root / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises bare Exceptions on bad files
        raise LoadError(f"cannot read {file}: {e}") from e
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise LoadError(
            f"vocabulary mismatch: tokenizer.json has {size} tokens, "
            f"more than the model's vocab_size {vocab_size}"
        )
    return tokenizer


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _eos_token_ids(root: Path, config: dict, tokenizer: tokenizers.Tokenizer | None) -> list[int]:
    """generation_config.json `eos_token_id`, else tokenizer_config.json `eos_token` (through the
    tokenizer), else config.json `eos_token_id`; [] when none says."""
    generation = root / "generation_config.json"
    if generation.is_file():
        ids = _as_id_list(_read_json(generation).get("eos_token_id"))
        if ids:
            return ids
    tok_config = root / "tokenizer_config.json"
    if tokenizer is not None and tok_config.is_file():
        token = _read_json(tok_config).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            return [token_id]
    return _as_id_list(config.get("eos_token_id"))


def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype) -> TransformerLM:
    """An uninitialised model allocated directly on `device` in `dtype` (no random init pass)."""
    with torch.device("meta"):
        model = TransformerLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def init_random_(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Benchmark weights in place: norm weights 1, every other parameter N(0, std^2), drawn on
    the model's device from a generator seeded with `seed` (same weights on every run)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    load_format: str = "safetensors", progress: LoadProgress | None = None,
) -> LoadedModel:
    """Load an HF Qwen3 / Qwen3-MoE / Llama checkpoint directory. dtype defaults to float32 on CPU, bfloat16 on CUDA.

    `load_format="random"` reads config.json (and the tokenizer, if any) but no weights: they
    are drawn by `init_random_`, for benchmarks of a model shape without its checkpoint. `progress`
    wraps the tensors as they are read (a progress bar)."""
    root = _checkpoint_dir(path)
    raw_config = _read_json(root / "config.json")
    config = ModelConfig.from_hf(raw_config)
    tokenizer = _load_tokenizer(root, config.vocab_size)
    device = torch.device(device)
    model = build_model(config, device, dtype or _default_dtype(device))
    if load_format == "random":
        init_random_(model)
    else:
        load_state_into(model, read_state_dict(root, progress))
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(root, raw_config, tokenizer),
        path=str(root),
        name=root.resolve().name,
    )
