"""Decode throughput of the engine against transformers' `generate` (issues 2 and 21): Qwen3-0.6B-,
Qwen3-8B- and Qwen3-30B-A3B-shaped random bfloat16 weights, batch 1 and 64, 128 random prompt
tokens, 128 greedy output tokens (EOS ignored / min_new_tokens = max_new_tokens), both measured
in this run on the same weights. Decode tokens/s = the N-1 tokens after the first over (time of
the N-token run - time of a 1-token run), the same for both; end-to-end rates are reported too.

Two floors, each a decode rate at the bandwidth of a large device-to-device copy: `floor` (dense
shapes, batch 1) reads the weights once; `read_floor` (every shape and batch) reads what a
decode step touches: every parameter once except the embedding table (a row per token) and the
experts (those the step routes to: `experts_touched` per sparse layer, counted with hooks in one
eager decode step), plus the KV cache at the mean decode context. A MoE shape's transformers arm
can be limited to some batches (`--hf-batches`) and fewer tokens (`--hf-output-len`), as its
per-expert dispatch is slow. Prints a table, writes JSON (`--out`).

Overlapped scheduling (issue 17, rollout/engine/overlap.py): `--overlap both` measures the engine
with and without it on the same engine in one run (`no_overlap_tokens_per_s`, `overlap_speedup`);
`--overlap off` measures the synchronous loop only. The shape `embedded` is the embedded tiny Qwen3
with its trained weights (no transformers arm, no floors: its steps are host time).

`--compare` measures one alternative beside the default on the same engine, step graphs
recaptured between the arms (`compare_tokens_per_s`, `default_over_compare`, `compare_identical`):
`router-gemm`, the MoE launch table as it is but every step's router logits from the router's
GEMM (no `router_in_norm`); `cublaslt`, cuBLASLt as torch's preferred BLAS library; `no-pdl`, the
Triton kernels launched without programmatic dependent launch (`triton_pdl.ENABLED` off);
`cublas-gemv`, 1-token projections by cuBLAS rather than triton_gemv's kernel (`triton_gemv.ENABLED` off);
`recapture`, nothing changed but the recapture (what the arm measured second pays for it), and
`recapture-fresh` the same with the old graphs dropped before the capture.
`--compare-first` measures the alternative before the default, to check the order does not favour one.

    python benchmarks/bench_engine.py --device cuda
    python benchmarks/bench_engine.py --device cuda --shapes qwen3-30b-a3b --hf-batches 64 --hf-output-len 32
    python benchmarks/bench_engine.py --device cuda --shapes qwen3-8b embedded --batches 1 256 --no-hf --overlap both
    python benchmarks/bench_engine.py --device cuda --shapes qwen3-30b-a3b --batches 1 --no-hf --compare no-pdl
    python benchmarks/bench_engine.py --device cpu --quick     # checks the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (
    SHAPES,
    copy_bandwidth,
    environment,
    free_memory,
    hf_classes,
    hf_config,
    model_dtype,
    print_table,
    run_engine,
    sync,
    weight_bytes,
    write_config_dir,
    write_json,
)

import rollout
from rollout.engine import moe_launch, triton_gemv, triton_pdl
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.kv import bytes_per_block
from rollout.engine.loader import load_state_into
from rollout.engine.moe import SparseMoeBlock, route
from rollout.engine.params import SamplingParams

KV_BLOCK = 16
EMBEDDED = "embedded"  # the embedded tiny Qwen3, its own weights
# Runs before the timed N-token one: two 1-token runs (prefill + first token; the faster one is
# subtracted). Before them an untimed N-token warm-up builds every CUDA graph and kernel the timed
# runs need (a 4-token one could leave a longer context bucket's graphs, or a kernel variant, to be
# built inside the first timed run, always the overlapped one with --overlap both);
# `built_while_timed` counts what was built while timing all the same.
LENGTHS = (1, 1)
COMPARES = ("none", "router-gemm", "cublaslt", "no-pdl", "cublas-gemv", "recapture", "recapture-fresh")  # --compare


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny shape and lengths (CPU check)")
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3-0.6b"], choices=[*SHAPES, EMBEDDED])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--hf-batches", nargs="+", type=int, default=None, help="transformers at these batches only")
    p.add_argument("--hf-output-len", type=int, default=None, help="transformers' N (default --output-len)")
    p.add_argument("--overlap", default="on", choices=("on", "off", "both"),
                   help="overlapped scheduling; both: measure with and without it on the same engine")
    p.add_argument("--compare", default="none", choices=COMPARES,
                   help="an alternative measured beside the default on the same engine (see the docstring)")
    p.add_argument("--compare-first", action="store_true",
                   help="measure --compare's alternative before the default (an order check)")
    p.add_argument("--out", default="benchmarks/results/bench_engine.json")
    args = p.parse_args()
    if args.quick:
        args.shapes, args.batches, args.prompt_len, args.output_len = ["tiny", "tiny-moe"], [1, 4], 16, 8
    args.hf_batches = args.batches if args.hf_batches is None else args.hf_batches
    args.hf_output_len = args.hf_output_len or args.output_len
    return args


def compare_rates(engine: LLMEngine, prompts: list[list[int]], args) -> dict:
    """`engine_rates` under `--compare`'s alternative, with the same overlap setting as the default arm."""
    with alternative(engine, args.compare):
        return engine_rates(engine, prompts, args.output_len, args.device, args.overlap != "off")


@contextlib.contextmanager
def alternative(engine: LLMEngine, name: str):
    """The engine under `--compare`'s alternative, its step graphs captured afresh on the way in
    and out."""
    launches, blas = moe_launch.LAUNCHES, torch.backends.cuda.preferred_blas_library()
    if name == "no-pdl":
        triton_pdl.ENABLED = False
    elif name == "cublas-gemv":
        triton_gemv.ENABLED = False
    elif name == "router-gemm":
        moe_launch.LAUNCHES = tuple((most, dataclasses.replace(launch, router_in_norm=False))
                                    for most, launch in launches)
    elif name == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    recapture(engine, fresh=name == "recapture-fresh")
    try:
        yield
    finally:
        moe_launch.LAUNCHES = launches
        triton_pdl.ENABLED = triton_gemv.ENABLED = True
        torch.backends.cuda.preferred_blas_library(blas)
        recapture(engine)


def recapture(engine: LLMEngine, fresh: bool = False) -> None:
    """New step graphs; `fresh`: the old ones dropped and the allocator's cache emptied first (as
    `resume_memory` captures), else captured while the old ones are alive."""
    if engine.graphs is not None:
        if fresh:
            engine.graphs = None
            gc.collect()
            torch.cuda.empty_cache()
        engine.graphs = engine.make_step_graphs(capture=True)


def build_hf(shape: dict, device: str):
    """transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM with random weights (its own init),
    sdpa (and its default experts implementation), on `device`."""
    cfg = hf_config(shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(model_dtype(device))
    try:
        with torch.device(device):
            hf = hf_classes(shape)[1](cfg)
    finally:
        torch.set_default_dtype(default)
    return hf.eval().requires_grad_(False)


def build_engine(shape: dict | None, root: Path, hf, args: argparse.Namespace) -> LLMEngine:
    """The engine on a config-only directory, then given transformers' weights; the embedded model
    when `shape` is None."""
    per_seq = -(-(args.prompt_len + args.output_len) // KV_BLOCK) + 1
    model = None if shape is None else str(write_config_dir(shape, root))
    config = EngineConfig(
        model=model, load_format="safetensors" if shape is None else "random", device=args.device,
        num_kv_blocks=max(args.batches) * per_seq + 8, block_size=KV_BLOCK, max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(2048, max(args.batches) * args.prompt_len), enable_prefix_caching=False,
    )  # fmt: skip
    engine = rollout.build_engine(config)
    if hf is not None:
        load_state_into(engine.model, hf.state_dict())
    return engine


def rates(batch: int, output_len: int, seconds_1: float, seconds_n: float) -> dict:
    """End-to-end tokens/s of the N-token run, and decode tokens/s: the N - 1 tokens after the
    first, over the time the N-token run took beyond the 1-token run (prefill + first token);
    NaN when timing noise makes that difference non-positive (only seen on a busy CPU)."""
    extra = seconds_n - seconds_1
    return dict(e2e=batch * output_len / seconds_n,
                decode=batch * (output_len - 1) / extra if extra > 0 else float("nan"))  # fmt: skip


def engine_rates(engine: LLMEngine, prompts: list[list[int]], output_len: int, device: str,
                 overlap: bool = True) -> dict:
    """Greedy decode rates (`rates`) and the last run's token ids in prompt order (`tokens`)."""
    engine.pipeline.enabled = overlap  # between runs: nothing is in flight
    seconds: dict[int, float] = {}
    for i, n in enumerate((output_len, *LENGTHS, output_len)):  # the first: the warm-up (see LENGTHS)
        if i == 1:
            built = sum(engine.compiled().values())
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        run = run_engine(engine, [(p, params, {}) for p in prompts], f"r{i}", device)
        assert run.tokens == len(prompts) * n, run.tokens
        if i:
            seconds[n] = min(seconds.get(n, float("inf")), run.seconds)
    tokens = [o.token_ids for o in sorted(run.outputs, key=lambda o: int(o.request_id.rsplit("-", 1)[-1]))]
    return dict(rates(len(prompts), output_len, seconds[1], seconds[output_len]), tokens=tokens,
                built_while_timed=sum(engine.compiled().values()) - built)


@torch.inference_mode()
def hf_rates(hf, prompts: list[list[int]], output_len: int, device: str) -> dict:
    ids = torch.tensor(prompts, device=device)  # [B, P]
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    seconds: dict[int, float] = {}
    for n in (4, *LENGTHS, output_len):  # (a short warm-up first)
        sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)  # [B, P + n]
        sync(device)
        seconds[n] = min(seconds.get(n, float("inf")), time.perf_counter() - start)
        assert out.shape[1] == ids.shape[1] + n, out.shape
    return rates(len(prompts), output_len, seconds[1], seconds[output_len])


def step_read_bytes(model, batch: int, context: int, experts_touched: float) -> float:
    """Bytes a decode step of `batch` sequences at `context` tokens reads: each parameter once,
    but of an untied embedding table one row per token and of each expert tensor
    `experts_touched` of its experts; plus the sequences' K and V."""
    total = 0.0
    for name, p in model.named_parameters():  # a tied LM head is listed (and read) once
        nbytes = p.numel() * p.element_size()
        if name == "embed_tokens.weight" and not model.config.tie_word_embeddings:
            nbytes = batch * p.shape[1] * p.element_size()
        elif ".experts." in name:  # [E, ...]
            nbytes = nbytes * experts_touched / p.shape[0]
        total += nbytes
    elem = next(model.parameters()).element_size()
    return total + batch * context * bytes_per_block(model.config, 1, elem)


def experts_touched(engine: LLMEngine, prompts: list[list[int]], device: str) -> float:
    """Distinct experts per sparse layer that one decode step of `prompts` routes to (their second
    token), mean over layers; read by hooks on the MoE blocks in an eager step (graph replays run
    no hooks). 0 for a dense model."""
    counts: list[int] = []

    def count(block, args, _out):
        if args[0].shape[0] == len(prompts):  # the decode step (the prefill step has more tokens)
            counts.append(route(block.gate(args[0]), block.top_k, block.renormalize)[1].unique().numel())

    blocks = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    hooks = [block.register_forward_hook(count) for block in blocks]
    graphs, engine.graphs = engine.graphs, None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        run_engine(engine, [(p, params, {}) for p in prompts], "touched", device)
    finally:
        engine.graphs = graphs
        for hook in hooks:
            hook.remove()
    return statistics.fmean(counts) if counts else 0.0


def bench_shape(name: str, args: argparse.Namespace, bandwidth: float, result: dict) -> None:
    shape = SHAPES.get(name)
    start = time.perf_counter()
    hf = None if args.no_hf or shape is None else build_hf(shape, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(shape, Path(tmp), hf, args)
    nbytes = weight_bytes(engine.model)
    moe = engine.model.config.moe is not None
    print(f"{name}: weights {nbytes / 1e9:.2f} GB, built in {time.perf_counter() - start:.1f} s", flush=True)
    rng = random.Random(0)
    context = args.prompt_len + args.output_len // 2  # the mean context of the decode steps
    for batch in args.batches:
        prompts = [[rng.randrange(engine.vocab_size) for _ in range(args.prompt_len)] for _ in range(batch)]
        touched = experts_touched(engine, prompts, args.device)
        read = step_read_bytes(engine.model, batch, context, touched)
        row = dict(shape=name, batch=batch, weight_gb=nbytes / 1e9, read_gb=read / 1e9, experts_touched=touched,
                   read_floor_tokens_per_s=batch * bandwidth / read)  # fmt: skip
        other = compare_rates(engine, prompts, args) if args.compare_first else None
        ours = engine_rates(engine, prompts, args.output_len, args.device, args.overlap != "off")
        row.update(engine_tokens_per_s=ours["decode"], engine_e2e_tokens_per_s=ours["e2e"], overlap=args.overlap,
                   built_while_timed=ours["built_while_timed"])
        if args.overlap == "both":
            sync_loop = engine_rates(engine, prompts, args.output_len, args.device, overlap=False)
            row.update(no_overlap_tokens_per_s=sync_loop["decode"], no_overlap_e2e_tokens_per_s=sync_loop["e2e"],
                       overlap_speedup=ours["decode"] / sync_loop["decode"],
                       overlap_identical=ours["tokens"] == sync_loop["tokens"])  # greedy: the same tokens
        if args.compare != "none":
            other = other or compare_rates(engine, prompts, args)
            row.update(compare=args.compare, compare_first=args.compare_first, compare_tokens_per_s=other["decode"],
                       default_over_compare=ours["decode"] / other["decode"],
                       compare_identical=ours["tokens"] == other["tokens"])
        row["fraction_of_read_floor"] = ours["decode"] / row["read_floor_tokens_per_s"]
        if batch == 1 and not moe:
            row["floor_tokens_per_s"] = bandwidth / nbytes
            row["fraction_of_floor"] = ours["decode"] / row["floor_tokens_per_s"]
        if hf is not None and batch in args.hf_batches:
            theirs = hf_rates(hf, prompts, args.hf_output_len, args.device)
            row.update(hf_tokens_per_s=theirs["decode"], hf_e2e_tokens_per_s=theirs["e2e"],
                       hf_output_len=args.hf_output_len, engine_over_hf=ours["decode"] / theirs["decode"])
        result["rows"].append(row)
        write_json(args.out, result)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if hf is not None:
        result.setdefault("hf_experts_implementation", {})[name] = getattr(hf.config, "_experts_implementation", None)
    del engine, hf
    free_memory()


def main() -> None:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth(args.device, (64 << 20) if args.quick else (4 << 30))
    print(f"device copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)", flush=True)
    result = dict(args=vars(args), env=environment(args.device), copy_bandwidth_bytes_per_s=bandwidth, rows=[])
    for name in args.shapes:
        bench_shape(name, args, bandwidth, result)
    columns = ["shape", "batch", "engine_tokens_per_s", "no_overlap_tokens_per_s", "overlap_speedup",
               "overlap_identical", "compare_tokens_per_s", "default_over_compare", "compare_identical",
               "hf_tokens_per_s", "engine_over_hf", "floor_tokens_per_s",
               "fraction_of_floor", "experts_touched", "read_floor_tokens_per_s", "fraction_of_read_floor",
               "engine_e2e_tokens_per_s", "hf_e2e_tokens_per_s"]  # fmt: skip
    print_table(
        f"decode tokens/s (after the first token; e2e = incl. prefill), {args.prompt_len} prompt + "
        f"{args.output_len} greedy tokens, {args.device} "
        f"(goals: 8B batch 1 >= 0.5 of floor; batch 64 >= 10x transformers; 30B-A3B batch 1 and 64 >= 0.5 of "
        f"read floor)", result["rows"], columns,
    )
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
