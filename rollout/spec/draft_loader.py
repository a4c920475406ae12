"""Reading, checking and writing drafter checkpoints (DFlash and DSpark) for a loaded target.

The layouts are the published ones (tests/data/published_drafter_configs.json lists their
fields). DFlash, as z-lab's DFlash drafters (e.g. Qwen3-8B-DFlash-b16): `config.json` is a Qwen3
config of the draft layers (`num_hidden_layers` = number of draft layers) with
`architectures: ["DFlashDraftModel"]`, `auto_map`, `num_target_layers` (the target's depth),
`block_size` and a `dflash_config` object holding `mask_token_id` and `target_layer_ids`;
`model.safetensors` holds `fc`, `hidden_norm`, `layers.N.*` and `norm` (an optional `model.`
prefix is accepted). DSpark, as DeepSeek's (dspark_qwen3_8b_block7): `architectures:
["Qwen3DSparkModel"]`, the same draft fields at the top level plus `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`, and tensors
`markov_head.*`, `confidence_head.proj` and its own `embed_tokens` / `lm_head`. The reader takes
each draft field from `dflash_config` or the top level (old configs of this project and
other exporters put them in either), recognises DSpark by `markov_rank` (or
`dspark_markov_rank`, or a DSpark architecture name), and refuses options it does not implement
(sliding-window layers, other Markov heads). A drafter that does not fit its target
(vocabulary, hidden size, depth, layer ids, mask id, tensors) is refused with a `LoadError`
naming the mismatch, before any weight is copied.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from rollout.engine.loader import LoadedModel, LoadProgress, load_state_into, read_state_dict
from rollout.engine.model import ModelConfig, PackedLinear
from rollout.errors import InvalidArgument, LoadError
from rollout.spec.draft_model import DRAFT_KINDS, DraftConfig, DraftModel, TargetHeads

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}
DFLASH_AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}  # the reference's remote-code class
_DRAFT_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
               "dspark_markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def draft_fields(d: dict) -> dict:
    """The draft fields of a config.json dict, from the top level or `dflash_config` (which wins)."""
    return {**{k: d[k] for k in _DRAFT_KEYS if k in d}, **(d.get("dflash_config") or {})}


def checkpoint_kind(d: dict) -> str:
    """"dspark" when the config carries a Markov head, else "dflash"."""
    archs, draft = d.get("architectures") or [], draft_fields(d)
    if "markov_rank" in draft or "dspark_markov_rank" in draft or any("DSpark" in a for a in archs):
        return "dspark"
    return "dflash"


def _check_supported(d: dict, draft: dict) -> None:
    """Refuse published options the drafter does not implement rather than computing something else."""
    if any(t != "full_attention" for t in d.get("layer_types") or ()):
        raise LoadError(f"drafter layer_types {d['layer_types']}: only full_attention layers are supported")
    if draft.get("markov_head_type", "vanilla") != "vanilla":
        raise LoadError(f"drafter markov_head_type {draft['markov_head_type']!r} is not supported (only 'vanilla')")
    for key in ("enable_confidence_head", "confidence_head_with_markov"):
        if draft.get(key, True) is not True:
            raise LoadError(f"drafter {key}={draft[key]!r} is not supported (the DSpark confidence head "
                            f"reads [hidden || Markov embedding])")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The published DFlash choice: the middle layer for one draft layer, else layers spread
    evenly from 1 to num_target_layers - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, max(num_target_layers - 3, 1)
    ids = (round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))
    return tuple(min(i, num_target_layers - 1) for i in ids)


def draft_config_from_hf(d: dict, target: ModelConfig, kind: str | None = None,
                         block_size: int | None = None) -> DraftConfig:
    """Parse a drafter config.json dict for `target`; `kind` / `block_size` override the checkpoint's."""
    found = checkpoint_kind(d)
    if kind is not None and kind not in DRAFT_KINDS:
        raise LoadError(f"unknown drafter kind {kind!r}; supported: {DRAFT_KINDS}")
    if kind is not None and kind != found:
        raise LoadError(f"drafter kind: the checkpoint is a {found} drafter, asked for {kind}")
    draft = draft_fields(d)
    _check_supported(d, draft)
    if "mask_token_id" not in draft:
        raise LoadError("drafter config has no mask_token_id (dflash_config.mask_token_id)")
    num_target_layers = int(draft.get("num_target_layers", target.num_hidden_layers))
    layer_ids = draft.get("target_layer_ids") or default_target_layer_ids(num_target_layers,
                                                                          d.get("num_hidden_layers", 1))
    try:
        backbone = ModelConfig.from_hf({"max_position_embeddings": target.max_position_embeddings,
                                        **d, "model_type": "qwen3"})
        return DraftConfig(
            kind=found,
            block_size=int(block_size or draft.get("block_size", 16)),
            mask_token_id=int(draft["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            target_hidden_size=int(d.get("target_hidden_size", target.hidden_size)),
            num_target_layers=num_target_layers,
            backbone=backbone,
            markov_rank=int(draft.get("markov_rank", draft.get("dspark_markov_rank", 0))),
        )
    except InvalidArgument as e:
        raise LoadError(f"drafter config: {e}") from e


def check_fit(cfg: DraftConfig, target: ModelConfig, state: dict[str, Tensor] | None = None) -> None:
    """Raise LoadError naming the first way the drafter does not fit `target`."""
    if cfg.vocab_size != target.vocab_size:
        raise LoadError(f"drafter vocab_size {cfg.vocab_size} does not match the target's "
                        f"{target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        raise LoadError(f"drafter target_hidden_size {cfg.target_hidden_size} does not match the "
                        f"target's hidden_size {target.hidden_size}")
    if cfg.kind == "dflash" and cfg.hidden_size != target.hidden_size:
        raise LoadError(f"drafter hidden_size {cfg.hidden_size} does not match the target's hidden_size "
                        f"{target.hidden_size} (DFlash uses the target's embeddings and LM head)")
    if cfg.num_target_layers != target.num_hidden_layers:
        raise LoadError(f"drafter num_target_layers {cfg.num_target_layers} does not match the target's "
                        f"{target.num_hidden_layers} layers (target_layer_ids {list(cfg.target_layer_ids)})")
    fc = None if state is None else state.get("fc.weight", state.get("model.fc.weight"))
    if fc is not None and fc.ndim == 2 and fc.shape[1] != cfg.context_size:
        raise LoadError(
            f"drafter fc.weight reads {fc.shape[1]} features, but {len(cfg.target_layer_ids)} target layers "
            f"x target hidden_size {target.hidden_size} = {cfg.context_size}: hidden size mismatch")


def _target_heads(target: LoadedModel) -> TargetHeads:
    return TargetHeads(target.model.embed_tokens, target.model.lm_head)


def _target_placement(target: LoadedModel, device, dtype) -> tuple[torch.device, torch.dtype]:
    weight = target.model.embed_tokens.weight
    return torch.device(device) if device is not None else weight.device, dtype or weight.dtype


def load_drafter(path: str | Path, target: LoadedModel, kind: str | None = None,
                 block_size: int | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, progress: LoadProgress | None = None) -> DraftModel:
    """Load a DFlash / DSpark checkpoint directory for `target` (default placement: the target's).

    `kind` (if given) must match the checkpoint; `block_size` overrides the trained one.
    Raises LoadError naming any mismatch with the target or the checkpoint's tensors.
    """
    root = Path(path)
    if not root.is_dir():
        raise LoadError(f"drafter directory {str(root)!r} does not exist")
    if not (root / "config.json").is_file():
        raise LoadError(f"drafter directory {str(root)!r} has no config.json")
    try:
        d = json.loads((root / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read {root / 'config.json'}: {e}") from e
    cfg = draft_config_from_hf(d, target.config, kind, block_size)
    state = read_state_dict(root, progress)
    check_fit(cfg, target.config, state)
    device, dtype = _target_placement(target, device, dtype)
    with torch.device("meta"):
        model = DraftModel(cfg, None if cfg.kind == "dspark" else _target_heads(target))
    model.to_empty(device=device).to(dtype)
    load_state_into(model, state, strict=True)
    return model.eval().requires_grad_(False)


def random_drafter(target: LoadedModel, kind: str, block_size: int, num_layers: int = 1, seed: int = 0,
                   markov_rank: int = 32, mask_token_id: int | None = None,
                   target_layer_ids: tuple[int, ...] | None = None) -> DraftModel:
    """An untrained drafter shaped like `target`'s layers (for tests and as a training start).

    DSpark copies the target's embeddings and LM head into its own. The mask id defaults to
    the tokenizer's mask token (else the last vocabulary id), the layer ids to the published spread.
    """
    t = target.config
    if mask_token_id is None:
        mask_token_id = _tokenizer_mask_id(target)
    backbone = dataclasses.replace(t, model_type="qwen3", num_hidden_layers=num_layers,
                                   tie_word_embeddings=False, attention_bias=False, moe=None)
    cfg = DraftConfig(
        kind=kind, block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids or default_target_layer_ids(t.num_hidden_layers, num_layers),
        target_hidden_size=t.hidden_size, num_target_layers=t.num_hidden_layers, backbone=backbone,
        markov_rank=markov_rank if kind == "dspark" else 0,
    )
    check_fit(cfg, t)
    device, dtype = _target_placement(target, None, None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DraftModel(cfg, None if kind == "dspark" else _target_heads(target))
    if kind == "dspark":
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            model.lm_head.weight.copy_(target.model.lm_head.weight)
    return model.to(device=device, dtype=dtype).eval()


def _tokenizer_mask_id(target: LoadedModel) -> int:
    for token in ("<|mask|>", "<|MASK|>"):
        token_id = target.tokenizer.token_to_id(token) if target.tokenizer is not None else None
        if token_id is not None and token_id < target.config.vocab_size:
            return token_id
    return target.config.vocab_size - 1


def checkpoint_tensors(model: DraftModel) -> dict[str, Tensor]:
    """The drafter's own parameters under their checkpoint names (packed projections split)."""
    out = {}
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, PackedLinear):
                parent = path.rpartition(".")[0]
                for shard in module.shards:
                    start, size = module.shard_rows(shard)
                    out[f"{parent}.{shard}.{name}"] = param.detach()[start : start + size].contiguous()
            else:
                out[f"{path}.{name}" if path else name] = param.detach().contiguous()
    return out


def draft_config_to_hf(cfg: DraftConfig, dtype: torch.dtype) -> dict:
    """The config.json dict of `cfg` in the published layout of its kind (the module docstring)."""
    bb, num_layers = cfg.backbone, cfg.backbone.num_hidden_layers
    draft = {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
             "target_layer_ids": list(cfg.target_layer_ids)}
    d = {
        "architectures": [ARCHITECTURES[cfg.kind]],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": bb.hidden_size,
        "intermediate_size": bb.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": bb.num_attention_heads,
        "num_key_value_heads": bb.num_key_value_heads,
        "head_dim": bb.head_dim,
        "layer_types": ["full_attention"] * num_layers,
        "max_window_layers": num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": bb.rms_norm_eps,
        "rope_theta": bb.rope_theta,
        "rope_scaling": dict(bb.rope_scaling) if bb.rope_scaling else None,
        "max_position_embeddings": bb.max_position_embeddings,
        "vocab_size": bb.vocab_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "dflash_config": draft,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.kind == "dflash":
        return d | {"auto_map": dict(DFLASH_AUTO_MAP)}
    return d | draft | {
        "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "rope_parameters": {"rope_theta": bb.rope_theta, **(bb.rope_scaling or {"rope_type": "default"})},
    }


def target_token_ids(target: LoadedModel) -> dict:
    """bos / eos / pad token ids from the target checkpoint's config.json (else its
    generation_config.json): the published drafter configs repeat them."""
    found: dict = {}
    for name in ("generation_config.json", "config.json"):  # config.json wins
        path = Path(target.path) / name
        if path.is_file():
            d = json.loads(path.read_text())
            found |= {k: d[k] for k in _TOKEN_KEYS if d.get(k) is not None}
    return found


def drafter_config_json(model: DraftModel, target: LoadedModel | None = None, extra: dict | None = None) -> str:
    """config.json's text (keys sorted, as transformers writes them): the published layout, the
    target's token ids when `target` is given, plus `extra` keys."""
    d = draft_config_to_hf(model.config, model.fc.weight.dtype)
    d |= (target_token_ids(target) if target is not None else {}) | (extra or {})
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def write_drafter_config(model: DraftModel, path: str | Path, target: LoadedModel | None = None,
                         extra: dict | None = None) -> None:
    """Write config.json alone (see `drafter_config_json`)."""
    (Path(path) / "config.json").write_text(drafter_config_json(model, target, extra))


def checkpoint_files(model: DraftModel, target: LoadedModel | None = None, extra: dict | None = None
                     ) -> tuple[str, bytes]:
    """The checkpoint's two files in memory: config.json's text and model.safetensors' bytes."""
    tensors = {k: v.cpu() for k, v in checkpoint_tensors(model).items()}
    return drafter_config_json(model, target, extra), save(tensors, metadata={"format": "pt"})


def save_drafter(model: DraftModel, path: str | Path, extra: dict | None = None,
                 target: LoadedModel | None = None) -> None:
    """Write config.json and model.safetensors (`checkpoint_files`)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config, data = checkpoint_files(model, target, extra)
    (root / "config.json").write_text(config)
    (root / "model.safetensors").write_bytes(data)
