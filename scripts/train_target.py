"""Trains the embedded tiny byte-level Qwen3 target on the standard library's source.

`python scripts/train_target.py --out DIR --seconds 90` builds a 4.8M-parameter
`Qwen3ForCausalLM` (vocabulary 264: bytes + specials, hidden 256, 6 layers), trains it on
random 512-byte windows of the stdlib corpus (documents separated by EOS) with AdamW under a
cosine schedule laid over the wall-clock budget, in bf16 autocast on a GPU. A small
validation carve of the training files picks the best checkpoint of the run; the held-out
split (`corpus.heldout_files()`) is only measured, in nats per byte, on the saved bf16
weights. DIR gets the HF layout (config.json, model.safetensors in bfloat16, generation and
tokenizer files) plus training.json recording the corpus hash and the measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import corpus
import torch
import torch.nn.functional as F
import transformers
from make_tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, write_tokenizer
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

VAL_SALT = "rollout-val:"


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    seconds: float = 90.0
    batch: int = 256
    context: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_fraction: float = 0.04
    weight_decay: float = 0.1
    val_percent: int = 2
    eval_every_s: float = 5.0
    seed: int = 0
    tiny: bool = False
    device: str = "cuda"

    def __post_init__(self):
        if self.seconds <= 0 or self.batch < 1 or self.context < 8:
            raise ValueError("seconds > 0, batch >= 1 and context >= 8 are required")
        if not 0 < self.val_percent < 50:
            raise ValueError(f"val_percent: expected 1..49, got {self.val_percent}")


def model_config(tiny: bool) -> Qwen3Config:
    """The embedded target's architecture; `tiny` is a 2-layer toy for CPU smoke runs."""
    size = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=768)
    if tiny:
        size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, intermediate_size=192)
    return Qwen3Config(vocab_size=VOCAB_SIZE, tie_word_embeddings=True, rope_theta=10000.0,
                       max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=EOS_ID,
                       eos_token_id=EOS_ID, pad_token_id=PAD_ID, **size)


@dataclass
class Data:
    """Token streams ([N] int64 on the training device) of the three splits."""

    train: torch.Tensor
    val: torch.Tensor
    heldout: torch.Tensor
    info: dict


def load_data(device: str, val_percent: int) -> Data:
    c = corpus.load_corpus()
    val_rels = [r for r in c.train if corpus.in_bucket(VAL_SALT + r, val_percent)]
    train_rels = [r for r in c.train if not corpus.in_bucket(VAL_SALT + r, val_percent)]

    def stream(rels):
        return corpus.token_stream(corpus.read_documents([c.root / r for r in rels])).to(device)

    data = Data(stream(train_rels), stream(val_rels), stream(c.heldout), {})
    data.info = {
        "source": "python stdlib .py files (scripts/corpus.py)",
        "python_version": c.python_version,
        "stdlib_root": str(c.root),
        "file_list_sha256": c.file_list_sha256,
        "num_files": len(c.train) + len(c.heldout),
        "num_train_files": len(train_rels),
        "num_val_files": len(val_rels),
        "num_heldout_files": len(c.heldout),
        "train_tokens": data.train.numel(),
        "heldout_tokens": data.heldout.numel(),
    }
    return data


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak, over time progress."""
    if progress < cfg.warmup_fraction:
        return cfg.lr * progress / cfg.warmup_fraction
    t = min(1.0, (progress - cfg.warmup_fraction) / (1.0 - cfg.warmup_fraction))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=cfg.device.startswith("cuda"))


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, context: int, batch: int, device: str) -> float:
    """Mean next-byte loss in nats over the stream's byte targets (EOS targets not counted)."""
    model.eval()
    windows = corpus.eval_windows(stream, context)  # windows: [W, L+1]
    total = torch.zeros((), dtype=torch.float64, device=stream.device)
    count = 0
    for chunk in windows.split(batch):
        inputs, targets = chunk[:, :-1].clamp(min=0), chunk[:, 1:]  # [b, L] each
        with autocast(device):
            logits = model(input_ids=inputs, use_cache=False).logits  # logits: [b, L, V]
        nll = F.cross_entropy(logits.float().transpose(1, 2), targets.clamp(min=0), reduction="none")
        is_byte = (targets >= 0) & (targets < 256)
        total += (nll * is_byte).sum(dtype=torch.float64)
        count += int(is_byte.sum())
    model.train()
    return float(total) / count


def train_step(model, opt, batch_ids: torch.Tensor, device: str) -> torch.Tensor:
    """One optimiser step on batch_ids [B, L+1]; returns the (unsynchronised) mean loss."""
    inputs, targets = batch_ids[:, :-1], batch_ids[:, 1:]  # [B, L] each
    with autocast(device):
        logits = model(input_ids=inputs, use_cache=False).logits  # logits: [B, L, V]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def train(model, data: Data, cfg: TrainConfig) -> dict:
    """Runs the wall-clock-budgeted loop; leaves `model` holding the best-on-val weights."""
    opt = make_optimizer(model, cfg)
    gen = torch.Generator(device=data.train.device).manual_seed(cfg.seed)
    best = {"val_loss": float("inf"), "step": 0, "state": None}
    step, next_eval, start = 0, cfg.eval_every_s, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < cfg.seconds:
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, elapsed / cfg.seconds)
        batch_ids = corpus.sample_windows(data.train, cfg.batch, cfg.context, gen)
        loss = train_step(model, opt, batch_ids, cfg.device)
        step += 1
        if elapsed >= next_eval or time.perf_counter() - start >= cfg.seconds:
            next_eval += cfg.eval_every_s
            _checkpoint(model, data, cfg, best, step, float(loss), elapsed)
    seconds = time.perf_counter() - start
    model.load_state_dict(best["state"])
    return {"steps": step, "seconds": round(seconds, 2), "selected_step": best["step"],
            "val_loss_nats_per_byte": round(best["val_loss"], 4),
            "tokens_seen": step * cfg.batch * cfg.context}


def _checkpoint(model, data: Data, cfg: TrainConfig, best: dict, step: int, loss: float,
                elapsed: float) -> None:
    val = evaluate(model, data.val, cfg.context, cfg.batch, cfg.device)
    epochs = step * cfg.batch * cfg.context / data.train.numel()
    print(f"t={elapsed:6.1f}s step={step:6d} epochs={epochs:5.1f} train_loss={loss:.4f} "
          f"val={val:.4f} nats/byte", flush=True)
    if val < best["val_loss"]:
        best.update(val_loss=val, step=step,
                    state={k: v.detach().clone() for k, v in model.state_dict().items()})


def save(model, out: Path, record: dict) -> None:
    """HF layout in bfloat16 plus tokenizer files and training.json."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    # Readers of the pre-5.0 layout look for these two top-level keys.
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out)
    write_tokenizer(out)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def run(cfg: TrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    data = load_data(cfg.device, cfg.val_percent)
    print(json.dumps(data.info), flush=True)
    model = Qwen3ForCausalLM(model_config(cfg.tiny)).to(cfg.device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"parameters={num_params} device={cfg.device}", flush=True)
    stats = train(model, data, cfg)
    model.to(torch.bfloat16)
    heldout = evaluate(model, data.heldout, cfg.context, cfg.batch, cfg.device)
    print(f"heldout_loss={heldout:.4f} nats/byte (bf16 weights) {json.dumps(stats)}", flush=True)
    record = {
        "heldout_loss_nats_per_byte": round(heldout, 4),
        "heldout_eval": f"bf16 weights, consecutive {cfg.context}-byte windows, byte targets only",
        "corpus": data.info, "num_parameters": num_params, **stats,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "device_name": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    save(model, cfg.out, record)
    return record


def parse_args() -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=float, default=5.0, help="seconds between val evals")
    p.add_argument("--tiny", action="store_true", help="2-layer toy model for CPU smoke runs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    return TrainConfig(out=a.out, seconds=a.seconds, batch=a.batch, context=a.context, lr=a.lr,
                       seed=a.seed, eval_every_s=a.eval_every, tiny=a.tiny, device=a.device)


if __name__ == "__main__":
    run(parse_args())
