"""Speculative acceptance of the embedded DFlash drafter under each execution path: a diagnostic
for an acceptance that differs between devices (BENCHMARKS.md, issue 4's fourth-session notes:
on the H200 ~1.0 where CPU runs give ~2.8 for the same workload).

Workload: `--requests` held-out prompts (256 tokens) x `--tokens` output tokens, temperature 1,
top_k 64, top_p 0.95, min_tokens = max_tokens, seeded; one engine per configuration, each run
alone. Configurations (what the device allows): the kernel backend (torch, triton) x the step's
execution (eager; the CUDA-graph code path, captured on a GPU, run eagerly with `capture=False`
elsewhere) x the SDPA backend the drafter's attention may use (PyTorch's choice, or MATH only: a
lead, pytorch/pytorch#191937 reports EFFICIENT_ATTENTION corrupting bf16 outputs with a boolean
mask and broadcast K/V on CUDA, which is the drafter's call with GQA). The acceptance (committed
tokens per verify step) should not depend on any of them beyond sampling noise: the same model,
drafter and seeds. Prints a table, writes JSON.

    python benchmarks/check_acceptance.py --device cuda
    python benchmarks/check_acceptance.py --device cpu --requests 8 --tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from common import embedded_draft, environment, heldout_prompts, print_table, write_json
from torch.nn.attention import SDPBackend, sdpa_kernel

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    p.add_argument("--sdpa", nargs="+", default=["auto", "math"], choices=["auto", "math"])
    p.add_argument("--out", default="benchmarks/results/check_acceptance.json")
    return p.parse_args()


def run(args: argparse.Namespace, backend: str, graphs: bool, sdpa: str) -> dict:
    with sdpa_kernel(SDPBackend.MATH) if sdpa == "math" else contextlib.nullcontext():  # (graphs capture in here)
        return _run(args, backend, graphs, sdpa)


def workload_engine(args: argparse.Namespace, backend: str, graphs: bool) -> LLMEngine:
    """The embedded DFlash engine with the workload queued (`--requests` x `--tokens`, seeded);
    `graphs`: captured on a GPU, the same static-buffer path run eagerly elsewhere."""
    on_gpu = args.device == "cuda"
    engine = build_engine(EngineConfig(
        spec="dflash", draft=embedded_draft("dflash"), device=args.device, kernel_backend=backend,
        cuda_graphs=graphs and on_gpu, num_kv_blocks=args.requests * ((256 + args.tokens) // 16 + 4) + 8,
        max_num_seqs=args.requests, max_num_batched_tokens=max(2048, 256 * args.requests),
        enable_prefix_caching=False,
    ))  # fmt: skip
    if graphs and not on_gpu:
        engine.graphs = engine.make_step_graphs(capture=False)
    for i, prompt in enumerate(heldout_prompts(args.requests)):
        params = SamplingParams(temperature=1.0, top_k=64, top_p=0.95, max_tokens=args.tokens,
                                min_tokens=args.tokens, seed=i)
        engine.add_request(f"r{i}", [prompt], params)
    return engine


def run_to_end(engine: LLMEngine) -> tuple[list, int, float]:
    """(finished samples, steps, mean acceptance: committed tokens per verify step, prefill left out)."""
    outputs, steps = [], 0
    while engine.has_unfinished():
        outputs += engine.step()
        steps += 1
    accepted = [n for o in outputs for n in o.accept_lengths[1:]]
    return outputs, steps, statistics.fmean(accepted) if accepted else 0.0


def _run(args: argparse.Namespace, backend: str, graphs: bool, sdpa: str) -> dict:
    on_gpu = args.device == "cuda"
    engine = workload_engine(args, backend, graphs)
    start = time.perf_counter()
    outputs, steps, acceptance = run_to_end(engine)
    seconds = time.perf_counter() - start
    replays = engine.graphs.num_replays if engine.graphs is not None else 0
    return dict(backend=backend, sdpa=sdpa, graphs=("captured" if on_gpu else "eager path") if graphs else "off",
                steps=steps, acceptance=acceptance, graph_replays=replays,
                tokens_per_s=sum(len(o.token_ids) for o in outputs) / seconds)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    result = dict(args=vars(args), env=environment(args.device), rows=[])
    backends = args.backends if args.device == "cuda" else ["torch"]  # (triton on CPU: interpreted, slow)
    for sdpa in args.sdpa:
        for backend in backends:
            for graphs in (False, True):
                row = run(args, backend, graphs, sdpa)
                result["rows"].append(row)
                print(row, flush=True)
                write_json(args.out, result)
    print_table(f"DFlash acceptance by execution path ({args.device}, {args.requests} x {args.tokens} tokens)",
                result["rows"], ["sdpa", "backend", "graphs", "steps", "acceptance", "graph_replays", "tokens_per_s"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
