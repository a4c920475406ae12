"""Trains the embedded DFlash and DSpark drafters of the tiny target and measures their acceptance.

`python scripts/train_drafters.py --target rollout/assets/tiny-qwen3 --out DIR --seconds 120`
writes DIR/tiny-qwen3-dflash and DIR/tiny-qwen3-dspark (config.json, model.safetensors,
training.json). Data: windows of the stdlib corpus (scripts/corpus.py, train split) plus a
pool of continuations the target itself wrote from train-file prompts (half greedy, half at
temperature 1), so the drafters see the text they will have to predict. Objective (block
diffusion, as DFlash): blocks `[x_a, MASK * (B-1)]` at random anchors a attend to the target
context before a; each position is trained towards the target at that position: cross-entropy
on the target's greedy token plus a KL term to the target's full distribution, weighted down
along the block. DSpark adds its Markov head (teacher-forced previous tokens) and a confidence
head trained with BCE on "the draft token equals the target's greedy token". Acceptance is
measured by a sequential greedy simulation on held-out files: prompts of held-out text, the
target's greedy continuation, and at every verify step the drafter proposes block_size - 1
tokens from the committed context; accepted = the leading drafts equal to the target's
tokens; committed per step = accepted + 1. The training time budget counts the pool
generation. Needs transformers (the target's hidden states come from Qwen3ForCausalLM).

`--rewrite-configs` trains nothing: it rewrites the config.json of the drafters already in DIR
in the current published layout (rollout.spec.draft_loader), weights untouched.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import corpus
import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout.engine.loader import load_model  # noqa: E402
from rollout.spec.draft_loader import (  # noqa: E402
    load_drafter,
    random_drafter,
    save_drafter,
    write_drafter_config,
)
from rollout.spec.draft_model import DraftModel  # noqa: E402

MASK_ID = 258


@dataclass(frozen=True)
class TrainConfig:
    target: Path
    out: Path
    seconds: float = 120.0
    kinds: tuple[str, ...] = ("dflash", "dspark")
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 3, 5)
    draft_layers: int = 2
    markov_rank: int = 32
    batch: int = 64
    context: int = 512
    anchors: int = 32
    lr: float = 2e-3
    kl_weight: float = 0.5
    confidence_weight: float = 0.2
    position_decay: float = 4.0
    pool_sequences: int = 1024
    pool_prompt: int = 128
    eval_prompts: int = 128
    eval_prompt_len: int = 256
    eval_tokens: int = 256
    seed: int = 0
    device: str = "cuda"

    def __post_init__(self):
        if self.context <= self.block_size + 1 or self.eval_tokens <= self.block_size:
            raise ValueError("context and eval_tokens must exceed block_size + 1")
        if self.pool_prompt >= self.context:
            raise ValueError(f"pool_prompt {self.pool_prompt} must be below context {self.context}")


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


@torch.no_grad()
def target_pass(hf, ids: torch.Tensor, layer_ids: tuple[int, ...], device: str):
    """ids: [b, L] -> (aux [b, L, n*Ht] = outputs of decoder layers layer_ids, logits [b, L, V] f32)."""
    with autocast(device):
        out = hf(input_ids=ids, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return aux.float(), out.logits.float()


@torch.no_grad()
def generate(hf, prompts: torch.Tensor, new_tokens: int, temperature: float, gen: torch.Generator,
             device: str) -> torch.Tensor:
    """Continue prompts [b, P] by `new_tokens` target tokens (greedy at temperature 0). Returns [b, P+n]."""
    cache = transformers.DynamicCache()
    seq, step_ids = prompts, prompts
    for _ in range(new_tokens):
        with autocast(device):
            logits = hf(input_ids=step_ids, past_key_values=cache, use_cache=True).logits[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
        step_ids = nxt[:, None]
        seq = torch.cat([seq, step_ids], dim=1)
    return seq


def build_pool(hf, stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """Target-written sequences [pool_sequences, context]: train-text prompts + continuations."""
    chunks, per = [], 256
    for i in range(0, cfg.pool_sequences, per):
        prompts = corpus.sample_windows(stream, min(per, cfg.pool_sequences - i), cfg.pool_prompt - 1, gen)
        temperature = 0.0 if (i // per) % 2 == 0 else 1.0
        chunks.append(generate(hf, prompts, cfg.context - cfg.pool_prompt, temperature, gen, cfg.device))
    return torch.cat(chunks)


def sample_batch(stream: torch.Tensor, pool: torch.Tensor, cfg: TrainConfig, gen: torch.Generator):
    """Half corpus windows, half pool sequences: ids [batch, context]."""
    half = cfg.batch // 2
    text = corpus.sample_windows(stream, cfg.batch - half, cfg.context - 1, gen)
    rows = torch.randint(0, pool.shape[0], (half,), device=pool.device, generator=gen)
    return torch.cat([text, pool[rows]])


def block_targets(logits: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Target logits for the block positions a+1..a+B-1 (read at a..a+B-2): [b, A, B-1, V]."""
    idx = anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)  # [b, A, B-1]
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None, None]
    return logits[rows, idx]


def drafter_loss(drafter: DraftModel, aux, ids, logits, cfg: TrainConfig, gen: torch.Generator):
    """Block-diffusion loss of one batch; returns (loss, per-position greedy accuracy [B-1])."""
    B = cfg.block_size
    anchors = torch.randint(1, cfg.context - B + 1, (ids.shape[0], cfg.anchors), device=ids.device,
                            generator=gen)  # anchors: [b, A]
    teacher = block_targets(logits, anchors, B)  # [b, A, B-1, V]
    labels = teacher.argmax(-1)  # labels: [b, A, B-1]
    prev = torch.cat([ids.gather(1, anchors)[..., None], labels[..., :-1]], dim=-1)
    with autocast(cfg.device):
        draft, conf = drafter.train_logits(aux, ids, anchors, prev)
    weight = torch.exp(-torch.arange(B - 1, device=ids.device) / cfg.position_decay)
    weight = weight / weight.mean()
    ce = F.cross_entropy(draft.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    log_q, log_p = draft.log_softmax(-1), teacher.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # kl: [b, A, B-1]
    loss = ((ce + cfg.kl_weight * kl) * weight).mean()
    hit = (draft.argmax(-1) == labels).float()
    if conf is not None:
        loss = loss + cfg.confidence_weight * F.binary_cross_entropy_with_logits(conf, hit)
    return loss, hit.mean((0, 1))


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """3% linear warm-up, then cosine decay to 5% of the peak, over wall-clock progress."""
    if progress < 0.03:
        return cfg.lr * progress / 0.03
    t = min(1.0, (progress - 0.03) / 0.97)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def new_drafter(kind: str, target, cfg: TrainConfig) -> DraftModel:
    model = random_drafter(target, kind, cfg.block_size, num_layers=cfg.draft_layers, seed=cfg.seed,
                           markov_rank=cfg.markov_rank, mask_token_id=MASK_ID,
                           target_layer_ids=cfg.target_layer_ids).float().train()
    if kind == "dspark":
        with torch.no_grad():
            model.markov_head.markov_w2.weight.zero_()
            model.markov_head.markov_w1.weight.normal_(0.0, 0.02)
            model.confidence_head.proj.weight.zero_()
            model.confidence_head.proj.bias.zero_()
    return model.requires_grad_(True)


def train_drafter(kind: str, hf, target, stream, pool, cfg: TrainConfig, seconds: float
                  ) -> tuple[DraftModel, dict]:
    drafter = new_drafter(kind, target, cfg)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 7)
    step, next_log, start = 0, 10.0, time.perf_counter()
    while step == 0 or (elapsed := time.perf_counter() - start) < seconds:
        elapsed = time.perf_counter() - start
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, min(1.0, elapsed / max(seconds, 1e-9)))
        ids = sample_batch(stream, pool, cfg, gen)
        aux, logits = target_pass(hf, ids, cfg.target_layer_ids, cfg.device)
        loss, acc = drafter_loss(drafter, aux, ids, logits, cfg, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if elapsed >= next_log:
            next_log += 10.0
            print(f"{kind} t={elapsed:6.1f}s step={step} loss={loss.item():.4f} "
                  f"acc={[round(float(a), 3) for a in acc]}", flush=True)
    stats = {"steps": step, "train_seconds": round(time.perf_counter() - start, 2),
             "final_loss": round(loss.item(), 4),
             "final_position_accuracy": [round(float(a), 4) for a in acc]}
    return drafter.eval(), stats


@torch.no_grad()
def propose(drafter: DraftModel, seqs, starts, ctx_k, ctx_v, device: str):
    """Greedy drafts [S, B-1] (and DSpark confidences [S, B-1]) for anchors at `starts` [S]."""
    B = drafter.config.block_size
    positions = starts[:, None] + torch.arange(B, device=seqs.device)  # [S, B]
    block_ids = torch.full_like(positions, drafter.config.mask_token_id)
    block_ids[:, 0] = seqs.gather(1, starts[:, None])[:, 0]
    with autocast(device):
        hidden = drafter.block_hidden(block_ids, positions, ctx_k, ctx_v, starts)[:, 1:]
    base = drafter.logits(hidden)  # [S, B-1, V]
    if drafter.config.kind == "dflash":
        return base.argmax(-1), None
    prev, drafts, confs = block_ids[:, 0], [], []
    for i in range(B - 1):
        bias, emb = drafter.markov_bias(prev)
        prev = (base[:, i] + bias).argmax(-1)
        drafts.append(prev)
        confs.append(drafter.confidence(hidden[:, i].float(), emb))
    return torch.stack(drafts, 1), torch.stack(confs, 1)


@torch.no_grad()
def simulate_acceptance(drafter: DraftModel, hf, seqs: torch.Tensor, prompt_len: int, cfg: TrainConfig,
                        threshold: float = 0.0) -> dict:
    """Sequential greedy speculative decoding over the target's own greedy continuations `seqs`
    [n, P+N]: committed tokens per verify step (accepted drafts + 1). With a confidence
    threshold (DSpark), each draft stops at its first position predicted below it."""
    B = drafter.config.block_size
    aux, _ = target_pass(hf, seqs, drafter.config.target_layer_ids, cfg.device)
    with autocast(cfg.device):
        kv = drafter.context_kv(drafter.project_context(aux),
                                torch.arange(seqs.shape[1], device=seqs.device).expand(seqs.shape))
    ctx_k, ctx_v = [k for k, _ in kv], [v for _, v in kv]
    starts = torch.full((seqs.shape[0],), prompt_len, device=seqs.device)
    committed, drafted = [], []
    while bool((active := starts + B <= seqs.shape[1]).any()):
        rows = active.nonzero()[:, 0]
        s = starts[rows]
        drafts, conf = propose(drafter, seqs[rows], s, [k[rows] for k in ctx_k], [v[rows] for v in ctx_v],
                               cfg.device)
        truth = seqs[rows[:, None], s[:, None] + torch.arange(1, B, device=seqs.device)]
        keep = torch.ones_like(drafts, dtype=torch.bool)
        if conf is not None and threshold > 0:
            keep = (conf >= threshold).long().cumprod(1).bool()
        accepted = ((drafts == truth) & keep).long().cumprod(1).sum(1)
        committed.append(accepted + 1)
        drafted.append(keep.sum(1))
        starts[rows] = s + accepted + 1
    committed, drafted = torch.cat(committed).float(), torch.cat(drafted).float()
    return {"mean_acceptance_length": round(float(committed.mean()), 4),
            "mean_drafted_tokens": round(float(drafted.mean()), 3), "verify_steps": committed.numel(),
            "threshold": threshold}


def eval_sequences(hf, heldout: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """Held-out prompts (fixed seed) and the target's greedy continuations: [n, P+N]."""
    gen = torch.Generator(device=cfg.device).manual_seed(1234)
    prompts = corpus.sample_windows(heldout, cfg.eval_prompts, cfg.eval_prompt_len - 1, gen)
    return generate(hf, prompts, cfg.eval_tokens, 0.0, gen, cfg.device)


def run(cfg: TrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    c = corpus.load_corpus()
    stream = corpus.token_stream(corpus.read_documents(c.paths("train"))).to(cfg.device)
    heldout = corpus.token_stream(corpus.read_documents(c.paths("heldout"))).to(cfg.device)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(cfg.target, dtype=torch.bfloat16).to(cfg.device).eval()
    target = load_model(cfg.target, device=cfg.device, dtype=torch.float32)
    seqs = eval_sequences(hf, heldout, cfg)
    start = time.perf_counter()
    pool = build_pool(hf, stream, cfg, torch.Generator(device=cfg.device).manual_seed(cfg.seed))
    pool_seconds = time.perf_counter() - start
    print(f"pool {tuple(pool.shape)} in {pool_seconds:.1f}s; eval {tuple(seqs.shape)}", flush=True)
    info = {"python_version": c.python_version, "file_list_sha256": c.file_list_sha256,
            "num_train_files": len(c.train), "num_heldout_files": len(c.heldout),
            "target": str(cfg.target), "target_training": _target_record(cfg.target)}
    records = {}
    for kind in cfg.kinds:
        drafter, stats = train_drafter(kind, hf, target, stream, pool, cfg, cfg.seconds - pool_seconds)
        evals = [simulate_acceptance(drafter, hf, seqs, cfg.eval_prompt_len, cfg)]
        if kind == "dspark":
            evals += [simulate_acceptance(drafter, hf, seqs, cfg.eval_prompt_len, cfg, t) for t in (0.3, 0.5)]
        record = {"kind": kind, "acceptance_greedy_heldout": evals, **stats,
                  "pool_seconds": round(pool_seconds, 2), "corpus": info, "eval": _eval_note(cfg),
                  "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
                  "device_name": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu",
                  "versions": {"python": platform.python_version(), "torch": torch.__version__,
                               "transformers": transformers.__version__}}
        print(json.dumps({k: record[k] for k in ("kind", "acceptance_greedy_heldout", "steps")}), flush=True)
        out = cfg.out / f"tiny-qwen3-{kind}"
        save_drafter(drafter, out, extra=_config_extra(kind, cfg.anchors), target=target)
        (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        records[kind] = record
    return records


def _config_extra(kind: str, anchors: int) -> dict:
    """Published DSpark configs record the training's anchor blocks per sequence."""
    return {"num_anchors": anchors} if kind == "dspark" else {}


def rewrite_configs(cfg: TrainConfig) -> None:
    """Rewrite config.json of the drafters in cfg.out from their checkpoints; weights untouched."""
    target = load_model(cfg.target, device="cpu", dtype=torch.float32)
    for kind in cfg.kinds:
        out = cfg.out / f"tiny-qwen3-{kind}"
        anchors = json.loads((out / "training.json").read_text())["config"]["anchors"]
        write_drafter_config(load_drafter(out, target), out, target, _config_extra(kind, anchors))
        print(f"rewrote {out / 'config.json'}")


def _eval_note(cfg: TrainConfig) -> str:
    return (f"{cfg.eval_prompts} held-out prompts of {cfg.eval_prompt_len} bytes, the target's greedy "
            f"continuation of {cfg.eval_tokens} tokens (bf16), sequential greedy verification at block "
            f"size {cfg.block_size}; committed tokens per verify step = accepted drafts + 1")


def _target_record(path: Path) -> dict:
    record = path / "training.json"
    if not record.is_file():
        return {}
    d = json.loads(record.read_text())
    return {k: d[k] for k in ("heldout_loss_nats_per_byte",) if k in d} | \
        {"file_list_sha256": d.get("corpus", {}).get("file_list_sha256")}


def parse_args() -> tuple[TrainConfig, bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=120.0, help="per drafter, pool generation included")
    p.add_argument("--kinds", default="dflash,dspark")
    p.add_argument("--small", action="store_true", help="tiny batches and evals for CPU smoke runs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rewrite-configs", action="store_true", help="only rewrite DIR's drafter configs")
    a = p.parse_args()
    cfg = TrainConfig(target=a.target, out=a.out, seconds=a.seconds, kinds=tuple(a.kinds.split(",")),
                      device=a.device)
    if a.small:
        cfg = replace(cfg, batch=4, context=64, anchors=4, pool_sequences=4, pool_prompt=32, eval_prompts=2,
                      eval_prompt_len=32, eval_tokens=24, target_layer_ids=(0, 1))
    return cfg, a.rewrite_configs


if __name__ == "__main__":
    config, rewrite = parse_args()
    if rewrite:
        rewrite_configs(config)
    else:
        run(config)
