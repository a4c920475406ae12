"""`rollout demo` (= `make demo`): the whole path on one machine, in one screen.

Starts `rollout serve` on a free 127.0.0.1 port with the embedded models and a speculative
drafter, sends one GRPO-style group (one prompt, n samples, support masks at top_k 64) through
`trainer_client`, validates the result against the mask contract (docs/masks.md), collates it with `to_torch`, and
prints the decoded completions with their token counts, acceptance lengths and mask widths,
plus throughput; `keep` writes the group to an Arrow file for `rollout show`. Then one chat
prompt, rendered by the server with the model's chat template, greedy with a stop string. Then
stops the server with SIGTERM and reports its exit status.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import grpc
import pyarrow as pa

from rollout.engine.config import DEFAULT_DRAFTS, DEFAULT_MODEL
from rollout.server.process import ServerProcess

TOP_K = 64


def pick_spec(requested: str, draft: str | None = None) -> tuple[str, str]:
    """The requested method if its drafter was given or is embedded (the history drafter needs
    none), else the same with another embedded drafter, else without one; with a note saying
    what happened."""
    available = [m for m, path in DEFAULT_DRAFTS.items() if (path / "config.json").exists()]
    model, plus, history = requested.partition("+")
    if model in ("none", "history") or draft is not None or model in available:
        return requested, ""
    fallback = available[0] + plus + history if available else (history or "none")
    return (
        fallback,
        f"note: no embedded {model} drafter under {DEFAULT_DRAFTS[model]}; using --spec {fallback}",
    )


def run_demo(spec: str = "dflash", n: int = 8, max_tokens: int = 96, prompt: str = "def fibonacci(n):\n",
             seed: int = 7, model: str | None = None, draft: str | None = None,
             keep: str | None = None) -> int:  # fmt: skip
    """Returns 0 when the rollout validated and the server drained and exited 0. `keep`: a path to
    write the group's rollout to."""
    from trainer_client import RolloutClient

    spec, note = pick_spec(spec, draft)
    if note:
        print(note)
    serve_args = [
        "--spec",
        spec,
        *(["--model", model] if model else []),
        *(["--draft", draft] if draft else []),
    ]
    sampling = dict(temperature=1.0, top_k=TOP_K, top_p=0.95, max_tokens=max_tokens, seed=seed)
    with ServerProcess(serve_args) as server, RolloutClient(server.address, timeout=600) as client:
        info = client.server_info()
        kv = f"{info['kv_blocks_free']}/{info['kv_blocks_total']}"
        print(f"server {server.address}: model {info['model']}, drafter {info['drafter'] or '-'} ({spec}), "
              f"vocab {info['vocab_size']}, KV blocks free {kv}")  # fmt: skip
        print(f"GRPO group: prompt {prompt!r}, n={n}, mask=support, {sampling}\n")
        start = time.perf_counter()
        table = client.generate(prompt, n=n, sampling=sampling, mask="support", request_id="demo-group",
                                return_text=True)
        seconds = time.perf_counter() - start
        print_group(table, seconds)
        status = validate(table) | collate(table)
        if keep:
            write_arrow(table, keep)
            print(f"kept the group in {keep}: `rollout show {keep}` (--tokens, --html page.html) shows it")
        chat(client, prompt, Path(model) if model else DEFAULT_MODEL)
    exit_code = server.proc.returncode
    print(f"\nserver stopped with SIGTERM after draining: exit {exit_code} (logs: {server.log_path})")
    return status | (exit_code != 0)


def print_group(table: pa.Table, seconds: float) -> None:
    rows = table.to_pylist()
    print(f"{'#':>2}  {'finish':<6} {'tokens':>6} {'accept':>6} {'mask w':>11}  completion")
    for row in rows:
        widths = [len(s) for s in row["support_ids"] or []]
        accept = sum(row["accept_lengths"]) / max(len(row["accept_lengths"]), 1)
        width = f"{sum(widths) / max(len(widths), 1):.1f}/{max(widths, default=0)}"
        print(f"{row['sample_index']:>2}  {row['finish_reason']:<6} {len(row['token_ids']):>6} "
              f"{accept:>6.2f} {width:>11}  {row['text'][:72]!r}")  # fmt: skip
    tokens = sum(len(r["token_ids"]) for r in rows)
    steps = sum(len(r["accept_lengths"]) for r in rows)
    print(f"\n{tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s through gRPC + Arrow; "
          f"mean acceptance {tokens / max(steps, 1):.2f} tokens per verify step")  # fmt: skip


def chat(client, prompt: str, model_dir: Path) -> None:
    """One chat prompt through the model's chat template, greedy, stopping at a blank line (no EOS
    before 16 tokens: the embedded model never saw a chat and would end at once)."""
    from trainer_client.text import load_tokenizer

    messages = [{"role": "user", "content": prompt}]
    sampling = dict(temperature=0.0, max_tokens=64, min_tokens=16, stop=["\n\n"])
    try:
        row = client.generate(messages, sampling=sampling, return_text=True).to_pylist()[0]
    except grpc.RpcError as e:
        print(f"\nchat prompt: {e.details()}")
        return
    rendered = load_tokenizer(model_dir).decode(row["prompt_token_ids"], skip_special_tokens=False)
    print(f"\nchat prompt {messages} -> the model's template renders {rendered!r}")
    print(f"greedy, stop {sampling['stop']}: {row['text']!r} (finish {row['finish_reason']}"
          + (f", stop string {row['stop_reason']!r})" if row["stop_reason"] else ")"))


def write_arrow(table: pa.Table, path: str | Path) -> None:
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


def validate(table: pa.Table) -> int:
    """Runs `rollout validate` on the table written as an Arrow IPC file; 0 when clean."""
    from rollout.masks.check import main as check_main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "demo.arrow"
        write_arrow(table, path)
        print("validate: ", end="")
        return int(check_main([str(path), "--max-width", str(TOP_K)]) != 0)


def collate(table: pa.Table) -> int:
    """Shows what a trainer gets from `to_torch`."""
    import torch

    from trainer_client import to_torch

    batch = to_torch(table)
    shapes = {k: list(v.shape) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    print(f"to_torch: {shapes}")
    return 0
