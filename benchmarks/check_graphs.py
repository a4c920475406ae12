"""Graph replay against the eager forward, step by step: a diagnostic for an acceptance that
depends on CUDA graphs (check_acceptance.py on the H200: triton + captured graphs ~1.7, every
other path ~3.0).

One DFlash engine runs a sampled workload with CUDA graphs (captured on a GPU; on CPU the same
static-buffer path eagerly). Every target graph replay is followed by the eager target forward on
the step's own inputs, and every drafter graph replay by the drafter's eager block forward; the
largest absolute differences of the outputs, relative to the largest eager value, are recorded
per graph key (bfloat16 rounding: ~1e-2 at most, from a different key split of the bucket). The eager forward writes
the same cache slots again with the values it computes, so the run continues as before. Prints a
table and writes JSON.

    python benchmarks/check_graphs.py --device cuda --backend triton
"""

from __future__ import annotations

import argparse
import collections

import torch
from check_acceptance import run_to_end, workload_engine
from common import environment, print_table, write_json


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--backend", default="triton", choices=("torch", "triton"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/check_graphs.json")
    return p.parse_args()


def relative(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| / max |want| (NaN when either holds a NaN); 0 when there is nothing."""
    if got is None:
        return 0.0
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    engine = workload_engine(args, args.backend, graphs=True)
    diffs: dict[tuple, list[float]] = collections.defaultdict(list)

    target_run = engine.graphs.run

    def checked_target(key, input_ids, meta):
        hidden, aux = target_run(key, input_ids, meta)
        hidden, aux = hidden.clone(), aux.clone() if aux is not None else None
        ref_hidden, ref_aux = engine._target_forward(input_ids, meta)
        diffs[("target",) + tuple(key)].append(max(relative(hidden, ref_hidden), relative(aux, ref_aux)))
        return hidden, aux

    engine.graphs.run = checked_target
    drafter = engine.drafter
    draft_run = drafter.graphs.run

    def checked_draft(key, anchors, anchor_pos, table):
        hidden, logits = (o.clone() for o in draft_run(key, anchors, anchor_pos, table))
        ctx_len = int(anchor_pos.max())
        ref_hidden, ref_logits = drafter._block_forward(anchors, anchor_pos, table, ctx_len)
        diffs[("draft",) + tuple(key)].append(relative(logits, ref_logits))
        return hidden, logits

    drafter.graphs.run = checked_draft
    _, _, acceptance = run_to_end(engine)
    rows = [dict(graph=k[0], key=str(k[1:]), replays=len(v), max_rel_diff=max(v), mean_rel_diff=sum(v) / len(v))
            for k, v in sorted(diffs.items())]
    result = dict(args=vars(args), env=environment(args.device), rows=rows,
                  acceptance=acceptance)
    print_table(f"graph replay vs eager ({args.device}, {args.backend}); acceptance {result['acceptance']:.3f}",
                rows, ["graph", "key", "replays", "max_rel_diff", "mean_rel_diff"])
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
