"""RL-scale rollouts (issue 14): a GRPO-shaped workload on Qwen3-8B-shaped random bf16 weights, in
process (LLMEngine) and through the service (`rollout serve --load-format random` +
RolloutClient.generate) in one run, against the memory-bound limit of the same steps.

Cases (`--cases`, all by default): a = 32 prompts x n=8, 1024 random prompt tokens, 512 output
tokens, EOS ignored, temperature 1, no masks, top_p 1; b = a with support masks, top_k 64, top_p
0.95; c = a with DFlash (an untrained one-layer drafter, block `--draft-block`: what speculation
costs when it does not pay); d = a at 16 prompts x n=8, prompt 4096, output 1024; e = 16 prompts x
n=16, prompt 4096, output 512 (issue 24's second shape). Each path builds one engine per drafter
setting (a, b, d, e share one) and attention setting (`--attention shared plain`: shared-prefix
attention on and off, side by side in one run), warms it up on a short run, then runs its cases;
the two paths never hold the GPU at the same time.

Reported per case and path: output tokens/s, steps, mean step ms, peak GPU memory (in process:
torch's peak allocated; service: the device's used memory after the run), the KV pool, and the
fraction of the memory-bound limit: per step the larger of (weight bytes + bytes of every running
sequence's KV) / copy bandwidth and the step's matmul FLOPs / bf16 matmul rate (both measured at
the start), summed over the steps the run took; `fraction_unique` counts a group's shared prompt
blocks once a step (the bytes a kernel that reads shared blocks once must move: weights + distinct
KV). Steps are recorded by a light hook on build_step
(its items' token counts and context lengths; a few integer sums per item). The service path uses
the in-process limit of the same case (its steps are not visible from here). `--engine-arg
key=value` passes EngineConfig fields to both paths (e.g. max_num_batched_tokens=8192), so
settings can be compared side by side. `--rounds N` runs the attention settings N times, in reverse
order every other round (runs of the same code differ by a few percent between engines), and adds
each measure's median over the rounds and the ratio of the medians (shared / plain). An attention
setting `shared:NAME` builds its engine with the decode launch NAME of prefix_variants.VARIANTS (in
process only), beside the others. `--process-per-arm` runs each round's settings in fresh processes
of their own (as a server builds one engine) instead of one after another in this one. Profiled rows
carry the GPU's SM clock and temperature right after the profiled steps (nvidia-smi).

    python benchmarks/bench_rl.py --device cuda                        # all cases, ~8 min on an H200
    python benchmarks/bench_rl.py --device cuda --cases a b --paths in_process
    python benchmarks/bench_rl.py --device cpu --quick                 # a tiny shape: checks the script
    python benchmarks/bench_rl.py --device cuda --cases a --paths in_process --attention shared plain \
        --profile-steps 16 --profile-after 76 --rounds 3             # issue 24's goal step, 3 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import torch
from bench_service import engine_periods
from common import (
    SHAPES,
    arm_medians,
    copy_bandwidth,
    environment,
    free_memory,
    matmul_rate,
    print_table,
    sync,
    write_config_dir,
    write_json,
)
from prefix_variants import VARIANTS, launch_names, use_prefix_launch
from rl_measures import Costs, StepLog, profile_attention

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.loader import load_model
from rollout.engine.params import SamplingParams
from rollout.server.process import ServerProcess
from rollout.spec.draft_loader import random_drafter, save_drafter
from trainer_client import RolloutClient

PLAIN = dict(temperature=1.0, top_p=1.0)
CASES = {
    "a": dict(prompts=32, n=8, prompt_len=1024, output_len=512, sampling=PLAIN, mask=None, spec=False),
    "b": dict(prompts=32, n=8, prompt_len=1024, output_len=512, sampling=dict(temperature=1.0, top_k=64, top_p=0.95),
              mask="support", spec=False),
    "c": dict(prompts=32, n=8, prompt_len=1024, output_len=512, sampling=PLAIN, mask=None, spec=True),
    "d": dict(prompts=16, n=8, prompt_len=4096, output_len=1024, sampling=PLAIN, mask=None, spec=False),
    "e": dict(prompts=16, n=16, prompt_len=4096, output_len=512, sampling=PLAIN, mask=None, spec=False),
}
QUICK = dict(prompts=4, n=2, prompt_len=32, output_len=16)  # --quick: every case this small (d: x2 lengths)
PATHS = ("in_process", "service")
ATTENTION = ("shared", "plain")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny shape and workloads (a CPU check of the script)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--attention", nargs="+", default=["shared"], type=attention_arm,
                   help="shared-prefix attention on (shared) and / or off (plain), or on with a decode launch of "
                        "prefix_variants.VARIANTS (shared:NAME, in process only): one engine each, side by side")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the attention settings this many times, alternating their order; report medians")
    p.add_argument("--draft-block", type=int, default=8, help="the untrained DFlash drafter's block (case c)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for both paths, e.g. max_num_batched_tokens=8192 (repeatable)")
    p.add_argument("--warmup-tokens", type=int, default=32, help="output tokens of each engine's warm-up run")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after each in-process case, run it again and profile this many steps from the middle of "
                        "its decode (torch.profiler): attention kernels' device ms per step (0 off CUDA)")
    p.add_argument("--profile-after", type=int, default=0,
                   help="generated tokens (the fewest of any running sample) before the profiled steps (0: half "
                        "the output length)")
    p.add_argument("--prefix-launch", metavar="DECODE[,VERIFY]",
                   help="shared-prefix attention's launch: variants of prefix_variants.VARIANTS (or "
                        "'default') for decode and verify steps (one name: both)")
    p.add_argument("--process-per-arm", action="store_true",
                   help="run each round's attention settings in a fresh process each (as a server builds one "
                        "engine), not one after another in this one")
    p.add_argument("--out", default="benchmarks/results/bench_rl.json")
    args = p.parse_args()
    args.engine_args = dict(_key_value(kv) for kv in args.engine_arg)
    if "service" in args.paths and any(":" in arm for arm in args.attention):
        p.error("--attention shared:NAME runs in process only (the server builds its engine with the defaults)")
    if args.quick:
        args.shape, args.draft_block, args.warmup_tokens = "tiny", 4, 4
    return args


def attention_arm(text: str) -> str:
    """An --attention value: shared, plain, or shared:NAME (NAME a variant of prefix_variants.VARIANTS)."""
    kind, _, variant = text.partition(":")
    if kind not in ATTENTION or (variant and (kind != "shared" or variant not in VARIANTS)):
        raise argparse.ArgumentTypeError(f"{text!r}: want shared, plain or shared:NAME with NAME one of "
                                         f"{', '.join(VARIANTS)}")
    return text


def arm_launch(args, attention: str) -> str | None:
    """The --prefix-launch names an arm's engine is built with: its own decode variant (shared:NAME)
    beside --prefix-launch's verify one, else --prefix-launch's."""
    variant = attention.partition(":")[2]
    if not variant:
        return args.prefix_launch
    return f"{variant},{launch_names(args.prefix_launch)[1]}"


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or key not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise SystemExit(f"--engine-arg {text!r}: want KEY=VALUE with KEY an EngineConfig field")
    for parse in (int, float):
        try:
            return key, parse(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False, "none": None}.get(value.lower(), value)


def case_workload(name: str, quick: bool) -> dict:
    case = dict(CASES[name])
    if quick:
        scale = 2 if name in ("d", "e") else 1
        case.update(QUICK, prompt_len=QUICK["prompt_len"] * scale, output_len=QUICK["output_len"] * scale)
    return case


def prompts_of(case: dict, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size - 8) for _ in range(case["prompt_len"])] for _ in range(case["prompts"])]


def sampling_of(case: dict, output_len: int | None = None) -> dict:
    return dict(case["sampling"], max_tokens=output_len or case["output_len"], ignore_eos=True, seed=0)


def run_in_process(engine: LLMEngine, case: dict, prompts, tag: str, device: str) -> tuple[dict, list]:
    params = SamplingParams(**sampling_of(case))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    start, steps, step_seconds, tokens = time.perf_counter(), 0, 0.0, 0
    with StepLog(engine.config.block_size) as log:
        engine.add_request(tag, prompts, params, n=case["n"], mask=case["mask"])
        while engine.has_unfinished():
            t = time.perf_counter()
            tokens += sum(len(o.token_ids) for o in engine.step())
            steps, step_seconds = steps + 1, step_seconds + time.perf_counter() - t
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    plan = engine.memory_plan
    planned = {} if plan is None else dict(plan_held_gb=plan.held / 1e9, plan_step_gb=plan.step / 1e9,
                                           plan_graphs_gb=plan.graphs / 1e9, plan_step_setting=plan.step_setting)
    return dict(tokens=tokens, seconds=seconds, steps=steps, step_ms=step_seconds * 1e3 / steps,
                peak_gb=peak, compiled=engine.compiled(), **planned), log.records


def run_service(server: ServerProcess, seen: int, case: dict, prompts, device: str) -> tuple[dict, int]:
    with RolloutClient(server.address, timeout=3600) as client:
        start = time.perf_counter()
        table = client.generate(prompts, n=case["n"], sampling=sampling_of(case), mask=case["mask"])
        seconds = time.perf_counter() - start
    periods, seen = engine_periods(server, seen)
    steps = sum(p["steps"] for p in periods)
    used = None
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 1e9
    tokens = pc.sum(pc.list_value_length(table.column("token_ids"))).as_py()
    return dict(tokens=tokens, seconds=seconds, steps=steps, arrow_mb=table.nbytes / 1e6,
                step_ms=sum(p["step_ms"] for p in periods) / max(steps, 1), peak_gb=used), seen


def engine_config(args, dirs: dict, spec: bool, attention: str) -> dict:
    """EngineConfig fields of one drafter and attention setting (both paths)."""
    fields = dict(model=dirs["model"], load_format="random", device=args.device, **args.engine_args)
    if len(args.attention) > 1 or attention != "shared":
        fields["shared_prefix_attention"] = attention != "plain"
    if spec:
        fields.update(spec="dflash", draft=dirs["draft"], spec_block_size=args.draft_block)
    return fields


def serve_flags(fields: dict) -> list[str]:
    """`rollout serve` flags for EngineConfig fields, from the CLI's own parser (so new flags work)."""
    from rollout.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = []
    for key, value in fields.items():
        action = next(a for a in serve._actions if a.dest == key)
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            flags += [action.option_strings[0]] if value != action.default else []
        else:
            flags += [action.option_strings[0], str(value)]
    return flags


def bench_group(args, dirs: dict, spec: bool, attention: str, cases: list[str], rows: list[dict],
                result: dict, round_: int = 0) -> None:
    """One drafter and attention setting: the in-process engine's cases, then the server's (each
    after a warm-up run of the first case's workload, `--warmup-tokens` long, on other prompts);
    its rows tagged with `round_`."""
    fields = engine_config(args, dirs, spec, attention)
    use_prefix_launch(arm_launch(args, attention))
    workloads = {name: case_workload(name, args.quick) for name in cases}
    warmup = dict(workloads[cases[0]], output_len=args.warmup_tokens)
    vocab, limits = SHAPES[args.shape]["vocab_size"], {}
    if "in_process" in args.paths:
        engine = build_engine(EngineConfig(**fields))
        costs = Costs.of(engine)
        run_in_process(engine, warmup, prompts_of(warmup, vocab, 99), "warmup", args.device)
        for name, case in workloads.items():
            row, records = run_in_process(engine, case, prompts_of(case, vocab, 1), name, args.device)
            limits[name] = tuple(sum(costs.step_seconds(r, result["bandwidth"], result["matmul_rate"], unique)
                                     for r in records) for unique in (False, True))
            if args.profile_steps:
                row.update(profile_attention(engine, case, prompts_of(case, vocab, 1),
                                             SamplingParams(**sampling_of(case)), args.profile_steps,
                                             args.device, args.profile_after))
            rows.append(summary(name, "in_process", attention, case, dict(row, round=round_), limits[name],
                                engine.kv_blocks()[1]))
            report(rows, result, args)
        del engine
        free_memory()
    if "service" in args.paths:
        with ServerProcess(serve_flags(fields)) as server:
            _, seen = run_service(server, 0, warmup, prompts_of(warmup, vocab, 99), args.device)
            for name, case in workloads.items():
                row, seen = run_service(server, seen, case, prompts_of(case, vocab, 1), args.device)
                rows.append(summary(name, "service", attention, case, dict(row, round=round_), limits.get(name),
                                    None))
                report(rows, result, args)


def summary(name: str, path: str, attention: str, case: dict, run: dict, limits: tuple | None,
            kv_blocks: int | None) -> dict:
    """limits: the in-process run's (memory-bound limit, unique-bytes limit) in seconds."""
    row = dict(case=name, path=path, attention=attention, prompts=case["prompts"], n=case["n"],
               prompt_len=case["prompt_len"],
               output_len=case["output_len"], mask=case["mask"] or "-", spec="dflash" if case["spec"] else "-",
               tokens_per_s=run["tokens"] / run["seconds"], kv_blocks=kv_blocks, **run)
    if limits is not None:
        row.update(limit_s=limits[0], fraction=limits[0] / run["seconds"], unique_limit_s=limits[1],
                   fraction_unique=limits[1] / run["seconds"])
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return row


def report(rows: list[dict], result: dict, args) -> None:
    for row in rows:
        same = [r for r in rows if r["case"] == row["case"]]
        ins = next((r for r in same if r["path"] == "in_process" and r["attention"] == row["attention"]), None)
        if row["path"] == "service" and ins is not None:
            row["service_over_in_process"] = row["tokens_per_s"] / ins["tokens_per_s"]
        plains = [r for r in same if r["path"] == row["path"] and r["attention"] == "plain"]
        plain = next((r for r in plains if r["round"] == row["round"]), plains[0] if plains else None)
        if plain is not None:
            row["over_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
    result["rows"] = rows
    if args.rounds > 1:
        result["medians"] = medians(rows)
    write_json(args.out, result)


MEDIAN_KEYS = ("tokens_per_s", "step_ms", "attention_ms", "attention_path_ms")


def medians(rows: list[dict]) -> list[dict]:
    """Per case, path and attention setting: each measure's median over the rounds, its spread, and
    the ratios of the medians to plain's."""
    out = arm_medians(rows, ("case", "path", "attention"), MEDIAN_KEYS)
    for arm in out:
        plain = next((a for a in out if a["case"] == arm["case"] and a["path"] == arm["path"]
                      and a["attention"] == "plain"), None)
        if plain is not None and arm.get("attention_path_ms") and plain.get("attention_path_ms"):  # (0 off CUDA)
            arm["path_over_plain"] = arm["attention_path_ms"] / plain["attention_path_ms"]
        if plain is not None:
            arm["over_plain"] = arm["tokens_per_s"] / plain["tokens_per_s"]
    return out


def make_dirs(args, root: Path) -> dict:
    """A config-only target (random weights at load) and an untrained DFlash drafter saved for it."""
    dirs = dict(model=str(write_config_dir(SHAPES[args.shape], root / "target")))
    if any(CASES[c]["spec"] for c in args.cases):
        target = load_model(dirs["model"], torch.device(args.device), load_format="random")
        save_drafter(random_drafter(target, "dflash", block_size=args.draft_block, num_layers=1, seed=1),
                     root / "dflash")
        dirs["draft"] = str(root / "dflash")
        del target
        free_memory()
    return dirs


def arms_in_turn(args, result: dict) -> list[dict]:
    """Each round's attention settings one after another in this process (an engine each)."""
    result["env"] = environment(args.device)
    bandwidth = copy_bandwidth(args.device, (64 << 20) if args.quick else (4 << 30))
    rate = matmul_rate(args.device)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, matmul {rate / 1e12:.1f} TFLOP/s", flush=True)
    result.update(bandwidth=bandwidth, matmul_rate=rate)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_dirs(args, Path(tmp))
        for spec in (False, True):
            cases = [c for c in args.cases if CASES[c]["spec"] == spec]
            for round_ in range(args.rounds if cases else 0):
                for attention in args.attention[::-1] if round_ % 2 else args.attention:
                    bench_group(args, dirs, spec, attention, cases, rows, result, round_)
    return rows


def arms_apart(args, result: dict) -> list[dict]:
    """--process-per-arm: each round's attention settings in turn, each in a fresh process (this script
    with that one setting and one round); their rows tagged with the round, and the environment, copy
    bandwidth and matmul rate the first one measured. This process never touches the GPU: a CUDA
    context here would take memory from every child's engine."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for attention in args.attention[::-1] if round_ % 2 else args.attention:
                out = Path(tmp) / f"round{round_}.json"
                subprocess.run(child_argv(args, attention, out), check=True)
                child = json.loads(out.read_text())
                for key in ("env", "bandwidth", "matmul_rate"):
                    result.setdefault(key, child[key])
                rows += [dict(row, round=round_) for row in child["rows"]]
                report(rows, result, args)
    return rows


def child_argv(args, attention: str, out: Path) -> list[str]:
    """This script's command line for one attention setting and one round of `args`."""
    argv = [sys.executable, __file__, "--device", args.device, "--cases", *args.cases, "--paths", *args.paths,
            "--shape", args.shape, "--attention", attention, "--draft-block", str(args.draft_block),
            "--warmup-tokens", str(args.warmup_tokens), "--profile-steps", str(args.profile_steps),
            "--profile-after", str(args.profile_after), "--out", str(out)]
    argv += [flag for kv in args.engine_arg for flag in ("--engine-arg", kv)]
    argv += ["--prefix-launch", args.prefix_launch] if args.prefix_launch else []
    return argv + (["--quick"] if args.quick else [])


def main() -> None:
    args = parse_args()
    result = dict(args=vars(args), rows=[])
    start = time.perf_counter()
    if args.process_per_arm:
        rows = arms_apart(args, result)
    else:
        rows = arms_in_turn(args, result)
    result["seconds"] = time.perf_counter() - start
    columns = ["case", "path", "attention", "round", "spec", "mask", "prompts", "n", "prompt_len", "output_len",
               "tokens_per_s", "over_plain", "steps", "step_ms", "attention_ms", "attention_path_ms", "kernels_ms",
               "profiled_context", "profiled_sm_mhz", "profiled_temp_c", "peak_gb", "plan_step_gb", "plan_graphs_gb",
               "kv_blocks", "limit_s", "fraction", "fraction_unique", "service_over_in_process"]
    print_table(f"RL rollouts, {args.shape} random weights, {args.device}, engine args {args.engine_args or '-'} "
                f"(fraction = memory-bound limit / run time; service: in-process limit)", rows, columns)
    report(rows, result, args)
    if args.rounds > 1:
        print_table(f"medians over {args.rounds} rounds (ratios: of the medians, to plain's)", result["medians"],
                    ["case", "path", "attention", "rounds", *MEDIAN_KEYS, "attention_path_ms_spread",
                     "path_over_plain", "over_plain"])
    print(f"wrote {args.out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
