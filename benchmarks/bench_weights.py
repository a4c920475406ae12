"""Weight sync benchmark (issue 15): how fast a trainer's new policy reaches a `rollout serve`.

A random bfloat16 state dict of a model shape (HF names, the shape's tensors) is pushed to a
server that holds random weights of the same shape (`--load-format random`, nothing downloaded):

  grpc_state_dict   client.update_weights(state_dict): UpdateWeights over loopback gRPC
  grpc_safetensors  client.update_weights(directory): the same state dict as safetensors files
  (with --keep-weight-buffers too: the server keeps the upload's host memory between updates)

Per path: seconds from the call to the new version serving, GB/s (update bytes / seconds), the
server's staging seconds (after the transfer, checks included) and its pause (no step ran).
The state dict lives on --source-device (a trainer's tensors: cuda on the GPU run).

    python benchmarks/bench_weights.py --quick                                   # CPU check (tiny shape)
    python benchmarks/bench_weights.py --shape qwen3-0.6b --repeats 3            # CPU, ~1.2 GB update
    python benchmarks/bench_weights.py --device cuda --source-device cuda --shape qwen3-8b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, environment, print_table, write_config_dir, write_json  # noqa: E402

from rollout.engine.model import ModelConfig, TransformerLM  # noqa: E402
from rollout.engine.weight_specs import model_specs  # noqa: E402
from rollout.server.process import ServerProcess  # noqa: E402
from trainer_client import RolloutClient  # noqa: E402

COLUMNS = ["path", "buffers", "gb", "seconds", "gb_per_s", "stage_s", "pause_s", "version"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the server's device")
    p.add_argument("--source-device", default="cpu", choices=("cpu", "cuda"), help="where the state dict lives")
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="tiny shape, one repeat: a CPU check of the script")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-args", default="", help="more `rollout serve` arguments")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_weights_<device>.json)")
    args = p.parse_args()
    if args.quick:
        args.shape, args.repeats = "tiny", 1
    args.out = args.out or str(Path(__file__).parent / "results" / f"bench_weights_{args.device}.json")
    return args


def random_state(shape: dict, device: str) -> dict[str, torch.Tensor]:
    """A bfloat16 state dict with the shape's checkpoint names and shapes (a tied lm_head equal to
    the embedding, as a tied model's state_dict() has it)."""
    with torch.device("meta"):
        specs = model_specs(TransformerLM(ModelConfig.from_hf(shape)))
    gen = torch.Generator(device).manual_seed(0)
    state = {}
    for key, spec in specs.items():
        name = key if key.startswith("lm_head.") else f"model.{key}"
        if spec.alias_of is None:
            state[name] = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    for key, spec in specs.items():
        if spec.alias_of is not None:
            state[key] = state[f"model.{spec.alias_of}"]
    return state


def timed_update(client: RolloutClient, weights, nbytes: int, path: str, buffers: str) -> dict:
    start = time.perf_counter()
    version = client.update_weights(weights)
    seconds = time.perf_counter() - start
    reply = client.last_update
    return dict(path=path, buffers=buffers, gb=nbytes / 1e9, seconds=seconds, gb_per_s=nbytes / 1e9 / seconds,
                stage_s=reply["stage_seconds"], pause_s=reply["pause_seconds"], version=version)


def grpc_rows(args: argparse.Namespace, model_dir: Path, state: dict, files: Path, keep: bool) -> list[dict]:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffers = "kept" if keep else "given back"
    serve = ["--model", str(model_dir), "--load-format", "random", "--device", args.device, "--num-kv-blocks", "64"]
    serve += (["--keep-weight-buffers"] if keep else []) + args.server_args.split()
    rows = []
    with ServerProcess(serve, startup_timeout=900) as server, RolloutClient(server.address, timeout=3600) as client:
        for r in range(args.repeats):
            rows.append(timed_update(client, state, nbytes, "grpc_state_dict", buffers))
            rows.append(timed_update(client, files, nbytes, "grpc_safetensors", buffers))
            print_table(f"repeat {r}", rows[-2:], COLUMNS)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (path, buffers): the median repeat's numbers."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["path"], row["buffers"]), []).append(row)
    out = []
    for group in groups.values():
        median = statistics.median(r["seconds"] for r in group)
        out.append(min(group, key=lambda r: abs(r["seconds"] - median)))
    return out


def main() -> None:
    args = parse_args()
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_config_dir(SHAPES[args.shape], root / "model")
        state = random_state(SHAPES[args.shape], args.source_device)
        files = root / "safetensors"
        files.mkdir()
        embed = state["model.embed_tokens.weight"]  # (a tied lm_head is left out of files, as HF saves them)
        save_file({k: v.cpu() for k, v in state.items() if k == "model.embed_tokens.weight" or v is not embed},
                  files / "model.safetensors")
        rows = grpc_rows(args, model_dir, state, files, keep=False) + grpc_rows(args, model_dir, state, files, True)
    result = dict(args=vars(args), env=environment(args.device), rows=rows, summary=summary(rows))
    print_table(f"weight sync, {args.shape} bf16, server on {args.device} (median of {args.repeats})",
                result["summary"], COLUMNS)
    write_json(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
