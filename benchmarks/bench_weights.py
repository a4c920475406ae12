"""Weight sync benchmark (issue 15): how fast a trainer's new policy reaches a `rollout serve`.

A random state dict (bfloat16 by default) of a model shape (HF names, the shape's tensors) is pushed to a
server that holds random weights of the same shape (`--load-format random`, nothing downloaded):

  grpc_state_dict   client.update_weights(state_dict): UpdateWeights over loopback gRPC
  grpc_safetensors  client.update_weights(directory): the same state dict as safetensors files
  same_host         client.update_weights_shared(state_dict): CUDA IPC handles (a cuda state dict)
                    or one /dev/shm file (a CPU one), nothing through gRPC but the handles
  broadcast         BroadcastGroup([server]).update_weights(state_dict): this process is rank 0 of a
                    weight group with the server; --broadcast gloo (through host memory), or nccl
                    (needs 2 GPUs: the server gets the first, this process uses cuda:1)
  (with --keep-weight-buffers too: the server keeps the upload's host memory between updates)

Per path: seconds from the call to the new version serving, GB/s (update bytes / seconds), the
server's staging seconds (after the transfer, checks included) and its pause (no step ran).
The state dict lives on --source-device (a trainer's tensors: cuda on the GPU run).

Release / resume (`client.release_memory(weights=True)`, `resume_memory()`): the device memory the
server held that it gave back (mem_get_info seen from here; on CPU the server's KV bytes), the
seconds of each, and from the resume call to the first token of a one-token request.

The pause while a rollout runs (--rollout-samples samples of --rollout-tokens tokens): the
update is sent once the rollout has started; the engine drains it on the old weights, then swaps.

  sequential       no overlap: the rollout finishes, then the update is sent (the engine idles
                   for the whole update: pause = its seconds)
  staged_host      sent during the rollout, staged in host memory: the pause is one host-to-device
                   copy per tensor (--weight-staging host)
  staged_device    sent during the rollout, staged in spare device memory: the pause is a device
                   copy (--weight-staging device; on CPU the same as host)

    python benchmarks/bench_weights.py --quick                                   # CPU check (tiny shape)
    python benchmarks/bench_weights.py --shape qwen3-0.6b --layers 8 --rollout-samples 16 \
        --rollout-tokens 32                                                      # CPU, 0.87 GB update
    python benchmarks/bench_weights.py --device cuda --source-device cuda --shape qwen3-8b   # one H200
    python benchmarks/bench_weights.py --device cuda --shape qwen3-8b --sections memory    # release / resume only
    python benchmarks/bench_weights.py --device cuda --source-device cuda --shape qwen3-8b --sections transfer \
        --paths grpc_state_dict --buffers kept --repeats 2                       # the gRPC state dict rows only
(gRPC rows: one call and four parallel calls of an update, `--streams 1,4`, each to the server's
weight port and to its main port, `--ports weight,main`.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, environment, nearest_median, print_table, write_config_dir, write_json  # noqa: E402

from rollout.engine.model import ModelConfig, TransformerLM  # noqa: E402
from rollout.engine.weight_specs import model_specs  # noqa: E402
from rollout.server.process import ServerProcess  # noqa: E402
from trainer_client import RolloutClient  # noqa: E402
from trainer_client.broadcast import BroadcastGroup  # noqa: E402

COLUMNS = ["path", "buffers", "port", "streams", "gb", "seconds", "gb_per_s", "stage_s", "pause_s", "version"]
ROLLOUT_MODES = ("sequential", "staged_host", "staged_device")
PATHS = ("grpc_state_dict", "grpc_safetensors", "same_host", "broadcast")  # the transfer section's rows
SECTIONS = ("transfer", "rollout", "memory")  # the gRPC / same-host / broadcast rows, the pause, release / resume
MEMORY_COLUMNS = ["weights", "held_gb", "freed_gb", "free_fraction", "release_s", "resume_s", "resume_to_first_token_s"]
ROLLOUT_COLUMNS = ["mode", "rollout_s", "update_s", "pause_s", "stage_s", "old_version_samples", "samples"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the server's device")
    p.add_argument("--source-device", default="cpu", choices=("cpu", "cuda"), help="where the state dict lives")
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the shape's number of layers (smaller runs)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="of the state dict (a CPU server holds float32 weights: bfloat16 is cast on the way)")
    p.add_argument("--quick", action="store_true", help="tiny shape, one repeat: a CPU check of the script")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--broadcast", default="gloo", choices=("gloo", "nccl", "none"))
    p.add_argument("--rollout-samples", type=int, default=256)
    p.add_argument("--rollout-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--server-args", default="", help="more `rollout serve` arguments")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_weights_<device>.json)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {','.join(SECTIONS)}: the parts to run (e.g. memory alone)")
    p.add_argument("--paths", default=",".join(PATHS),
                   help=f"comma-separated, of {','.join(PATHS)}: the transfer section's paths (e.g. grpc_state_dict)")
    p.add_argument("--buffers", default="given back,kept", help="comma-separated: the gRPC upload buffers to run")
    p.add_argument("--streams", default="1,4", help="comma-separated: parallel calls of a gRPC update to run")
    p.add_argument("--ports", default="weight,main", help="comma-separated: the server's port gRPC updates go to "
                   "(weight: its thread-pool weight port, main: the asyncio one)")
    args = p.parse_args()
    args.paths, args.buffers = args.paths.split(","), args.buffers.split(",")
    args.streams = [int(n) for n in args.streams.split(",")]
    args.ports = args.ports.split(",")
    if unknown := set(args.paths) - set(PATHS):
        p.error(f"--paths: unknown {sorted(unknown)}, expected some of {list(PATHS)}")
    if unknown := set(args.buffers) - {"given back", "kept"}:
        p.error(f"--buffers: unknown {sorted(unknown)}, expected 'given back' and/or 'kept'")
    if args.quick:
        args.shape, args.repeats, args.rollout_samples, args.rollout_tokens = "tiny", 1, 16, 32
    args.model_shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    args.out = args.out or str(Path(__file__).parent / "results" / f"bench_weights_{args.device}.json")
    args.sections = [s for s in args.sections.split(",") if s]
    if unknown := set(args.sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(unknown)}, expected some of {list(SECTIONS)}")
    return args


def random_state(shape: dict, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A random state dict with the shape's checkpoint names and shapes (a tied lm_head equal to
    the embedding, as a tied model's state_dict() has it)."""
    with torch.device("meta"):
        specs = model_specs(TransformerLM(ModelConfig.from_hf(shape)))
    gen = torch.Generator(device).manual_seed(0)
    state = {}
    for key, spec in specs.items():
        name = key if key.startswith("lm_head.") else f"model.{key}"
        if spec.alias_of is None:
            state[name] = torch.randn(spec.shape, generator=gen, device=device, dtype=dtype) * 0.02
    for key, spec in specs.items():
        if spec.alias_of is not None:
            state[key] = state[f"model.{spec.alias_of}"]
    return state


def scratch_dir(args: argparse.Namespace) -> str | None:
    """Where the safetensors copy of the state dict goes: /dev/shm when it has room (memory, like a
    trainer's fresh checkpoint in the page cache), else the system's temporary directory."""
    with torch.device("meta"):
        params = sum(p.numel() for p in TransformerLM(ModelConfig.from_hf(args.model_shape)).parameters())
    room = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    return "/dev/shm" if room > 3 * params * torch.finfo(getattr(torch, args.dtype)).bits // 8 else None


def timed_update(client: RolloutClient, weights, nbytes: int, path: str, buffers: str, streams: int = 1,
                 port: str = "-") -> dict:  # fmt: skip
    start = time.perf_counter()
    if path == "same_host":
        version = client.update_weights_shared(weights)
    else:
        version = client.update_weights(weights, streams=streams)
    seconds = time.perf_counter() - start
    reply = client.last_update
    return dict(path=path, buffers=buffers, port=port, streams=streams, gb=nbytes / 1e9, seconds=seconds,
                gb_per_s=nbytes / 1e9 / seconds, stage_s=reply["stage_seconds"], pause_s=reply["pause_seconds"],
                version=version)


def grpc_rows(args: argparse.Namespace, model_dir: Path, state: dict, files: Path, keep: bool) -> list[dict]:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffers = "kept" if keep else "given back"
    serve = serve_args(args, model_dir, *(["--keep-weight-buffers"] if keep else []))
    rows = []
    with server_process(args, serve) as server, contextlib.ExitStack() as clients:
        by_port = {port: clients.enter_context(RolloutClient(server.address, timeout=3600,
                                                             use_weight_port=port == "weight"))
                   for port in args.ports}  # fmt: skip
        client = by_port[args.ports[0]]
        for r in range(args.repeats):
            first = len(rows)
            for path, weights in (("grpc_state_dict", state), ("grpc_safetensors", files)):
                if path in args.paths:
                    rows += [timed_update(by_port[port], weights, nbytes, path, buffers, n, port)
                             for n in args.streams for port in args.ports]  # fmt: skip
            if keep:  # (no upload buffers on these paths)
                rows += [timed_update(client, state, nbytes, "same_host", "-")] if "same_host" in args.paths else []
                if "broadcast" in args.paths and args.broadcast != "none":
                    rows.append(broadcast_row(args, server.address, state, nbytes))
            print_table(f"repeat {r}", rows[first:], COLUMNS)
    return rows


def broadcast_row(args: argparse.Namespace, address: str, state: dict, nbytes: int) -> dict:
    device = torch.device("cuda", 1) if args.broadcast == "nccl" else None
    sources = {k: v.to(device) for k, v in state.items()} if device is not None else state
    with BroadcastGroup([address], backend=args.broadcast, device=device) as group:
        start = time.perf_counter()
        (version,) = group.update_weights(sources)
        seconds = time.perf_counter() - start
    return dict(path="broadcast", buffers=args.broadcast, gb=nbytes / 1e9, seconds=seconds,
                gb_per_s=nbytes / 1e9 / seconds, version=version)


def device_free(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if device == "cuda" else 0


def memory_rows(args: argparse.Namespace, model_dir: Path) -> list[dict]:
    """Release (without and with the weights) and resume, each followed by a one-token request."""
    rows, free_before = [], device_free(args.device)
    with server_process(args, serve_args(args, model_dir)) as server:
        with RolloutClient(server.address, timeout=3600) as client:
            client.generate([[1, 2, 3]], sampling=dict(max_tokens=4))  # warm (graphs captured)
            free_serving = device_free(args.device)
            for weights in (False, True):
                released = client.release_memory(weights=weights)
                free_released = device_free(args.device)
                start = time.perf_counter()
                resumed = client.resume_memory()
                client.generate([[1, 2, 3]], sampling=dict(max_tokens=1))
                held = free_before - free_serving
                rows.append(dict(weights=weights, held_gb=held / 1e9, freed_gb=released["bytes"] / 1e9,
                                 free_fraction=(free_released - free_serving) / held if held else None,
                                 release_s=released["seconds"], resume_s=resumed["seconds"],
                                 resume_to_first_token_s=time.perf_counter() - start))
    return rows


@contextlib.contextmanager
def server_process(args: argparse.Namespace, serve: list[str]):
    """A running `rollout serve`, stopped on leaving; with --broadcast nccl it sees the first GPU
    only (this process takes cuda:1: NCCL needs the two ranks on different GPUs)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.broadcast == "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        server = ServerProcess(serve, startup_timeout=900).start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    try:
        yield server
    finally:
        server.stop()


def serve_args(args: argparse.Namespace, model_dir: Path, *extra: str) -> list[str]:
    blocks = args.rollout_samples * (-(-(args.prompt_len + args.rollout_tokens) // 16) + 1) + 64
    out = ["--model", str(model_dir), "--load-format", "random", "--device", args.device]
    return out + ["--num-kv-blocks", str(blocks), *extra, *args.server_args.split()]


def start_rollout(client: RolloutClient, args: argparse.Namespace, vocab: int) -> tuple[threading.Thread, dict]:
    """The rollout on a thread; returns once its samples are running (KV blocks taken)."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (args.rollout_samples, args.prompt_len), generator=gen).tolist()
    sampling = dict(temperature=1.0, max_tokens=args.rollout_tokens, ignore_eos=True, seed=0)
    out: dict = {}

    def run() -> None:
        start = time.perf_counter()
        out["table"] = client.generate(prompts, sampling=sampling)
        out["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run)
    thread.start()
    total = client.server_info()["kv_blocks_total"]
    while client.server_info()["kv_blocks_free"] > total - args.rollout_samples and thread.is_alive():
        time.sleep(0.01)
    return thread, out


def rollout_row(args: argparse.Namespace, model_dir: Path, state: dict, mode: str) -> dict:
    staging = {"staged_host": "host", "staged_device": "device"}.get(mode, "auto")
    vocab = SHAPES[args.shape]["vocab_size"]
    with server_process(args, serve_args(args, model_dir, "--weight-staging", staging)) as server:
        with RolloutClient(server.address, timeout=3600) as client:
            client.update_weights(state)  # warm: first-use costs are not the pause
            version = client.server_info()["policy_version"]
            thread, rollout = start_rollout(client, args, vocab)
            if mode == "sequential":
                thread.join()
            start = time.perf_counter()
            client.update_weights(state)
            update_s = time.perf_counter() - start
            thread.join()
    reply = client.last_update
    pause = update_s if mode == "sequential" else reply["pause_seconds"]
    versions = rollout["table"].column("policy_version").to_pylist()
    return dict(mode=mode, rollout_s=rollout["seconds"], update_s=update_s, pause_s=pause,
                stage_s=reply["stage_seconds"], old_version_samples=versions.count(version), samples=len(versions))


def summary(rows: list[dict]) -> list[dict]:
    """Per (path, buffers, port, streams): the repeat nearest the median seconds (with two repeats,
    the first), and every repeat's GB/s in `gb_per_s_runs`."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["path"], row["buffers"], row.get("port"), row.get("streams")), []).append(row)
    out = []
    for group in groups.values():
        row = dict(nearest_median(group, "seconds"))
        row["gb_per_s_runs"] = " ".join(f"{r['gb_per_s']:.3f}" for r in group)
        out.append(row)
    return out


def main() -> None:
    args = parse_args()
    result: dict = dict(args=vars(args), env=environment(args.device))
    with tempfile.TemporaryDirectory(dir=scratch_dir(args)) as tmp:
        root = Path(tmp)
        model_dir = write_config_dir(args.model_shape, root / "model")
        if "transfer" in args.sections or "rollout" in args.sections:
            state = random_state(args.model_shape, args.source_device, getattr(torch, args.dtype))
        if "transfer" in args.sections:
            rows = transfer_rows(args, model_dir, state, root)
            result.update(rows=rows, summary=summary(rows))
            write_json(args.out, result)
            print_table(f"weight sync, {args.shape} {args.dtype}, server on {args.device} (the repeat nearest "
                        f"the median of {args.repeats}; every repeat's GB/s last)", result["summary"],
                        [*COLUMNS, "gb_per_s_runs"])
        if "rollout" in args.sections:
            result["rollout"] = [rollout_row(args, model_dir, state, mode) for mode in ROLLOUT_MODES]
            write_json(args.out, result)
            print_table(f"pause while a rollout of {args.rollout_samples} x {args.rollout_tokens} tokens runs",
                        result["rollout"], ROLLOUT_COLUMNS)
        if "memory" in args.sections:
            result["memory"] = memory_rows(args, model_dir)
            write_json(args.out, result)
            print_table("release / resume (free_fraction: of what the server held, seen by mem_get_info)",
                        result["memory"], MEMORY_COLUMNS)
    print(f"\nwrote {args.out}")


def transfer_rows(args: argparse.Namespace, model_dir: Path, state: dict, root: Path) -> list[dict]:
    """The gRPC rows (state dict and safetensors files, buffers given back and kept) with the
    same-host and broadcast ones."""
    from safetensors.torch import save_file

    files = root / "safetensors"
    files.mkdir()
    embed = state["model.embed_tokens.weight"]  # (a tied lm_head is left out of files, as HF saves them)
    save_file({k: v.cpu() for k, v in state.items() if k == "model.embed_tokens.weight" or v is not embed},
              files / "model.safetensors")
    return [row for keep in (False, True) if ("kept" if keep else "given back") in args.buffers
            for row in grpc_rows(args, model_dir, state, files, keep)]


if __name__ == "__main__":
    main()
