"""The one root configuration of an engine, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollout.errors import InvalidArgument

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL = ASSETS / "tiny-qwen3"
DEFAULT_DRAFTS = {"dflash": ASSETS / "tiny-qwen3-dflash", "dspark": ASSETS / "tiny-qwen3-dspark"}
SPEC_METHODS = ("none", "dflash", "dspark")
# "random": only config.json is read and the weights are drawn at random on the device
# (benchmarks of model shapes without a checkpoint, like other engines' `--load-format dummy`).
LOAD_FORMATS = ("safetensors", "random")
# the layer kernels: "triton" = fused norms / RoPE / cache writes and paged attention reading the
# block pool (triton_ops.py, triton_attention.py); "torch" = the reference ops they are tested
# against; "auto" = triton on CUDA when the head size suits it, else torch.
KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `rollout serve` can set. `model=None` / `draft=None` mean the embedded models."""

    model: str | None = None
    load_format: str = "safetensors"
    draft: str | None = None
    spec: str = "none"
    spec_block_size: int | None = None
    spec_confidence_threshold: float = 0.0
    # per step, verify only the drafts expected to pay (spec_budget.py); False: always full blocks
    spec_adaptive: bool = True
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_fraction: float = 0.85
    cpu_kv_bytes: int = 256 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_mask_tokens: int = 4096
    max_queued_samples: int = 4096
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # replay uniform decode / verify steps as CUDA graphs (CUDA only)
    kernel_backend: str = "auto"
    # Triton backend: KV blocks that several running sequences share (forked samples, cached
    # prefixes) are read once per step for all of them (prefix_plan.py); False: the plain kernel
    shared_prefix_attention: bool = True

    def __post_init__(self):
        if self.spec not in SPEC_METHODS:
            raise InvalidArgument("spec", f"must be one of {SPEC_METHODS}, got {self.spec!r}")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidArgument("load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise InvalidArgument("kernel_backend", f"must be one of {KERNEL_BACKENDS}, "
                                  f"got {self.kernel_backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise InvalidArgument("device", f"must be cpu or cuda, got {self.device!r}")
        if self.spec_block_size is not None and not 2 <= self.spec_block_size <= 64:
            raise InvalidArgument("spec_block_size", f"must be in [2, 64], got {self.spec_block_size}")
        if not 0.0 <= self.spec_confidence_threshold < 1.0:
            raise InvalidArgument("spec_confidence_threshold", "must be in [0, 1)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidArgument("block_size", f"must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise InvalidArgument("num_kv_blocks", f"must be >= 2, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise InvalidArgument("gpu_memory_fraction", "must be in (0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_mask_tokens", "max_queued_samples"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else DEFAULT_MODEL

    @property
    def draft_path(self) -> Path | None:
        if self.spec == "none":
            return None
        return Path(self.draft) if self.draft else DEFAULT_DRAFTS[self.spec]
