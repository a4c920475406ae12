"""Shared pieces of the GPU benchmark scripts: Qwen3-shaped random model directories, device
timing and copy bandwidth, held-out prompts from the stdlib corpus, the embedded drafters,
running an engine to completion, and the table + JSON every script prints and writes.

Shapes: Qwen3-0.6B, -8B and Qwen3-30B-A3B (MoE), and tiny ones for CPU checks of the scripts.
Random-weight models are directories holding only `config.json`, loaded with
`EngineConfig(load_format="random")`. The model forward helpers (`metadata`, `kv_caches`,
`random_model`, the 8B shape) come from `scripts/bench_target.py`, the corpus split from
`scripts/corpus.py`; both are imported from `scripts/` here.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_target  # noqa: E402  (scripts/bench_target.py)
import corpus  # noqa: E402  (scripts/corpus.py)
from bench_target import kv_caches, metadata, random_model  # noqa: E402, F401  (re-exported)

from rollout.engine.config import DEFAULT_DRAFTS  # noqa: E402
from rollout.engine.engine import LLMEngine  # noqa: E402

QWEN3_0_6B = dict(
    bench_target.QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
)  # fmt: skip
QWEN3_8B = bench_target.QWEN3_8B
# --quick: a shape small enough for a CPU check of the scripts themselves.
QWEN3_TINY = dict(
    bench_target.QWEN3_8B, vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
)  # fmt: skip
# Qwen3-30B-A3B: 48 sparse layers of 128 experts (width 768), 8 routed per token, renormalised.
QWEN3_30B_A3B = dict(
    bench_target.QWEN3_8B, model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
QWEN3_MOE_TINY = dict(
    QWEN3_TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
)  # fmt: skip
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": QWEN3_TINY,
          "tiny-moe": QWEN3_MOE_TINY}


def hf_classes(shape: dict):
    """(config class, causal-LM class) of transformers for a shape's model_type."""
    import transformers

    if shape["model_type"] == "qwen3_moe":
        return transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    return transformers.Qwen3Config, transformers.Qwen3ForCausalLM


def hf_config(shape: dict):
    """transformers' config of a shape (the one config both engines read)."""
    fields = {k: v for k, v in shape.items() if k not in ("model_type", "rope_theta")}
    rope = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
    return hf_classes(shape)[0](**fields, rope_parameters=rope)


def write_config_dir(shape: dict, root: Path) -> Path:
    """A model directory with only config.json (for `load_format="random"`)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(hf_config(shape).to_json_string())
    return root


def random_target_and_drafter(shape: str, device: str, root: Path, block_size: int = 8) -> tuple[str, str]:
    """A config-only target directory of `shape` (random weights at load: `load_format="random"`) and an
    untrained one-layer DFlash drafter for it, both under `root`: (target dir, drafter dir). The
    drafter's proposals are almost never accepted: a step commits about one token a sequence."""
    from rollout.engine.loader import load_model
    from rollout.spec.draft_loader import random_drafter, save_drafter

    model_dir = write_config_dir(SHAPES[shape], root / "target")
    target = load_model(model_dir, device, load_format="random")
    save_drafter(random_drafter(target, "dflash", block_size=block_size, num_layers=1, seed=1), root / "dflash")
    del target
    free_memory()
    return str(model_dir), str(root / "dflash")


def model_dtype(device: str) -> torch.dtype:
    """The engine's dtype on `device` (bfloat16 on CUDA, float32 on CPU)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: str, iters: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds of `fn()` over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def graph_ms(fn, device: str, iters: int = 20) -> float | None:
    """Mean milliseconds of replaying `fn` captured as one CUDA graph; None off CUDA. `fn` runs
    once first, so lazy tables and attention plans are built outside the capture."""
    if device != "cuda":
        return None
    return time_ms(captured(fn, 1).replay, device, iters)


def captured(fn, calls: int):
    """A CUDA graph of `calls` calls of fn. fn runs once first (lazy tables and plans are built
    outside the capture), and the graph is replayed once before it is returned."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_times_ms(graphs: list, calls: int, repeats: int) -> list[list[float]]:
    """Milliseconds per call of each CUDA graph (of `calls` calls) over `repeats` replays, the
    graphs replayed in turn so that a drift of clocks or caches touches them alike."""
    times = [[] for _ in graphs]
    for _ in range(repeats):
        for graph, out in zip(graphs, times, strict=True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / calls)
    return times


def time_us(fn, device: str, reps: int, capture: bool = True) -> float:
    """Median microseconds of one `fn()`: on CUDA timed with events around each call, `fn`
    captured as a CUDA graph first (after a warm-up call outside the capture: compilation, lazy
    tables) unless `capture` is False (e.g. `fn` replays a graph itself); the host clock elsewhere."""
    fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    run = fn
    if capture:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s moved by a large device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=10)
    return 2 * nbytes / (ms / 1e3)


def matmul_rate(device: str) -> float:
    """FLOP/s of a large square matmul in the engine's dtype (bfloat16 on CUDA)."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (256, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (time_ms(lambda: a @ b, device, iters=10) / 1e3)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied ones counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def heldout_prompts(count: int, num_bytes: int = 256) -> list[list[int]]:
    """The first `num_bytes` bytes of held-out stdlib files as byte token ids, cycled to `count`."""
    files = [p for p in corpus.heldout_files() if p.stat().st_size >= num_bytes]
    return [list(files[i % len(files)].read_bytes()[:num_bytes]) for i in range(count)]


def embedded_draft(kind: str) -> str | None:
    """The embedded drafter directory of `kind`, or None while it is not in the repository."""
    path = DEFAULT_DRAFTS[kind]
    return str(path) if (path / "config.json").is_file() else None


@dataclass
class Run:
    """One workload run to completion: its finished samples, engine steps and wall time."""

    outputs: list
    steps: int
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def mean_acceptance(self) -> float:
        """Committed tokens per verify step, the first (prefill) step of each sample left out."""
        steps = [n for o in self.outputs for n in o.accept_lengths[1:]]
        return statistics.fmean(steps) if steps else float("nan")


def run_engine(engine: LLMEngine, requests: list[tuple[list[int], object, dict]], tag: str,
               device: str) -> Run:
    """Add every (prompt, SamplingParams, add_request keywords) at once and step until done."""
    sync(device)
    start = time.perf_counter()
    for i, (prompt, params, extra) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", [prompt], params, **extra)
    outputs, steps = [], 0
    while engine.has_unfinished():
        outputs += engine.step()
        steps += 1
    sync(device)
    seconds = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} sample(s) failed, first: {errors[0]}")
    return Run(outputs, steps, seconds)


def run_interleaved(engines: dict[str, LLMEngine], requests: dict[str, list[tuple[list[int], object, dict]]],
                    tag: str, device: str) -> dict[str, Run]:
    """Two (or more) engines stepped in turn, one step each, until all are done: each engine's
    `Run.seconds` is the time inside its own add_request and step calls, each step followed by a
    device synchronisation inside that time. A machine whose speed drifts (a shared host) then slows
    every arm alike, which back-to-back runs cannot promise, and arms do not overlap on the device.
    With overlapped scheduling (the default) a step launches the engine's next one before its sync:
    the synchronisation runs that step to its end inside this engine's time, so a step costs what the
    synchronous loop's does (plus overlap's bookkeeping). Ratios between arms hold; an engine's own
    throughput, and a draft budget's view of its step costs, are those of its synchronous loop: where
    they matter, `run_in_turn`."""
    outputs = {name: [] for name in engines}
    steps = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    sync(device)
    for name, engine in engines.items():
        start = time.perf_counter()
        for i, (prompt, params, extra) in enumerate(requests[name]):
            engine.add_request(f"{tag}-{name}-{i}", [prompt], params, **extra)
        seconds[name] += time.perf_counter() - start
    while any(engine.has_unfinished() for engine in engines.values()):
        for name, engine in engines.items():
            if engine.has_unfinished():
                start = time.perf_counter()
                outputs[name] += engine.step()
                sync(device)  # (the step launched ahead ends here, not inside the next arm's time)
                seconds[name] += time.perf_counter() - start
                steps[name] += 1
    runs = {name: Run(outputs[name], steps[name], seconds[name]) for name in engines}
    for name, run in runs.items():
        errors = [o.error for o in run.outputs if o.error]
        if errors:
            raise RuntimeError(f"{name}: {len(errors)} sample(s) failed, first: {errors[0]}")
    return runs


def run_in_turn(engines: dict[str, LLMEngine], requests: dict[str, list[tuple[list[int], object, dict]]],
                tag: str, device: str, reverse: bool = False) -> dict[str, Run]:
    """Each engine's workload run alone to its end (`run_engine`), one engine after another (in
    reverse order with `reverse`: alternate it between rounds, so no arm always follows the same
    one). Engines of one process share the device's stream, so stepping them in turn
    (`run_interleaved`) would put one engine's step launched ahead inside another's time and cost
    model; here each engine overlaps its own steps as a server does."""
    order = list(engines)[::-1] if reverse else list(engines)
    runs = {name: run_engine(engines[name], requests[name], f"{tag}-{name}", device) for name in order}
    return {name: runs[name] for name in engines}


def arm_medians(rows: list[dict], by: tuple[str, ...], keys: tuple[str, ...]) -> list[dict]:
    """Rows of repeated runs grouped by the fields `by` (in first-seen order): per group its runs
    (`rounds`), and each of `keys` the rows have, its median and its spread (max - min)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[f] for f in by), []).append(row)
    out = []
    for group, runs in groups.items():
        arm = dict(zip(by, group, strict=True), rounds=len(runs))
        for key in keys:
            values = [r[key] for r in runs if key in r]
            if values:
                arm[key] = statistics.median(values)
                arm[f"{key}_spread"] = max(values) - min(values)
        out.append(arm)
    return out


def nearest_median(runs: list[dict], key: str) -> dict:
    """The run whose `key` is nearest the runs' median (with two runs, the first): a real run to show
    in a table, its other columns consistent with it."""
    median = statistics.median(run[key] for run in runs)
    return min(runs, key=lambda run: abs(run[key] - median))


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    """Rows as a fixed-width table; floats with 3 significant decimals."""
    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))


def write_json(path: str, data: dict) -> None:
    """Write (or rewrite, as results come in) the script's JSON result."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def environment(device: str) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
           "python": sys.version.split()[0]}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def eager_step_kernels(engine: LLMEngine, add_requests, device: str = "cuda") -> list:
    """The CUDA kernels of one eager decode step (graphs off): `add_requests()` queues short greedy
    requests, two steps prefill and settle them, the third is profiled, the rest drain. Returns the
    profiler's per-kernel averages, most device time first."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.graphs = engine.graphs, None
    try:
        add_requests()
        engine.step()
        engine.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync(device)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.graphs = graphs
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sorted(events, key=lambda e: -e.device_time_total)



ATTENTION_KERNELS = ("_attn_kernel", "_merge_kernel", "_item_kernel", "_lone_heads_kernel")  # the Triton attention
# kernels by name (triton_attention.py, triton_prefix_attention.py, triton_prefix_lone.py)


def kernel_trace(run, calls: int) -> list[dict]:
    """The CUDA kernels that `calls` calls of `run()` launch, kernels replayed by CUDA graphs
    included, in start order (torch.profiler's trace events: name, ts and dur in us, args.grid)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def kernel_us(run, calls: int, by_grid: bool = False, trace: list[dict] | None = None) -> dict[str, float]:
    """Device microseconds per call of each CUDA kernel that `calls` calls of `run()` launch (or of
    a `trace` of them), keyed by kernel name (and launch grid with by_grid: two launches of one
    kernel with different grids are told apart). A kernel launched with programmatic dependent
    launch may start before the one ahead of it ends and wait for it: its time includes that wait."""
    totals: dict[str, float] = {}
    for e in kernel_trace(run, calls) if trace is None else trace:
        name = f"{e['name']} grid {e.get('args', {}).get('grid')}" if by_grid else e["name"]
        totals[name] = totals.get(name, 0.0) + e["dur"] / calls
    return totals


def path_us(trace: list[dict], names: tuple[str, ...], calls: int) -> float:
    """Device microseconds per call that runs of consecutive kernels named in `names` add to the
    stream: from the end of the kernel before each run (its start, for a run that opens the trace)
    to the last end in the run. Unlike summed kernel times, this does not count a kernel's wait
    for the one ahead of it (programmatic dependent launch), nor count overlapping kernels twice."""
    total, run_start, run_end, prev_end = 0.0, None, 0.0, None
    for e in trace:
        end = e["ts"] + e["dur"]
        if any(n in e["name"] for n in names):
            if run_start is None:
                run_start = e["ts"] if prev_end is None else prev_end
            run_end = max(run_end, end)
        elif run_start is not None:
            total += run_end - run_start
            run_start, run_end = None, 0.0
        prev_end = end if prev_end is None else max(prev_end, end)
    if run_start is not None:
        total += run_end - run_start
    return total / calls
