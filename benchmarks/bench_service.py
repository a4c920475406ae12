"""Service overhead: tokens/s delivered to a client through gRPC + Arrow, against the same engine
driven in-process. Goal (issue 5): the service keeps at least 0.97 of the in-process rate.

Workload: `--requests` concurrent requests (default 64), one prompt each of `--prompt-len`
random token ids, support masks at top_k 64, temperature 1, `--max-tokens` tokens with EOS
ignored, so both sides produce exactly the same number of tokens. The in-process side runs the
engine's step loop in this process; the service side starts `rollout serve` as a child process
with the same engine settings and sends every request at once from an AsyncRolloutClient here
(decoding each Arrow batch, as a trainer would). Runs alternate after `--warmup` untimed full runs
of each; the table shows the median of `--repeats` per path and the median of the per-repeat
service / in-process ratios (each repeat runs both back to back), then each path's steps, time
per step, the engine thread's CPU time per step and the share of the run spent inside
`engine.step()` (the server's from its `engine_idle` log lines), which tells more steps from
slower steps from time between steps. Also the ratio of the two paths' total times over all
repeats, and the median per repeat of the engine's CPU time per step, service / in-process.
Each repeat's line also says how many CUDA graphs and Triton kernel variants each engine built
during it (a build makes its step slow; the two engines see different batch shapes as the burst
comes in).
Prints the tables, writes JSON (`--out`).

Host noise: on a shared (virtualised) host the same engine's CPU time per step moved by tens of
percent between processes and repeats. With `--pin` (the default where the process may use at
least 3 CPUs) both engines run on one CPU of their own: the in-process engine's thread during its
runs, and the server's engine process (its main thread, which steps the engine); every other
thread of this process and of the server keeps off that CPU. `--no-pin` leaves placement to the OS
(and `--server-args=--engine-thread` is not pinned: its engine thread is not told apart).

A GPU-bound target: `--shape qwen3-8b` (or qwen3-0.6b) runs both paths on random weights of that
shape (`--load-format random`, nothing downloaded) with an untrained one-layer DFlash drafter
saved to a temporary directory; its drafts are almost never accepted, so a step commits about
one token per sequence while the target verifies a whole block. There the step is device time,
as with a real policy, and the host noise above moves the ratio much less.

    python benchmarks/bench_service.py --device cuda --spec dflash --repeats 5
    python benchmarks/bench_service.py --device cuda --shape qwen3-8b --max-tokens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.params import SamplingParams
from rollout.server.process import ServerProcess
from trainer_client import AsyncRolloutClient

TOP_K = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--spec", default="dflash", choices=("none", "dflash", "dspark"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="fixed, so both engines fit side by side (default: every request's whole sequence)")
    p.add_argument("--shape", default=None, choices=("qwen3-0.6b", "qwen3-8b", "tiny"),
                   help="random target weights of this shape and an untrained DFlash drafter (see above; "
                        "tiny: a CPU check of the script)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2, help="untimed full runs of each path first")
    p.add_argument("--server-args", default="", help="extra `rollout serve` arguments, e.g. '--gil-switch-ms 0.5'")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                   help="run both engines on one CPU of their own (default: when 3 or more CPUs are usable)")
    p.add_argument("--server-log", default=None,
                   help="copy the server's JSON log here at the end (with --server-args='--log-level debug' it "
                        "has each request's admission)")
    p.add_argument("--out", default="benchmarks/results/bench_service.json")
    return p.parse_args()


def workload(args: argparse.Namespace, vocab_size: int, seed: int) -> tuple[list[list[int]], dict]:
    """Fresh prompts per run (no prefix-cache hits), the same for both paths of one repeat."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size - 8) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    sampling = dict(temperature=1.0, top_k=TOP_K, max_tokens=args.max_tokens, ignore_eos=True)
    return prompts, sampling


class Pinning:
    """One CPU for the engines (see the module docstring), the others for everything else."""

    def __init__(self):
        cpus = sorted(os.sched_getaffinity(0))
        self.engine_cpu, self.others = {cpus[-1]}, set(cpus[:-1])

    def threads_of(self, pid: int) -> list[int]:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]

    def children_of(self, pid: int) -> list[int]:
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:  # gone meanwhile
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state: the parent's pid
                    out.append(int(entry))
        return out

    def server(self, pid: int) -> None:
        """The server process's threads off the engine CPU, its engine process's main thread on it."""
        for tid in self.threads_of(pid):
            os.sched_setaffinity(tid, self.others)
        engines = [c for c in self.children_of(pid)  # (not multiprocessing's resource tracker)
                   if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
        if not engines:
            raise RuntimeError("no engine process under the server (is it --engine-thread?): run with --no-pin")
        for child in engines:
            for tid in self.threads_of(child):
                os.sched_setaffinity(tid, self.engine_cpu if tid == child else self.others)

    def this_process(self) -> None:
        for tid in self.threads_of(os.getpid()):
            os.sched_setaffinity(tid, self.others)


class pinned_to:
    """`with pinned_to(cpus):` the calling thread runs on `cpus` (None: unchanged), then as before."""

    def __init__(self, cpus: set[int] | None):
        self.cpus = cpus

    def __enter__(self):
        if self.cpus is not None:
            self.before = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cpus)

    def __exit__(self, *exc):
        if self.cpus is not None:
            os.sched_setaffinity(0, self.before)


def run_in_process(engine: LLMEngine, prompts: list[list[int]], sampling: dict, tag: str,
                   cpus: set[int] | None = None) -> tuple[int, float, dict]:
    """Tokens, seconds, and the steps' count and time (as the server's `engine_idle` line has them);
    on `cpus` when given."""
    with pinned_to(cpus):
        return _run_in_process(engine, prompts, sampling, tag)


def _run_in_process(engine: LLMEngine, prompts: list[list[int]], sampling: dict, tag: str,
                    ) -> tuple[int, float, dict]:
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(**sampling, seed=i)
        engine.add_request(f"{tag}-{i}", [prompt], params, n=1, mask="support")
    tokens, steps, step_seconds, cpu, compiled = 0, 0, 0.0, time.thread_time(), engine.compiled()
    while engine.has_unfinished():
        t = time.perf_counter()
        tokens += sum(len(s.token_ids) for s in engine.step())
        steps, step_seconds = steps + 1, step_seconds + time.perf_counter() - t
    stats = dict(steps=steps, step_ms=step_seconds * 1e3, cpu_ms=(time.thread_time() - cpu) * 1e3,
                 **{f"new_{k}": n - compiled[k] for k, n in engine.compiled().items()})
    return tokens, time.perf_counter() - start, stats


def engine_periods(server: ServerProcess, seen: int, timeout: float = 5.0) -> tuple[list[dict], int]:
    """The server's `engine_idle` log lines after the first `seen` of them (waits a little for the
    line of the run that just ended), and the new count."""
    deadline = time.monotonic() + timeout
    while True:
        with open(server.log_path) as f:
            lines = [json.loads(x) for x in f if '"engine_idle"' in x]
        if len(lines) > seen or time.monotonic() > deadline:
            return lines[seen:], len(lines)
        time.sleep(0.01)


async def run_service(address: str, prompts: list[list[int]], sampling: dict) -> tuple[int, float]:
    async with AsyncRolloutClient(address, timeout=3600) as client:
        start = time.perf_counter()
        calls = [client.generate([p], sampling=dict(sampling, seed=i), mask="support") for i, p in enumerate(prompts)]
        tables = await asyncio.gather(*calls)
        seconds = time.perf_counter() - start
    return sum(sum(len(t) for t in table.column("token_ids").to_pylist()) for table in tables), seconds


def serve_args(args: argparse.Namespace) -> list[str]:
    out = ["--spec", args.spec, "--device", args.device, "--num-kv-blocks", str(args.num_kv_blocks)]
    out += ["--max-mask-tokens", str(TOP_K), "--load-format", load_format(args)] + args.server_args.split()
    return out + (["--model", args.model] if args.model else []) + (["--draft", args.draft] if args.draft else [])


def load_format(args: argparse.Namespace) -> str:
    return "random" if args.shape else "safetensors"


def random_shape(args: argparse.Namespace, root: Path) -> None:
    """`--shape`: a config-only target directory (random weights at load) and an untrained DFlash
    drafter for it, both under `root`; points args.model / args.draft there (spec dflash)."""
    from common import random_target_and_drafter

    args.model, args.draft = random_target_and_drafter(args.shape, args.device, root)
    args.spec = "dflash"


def main() -> None:
    args = parse_args()
    if args.num_kv_blocks is None:
        args.num_kv_blocks = args.requests * (-(-(args.prompt_len + args.max_tokens + 16) // 16) + 1) + 64
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            random_shape(args, Path(tmp))
        bench(args)


def bench(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, draft=args.draft, spec=args.spec, device=args.device,
                          num_kv_blocks=args.num_kv_blocks, max_mask_tokens=TOP_K, load_format=load_format(args))
    engine = build_engine(config)
    paths = ("in_process", "service")
    rates: dict[str, list[float]] = {p: [] for p in paths}
    steps: dict[str, list[dict]] = {p: [] for p in paths}
    pin = args.pin if args.pin is not None else len(os.sched_getaffinity(0)) >= 3
    args.pin = pin
    pinning = Pinning() if pin else None
    engine_cpu = pinning.engine_cpu if pin else None
    with ServerProcess(serve_args(args)) as server:
        if pin:
            pinning.server(server.proc.pid)
            pinning.this_process()
            print(f"engines pinned to CPU {sorted(pinning.engine_cpu)}, everything else to {sorted(pinning.others)}")
        for w in range(args.warmup):  # first runs pay for lazy initialisation and allocator growth
            prompts, sampling = workload(args, engine.vocab_size, seed=1000 + w)
            run_in_process(engine, prompts, sampling, f"warm{w}", engine_cpu)
            asyncio.run(run_service(server.address, prompts, sampling))
        _, seen = engine_periods(server, 0)
        for r in range(args.repeats):
            prompts, sampling = workload(args, engine.vocab_size, seed=r)
            for path in paths[::-1] if r % 2 else paths:  # alternate the order
                if path == "in_process":
                    tokens, seconds, stats = run_in_process(engine, prompts, sampling, f"r{r}", engine_cpu)
                else:
                    tokens, seconds = asyncio.run(run_service(server.address, prompts, sampling))
                    periods, seen = engine_periods(server, seen)
                    stats = {k: sum(p[k] for p in periods)
                             for k in ("steps", "step_ms", "busy_ms", "cpu_ms", "new_graphs", "new_kernels")}
                    # admission of the burst: when its last request came in and the first step began
                    stats.update({k: periods[0].get(k, 0.0) for k in ("last_admitted_ms", "first_step_ms")})
                assert tokens == args.requests * args.max_tokens, (path, tokens)
                rates[path].append(tokens / seconds)
                steps[path].append(dict(stats, seconds=seconds))
            last = {k: round(v[-1]) for k, v in rates.items()}
            ins, svc = steps["in_process"][-1], steps["service"][-1]
            print(f"repeat {r}: tok/s in-process {last['in_process']}, service "
                  f"{last['service']}; in-process / service: steps {ins['steps']} / {svc['steps']}, step ms "
                  f"{ins['step_ms']:.0f} / {svc['step_ms']:.0f}, engine cpu ms {ins['cpu_ms']:.0f} / "
                  f"{svc['cpu_ms']:.0f}, graphs captured {ins['new_graphs']} / {svc['new_graphs']}, Triton kernels "
                  f"compiled {ins['new_kernels']} / {svc['new_kernels']}; service: last "
                  f"request in at {svc['last_admitted_ms']:.1f} ms, first step at {svc['first_step_ms']:.1f} ms",
                  flush=True)
        if args.server_log:
            Path(args.server_log).write_bytes(Path(server.log_path).read_bytes())
    report(args, rates, tokens, steps)


def report(args: argparse.Namespace, rates: dict[str, list[float]], tokens: int, steps: dict) -> None:
    median = {k: statistics.median(v) for k, v in rates.items()}
    # each repeat runs both paths back to back: the median of the per-repeat ratios cancels the
    # drift between repeats that a ratio of the two medians keeps
    pair_ratios = [s / i for s, i in zip(rates["service"], rates["in_process"], strict=True)]
    ratio = statistics.median(pair_ratios)
    total = {p: sum(r["seconds"] for r in steps[p]) for p in steps}
    total_ratio = total["in_process"] / total["service"]  # the same tokens on both paths
    cpu_ratios = [s["cpu_ms"] / s["steps"] / (i["cpu_ms"] / i["steps"])
                  for s, i in zip(steps["service"], steps["in_process"], strict=True)]
    model = f"{args.shape} random + untrained dflash" if args.shape else "embedded"
    print(f"\n{args.requests} requests x {args.max_tokens} tokens, support masks top_k {TOP_K}, "
          f"{model}, spec {args.spec}, {args.device}; median of {args.repeats}")  # fmt: skip
    print(f"{'path':<12} {'tokens/s':>10}")
    for name, value in median.items():
        print(f"{name:<12} {value:>10.0f}")
    print(f"{'ratio':<12} {ratio:>10.3f}   (median of the per-repeat ratios "
          f"{', '.join(f'{r:.3f}' for r in pair_ratios)}; goal >= 0.97)")
    print(f"{'total ratio':<12} {total_ratio:>10.3f}   (all repeats' in-process time / service time)")
    print(f"{'cpu ratio':<12} {statistics.median(cpu_ratios):>10.3f}   (median per repeat of the engine thread's "
          f"CPU per step, service / in-process)")
    # where the service's time goes: more steps, slower steps, or time outside the steps
    print(f"{'path':<12} {'steps':>7} {'ms/step':>8} {'cpu/step':>8} {'in steps':>9}   (medians over repeats; "
          f"cpu = the engine thread's CPU time; 'in steps' = time inside engine.step() / run time)")
    for name in ("in_process", "service"):
        runs = steps[name]
        print(f"{name:<12} {statistics.median(r['steps'] for r in runs):>7.0f} "
              f"{statistics.median(r['step_ms'] / max(r['steps'], 1) for r in runs):>8.3f} "
              f"{statistics.median(r['cpu_ms'] / max(r['steps'], 1) for r in runs):>8.3f} "
              f"{statistics.median(r['step_ms'] / 1e3 / r['seconds'] for r in runs):>9.3f}")
    svc = steps["service"]
    print(f"service admission (medians): last request in at "
          f"{statistics.median(r['last_admitted_ms'] for r in svc):.1f} ms, first step at "
          f"{statistics.median(r['first_step_ms'] for r in svc):.1f} ms after the engine left idle")
    result = dict(vars(args), tokens_per_run=tokens, tokens_per_s=rates, median_tokens_per_s=median, ratio=ratio,
                  pair_ratios=pair_ratios, ratio_of_medians=median["service"] / median["in_process"], steps=steps,
                  total_ratio=total_ratio, cpu_ratios=cpu_ratios)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
