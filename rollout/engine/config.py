"""The one root configuration of an engine, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollout.errors import InvalidArgument
from rollout.options import option

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL = ASSETS / "tiny-qwen3"
DEFAULT_DRAFTS = {"dflash": ASSETS / "tiny-qwen3-dflash", "dspark": ASSETS / "tiny-qwen3-dspark"}
SPEC_METHODS = ("none", "dflash", "dspark", "history", "dflash+history", "dspark+history")
DRAFTER_CHECKPOINTS = ("dflash", "dspark")  # the drafter model kinds (--spec KIND or KIND+history loads one)
# "random": only config.json is read and the weights are drawn at random on the device
# (benchmarks of model shapes without a checkpoint, like other engines' `--load-format dummy`).
LOAD_FORMATS = ("safetensors", "random")
# the layer kernels: "triton" = fused norms / RoPE / cache writes and paged attention reading the
# block pool (triton_ops.py, triton_attention.py); "torch" = the reference ops they are tested
# against; "auto" = triton on CUDA when the head size suits it, else torch.
KERNEL_BACKENDS = ("auto", "torch", "triton")
# where a weight update waits for its swap (rollout.engine.weights): "device" = spare device memory
# (the swap is a device copy), "host" = host memory (one host-to-device copy per tensor in the swap),
# "auto" = the device when the update fits with room to spare. On CPU all three are host memory.
WEIGHT_STAGING = ("auto", "device", "host")
# online training of the drafter model (rollout.spec.refresh): never, when the engine is idle or its batch
# small, after every step
DRAFTER_REFRESH = ("off", "idle", "always")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `rollout serve` can set about the engine; each field is its flag (rollout.options).
    `model=None` / `draft=None` mean the embedded models."""

    model: str | None = option(None, "HF checkpoint directory of the target model", metavar="DIR",
                               default_text="the embedded tiny Qwen3")
    load_format: str = option("safetensors", "how the target's weights are read; random: seeded random weights "
                              "from config.json alone (benchmarks of a model's shape)", choices=LOAD_FORMATS)
    draft: str | None = option(None, "drafter checkpoint directory (DFlash or DSpark, matching --spec); refused "
                               "with --spec none or history", metavar="DIR",
                               default_text="the embedded drafter of --spec")
    spec: str = option("none", "speculative decoding: none, or the drafter kind (history: drafts from the samples "
                       "generated for the same prompt in recent rollouts; KIND+history: per request and step, "
                       "whichever of the two is expected to have more drafts accepted); drafts are verified "
                       "against the target, so the samples' distribution does not change", choices=SPEC_METHODS)
    spec_block_size: int | None = option(None, "draft block: tokens per verify step (the drafts plus one), in "
                                         "[2, 64]", default_text="the drafter checkpoint's; 8 for history")
    spec_confidence_threshold: float = option(0.0, "DSpark, history: cut a draft block at the first position the "
                                              "drafter predicts below this confidence (history: the fraction of "
                                              "stored samples continuing that way); 0 = full blocks")
    spec_history_tokens: int = option(1 << 20, "with history drafts: most tokens the history stores over all prompts "
                                      "(about 0.5 KB of host memory each); the least recently used prompts are "
                                      "evicted first", default_text="1,048,576")
    spec_history_keep_versions: bool = option(False, "with history drafts: keep the samples of earlier policy versions "
                                              "after a weight update (otherwise they are dropped: the new policy "
                                              "samples differently)", default_text="dropped")
    drafter_refresh: str = option("off", "keep training the DFlash / DSpark drafter on the server's own rollouts "
                                  "(current policy version only; rollout/spec/refresh.py): idle = while the engine "
                                  "is idle and after steps of a small batch (the long tail), always = after every "
                                  "step; at most --drafter-refresh-ms per step and --drafter-refresh-share of the "
                                  "steps' time", choices=DRAFTER_REFRESH)
    drafter_refresh_lr: float = option(1e-4, "drafter refresh: AdamW learning rate")
    drafter_refresh_tokens: int = option(1 << 16, "drafter refresh: committed tokens its buffer holds (the oldest "
                                         "evicted first), each len(target_layer_ids) x hidden_size values in the "
                                         "target's dtype on its device", default_text="65,536")
    drafter_refresh_ms: float = option(20.0, "drafter refresh: the most milliseconds of training between two "
                                       "engine steps (on the engine thread)")
    drafter_refresh_share: float = option(0.04, "drafter refresh: training between steps takes at most this share "
                                          "of the steps' own time (each step earns it as credit, kept up to 10 "
                                          "slices of --drafter-refresh-ms); idle training is not counted")
    spec_adaptive: bool = option(True, "verify per step only the drafts expected to pay, from measured "
                                 "acceptance and step costs (rollout/engine/spec_budget.py); off: always full "
                                 "draft blocks")
    device: str = option("cpu", "where the engine runs", choices=("cpu", "cuda"))
    block_size: int = option(16, "KV cache block size in tokens (a power of two)")
    num_kv_blocks: int | None = option(None, "KV cache blocks", default_text="what fits once the largest step is "
                                       "profiled (CUDA, under --gpu-memory-fraction) or --cpu-kv-bytes (CPU)")
    gpu_memory_fraction: float = option(0.85, "CUDA: fraction of the GPU's memory the process may fill: weights, "
                                        "the largest step, CUDA graphs, and the KV cache taking what is left")
    cpu_kv_bytes: int = option(256 << 20, "CPU: bytes of KV cache (target and drafter)",
                               default_text="256 MiB")
    max_num_seqs: int = option(256, "most sequences (samples) in one step")
    max_num_batched_tokens: int = option(2048, "most tokens in one step (prefill chunks, decode and draft tokens)")
    max_model_len: int | None = option(None, "longest sequence, prompt plus output", default_text="min(the "
                                       "model's positions, the KV cache's, with a drafter positions - block + 2)")
    max_mask_tokens: int = option(4096, "largest top_k a mask request may use")
    max_queued_samples: int = option(4096, "most samples waiting to start; beyond, requests are refused with "
                                     "RESOURCE_EXHAUSTED")
    enable_prefix_caching: bool = option(True, "do not reuse the KV blocks of identical prompt prefixes across "
                                         "requests", flag="--no-prefix-caching", default_text="reused")
    cuda_graphs: bool = option(True, "CUDA: run decode / verify steps eagerly instead of replaying uniform ones "
                               "as CUDA graphs", default_text="CUDA graphs")
    kernel_backend: str = option("auto", "layer kernels: triton (fused, with paged attention reading the block "
                                 "pool), torch (the reference), auto = triton on CUDA when the head size "
                                 "suits it, else torch", choices=KERNEL_BACKENDS)
    shared_prefix_attention: bool = option(True, "Triton backend: read the KV blocks that several running "
                                           "sequences share (forked samples, cached prefixes) once per step for "
                                           "all of them; off: the plain paged kernel",
                                           default_text="on")
    overlap: bool = option(True, "run every step synchronously: schedule step n+1 only once step n's tokens are "
                           "read back (by default n+1 is scheduled and launched while the device computes n, "
                           "rollout/engine/overlap.py, drafted steps too with DFlash / DSpark; grammar samples, "
                           "penalties after drafts, a draining weight update and drafters that need host "
                           "anchors run synchronously anyway)", default_text="overlapped")
    weight_staging: str = option("auto", "where a weight update waits for its swap while the engine keeps "
                                 "generating: spare device memory (the swap is a device copy) or host memory "
                                 "(one host-to-device copy per tensor in the swap); auto = the device when the "
                                 "update fits with room to spare; on CPU all are host memory",
                                 choices=WEIGHT_STAGING)

    def __post_init__(self):
        if self.spec not in SPEC_METHODS:
            raise InvalidArgument("spec", f"must be one of {SPEC_METHODS}, got {self.spec!r}")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidArgument("load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise InvalidArgument("kernel_backend", f"must be one of {KERNEL_BACKENDS}, "
                                  f"got {self.kernel_backend!r}")
        if self.weight_staging not in WEIGHT_STAGING:
            raise InvalidArgument("weight_staging", f"must be one of {WEIGHT_STAGING}, got {self.weight_staging!r}")
        if self.device not in ("cpu", "cuda"):
            raise InvalidArgument("device", f"must be cpu or cuda, got {self.device!r}")
        if self.draft is not None and self.draft_kind is None:
            raise InvalidArgument("draft", f"a drafter needs --spec dflash or --spec dspark (its kind, or "
                                           f"KIND+history), got --spec {self.spec}")
        if self.drafter_refresh not in DRAFTER_REFRESH:
            raise InvalidArgument("drafter_refresh", f"must be one of {DRAFTER_REFRESH}, got {self.drafter_refresh!r}")
        if self.drafter_refresh != "off" and self.draft_kind is None:
            raise InvalidArgument("drafter_refresh", f"trains a drafter model: needs --spec dflash or dspark (or "
                                                     f"KIND+history), got --spec {self.spec}")
        if not self.drafter_refresh_lr > 0:
            raise InvalidArgument("drafter_refresh_lr", f"must be > 0, got {self.drafter_refresh_lr}")
        if self.drafter_refresh_tokens < 1:
            raise InvalidArgument("drafter_refresh_tokens", f"must be >= 1, got {self.drafter_refresh_tokens}")
        if not self.drafter_refresh_ms > 0:
            raise InvalidArgument("drafter_refresh_ms", f"must be > 0, got {self.drafter_refresh_ms}")
        if not 0.0 < self.drafter_refresh_share <= 1.0:
            raise InvalidArgument("drafter_refresh_share", f"must be in (0, 1], got {self.drafter_refresh_share}")
        if self.spec_history_tokens < 1:
            raise InvalidArgument("spec_history_tokens", f"must be >= 1, got {self.spec_history_tokens}")
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
    def draft_kind(self) -> str | None:
        """The drafter model --spec loads (dflash, dspark), None: none."""
        kind = self.spec.removesuffix("+history")
        return kind if kind in DRAFTER_CHECKPOINTS else None

    @property
    def history_drafts(self) -> bool:
        """Whether --spec drafts from the rollout history (alone or with a drafter model)."""
        return self.spec == "history" or self.spec.endswith("+history")

    @property
    def draft_path(self) -> Path | None:
        if self.draft_kind is None:
            return None
        return Path(self.draft) if self.draft else DEFAULT_DRAFTS[self.draft_kind]

