"""Overlapped scheduling against the synchronous loop on a real device (issue 17): the embedded tiny
Qwen3 runs one mixed workload with `overlap` on and off (greedy and seeded sampled samples, masks in
both modes, n > 1 sharing a prompt, stop ids, min_tokens, penalties, samples that finish at once,
an abort between steps) and every sample's tokens, finish, log-probs and masks are compared. On a
GPU this exercises what CPU tests cannot: step n+1's kernels queued behind step n's, n's results
copied behind n alone (an event, not a stream synchronisation), CUDA-graph replays of both.
Prints the differences and the steps each run took. None are expected in float32 (CPU), where any
difference exits 1. In bfloat16 a sample may diverge late after a near tie, since a discarded slot
changes a step's batch size and with it the kernels' rounding (as any change of batch composition
does); so on a GPU a control run (the synchronous loop with fewer sequences per step) measures that
noise side by side, and the check exits 1 when the overlapped run differs in more than twice as many
samples (at least 4). A bug shows as many samples differing from their first tokens.

`--spec dflash` (or dspark) runs the same with the embedded drafter verifying full blocks, so drafted
steps overlap drafted steps (their anchors and positions gathered on the device); each sample's accept
lengths are compared too (the same drafts verified).

    python benchmarks/check_overlap.py --device cuda
    python benchmarks/check_overlap.py --device cuda --spec dflash
    python benchmarks/check_overlap.py --device cpu --requests 8 --tokens 16   # checks the script
"""

from __future__ import annotations

import argparse
import random
import sys

from common import embedded_draft, free_memory

import rollout
from rollout.engine.config import EngineConfig
from rollout.engine.params import SamplingParams

SAMPLED = dict(temperature=1.0, top_k=40, top_p=0.95, ignore_eos=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--requests", type=int, default=64, help="requests of each kind")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens of the long samples")
    p.add_argument("--spec", default="none", choices=("none", "dflash", "dspark"),
                   help="the embedded drafter, full blocks (drafted steps overlap)")
    return p.parse_args()


def add_workload(eng, requests: int, tokens: int) -> None:
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(eng.vocab_size) for _ in range(rng.randrange(4, 40))]  # noqa: E731
    for i in range(requests):
        eng.add_request(f"greedy{i}", [prompt()], SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                 ignore_eos=True, stop_token_ids=[i % 64]))
        eng.add_request(f"seeded{i}", [prompt()], SamplingParams(max_tokens=rng.randrange(1, tokens), seed=i,
                                                                 **SAMPLED), n=1 + i % 4,
                        mask=("support", "selected", None)[i % 3])
        eng.add_request(f"pen{i}", [prompt()], SamplingParams(max_tokens=tokens // 2, seed=i, min_tokens=4,
                                                              repetition_penalty=1.3, temperature=1.0))


def run(device: str, overlap: bool, requests: int, tokens: int, max_num_seqs: int = 256,
        spec: str = "none") -> tuple[dict, int]:
    drafter = {} if spec == "none" else dict(spec=spec, draft=embedded_draft(spec), spec_adaptive=False)
    eng = rollout.build_engine(EngineConfig(device=device, overlap=overlap, max_num_seqs=max_num_seqs, **drafter))
    add_workload(eng, requests, tokens)
    outs, steps = [], 0
    while eng.has_unfinished():
        outs += eng.step()
        steps += 1
        if steps == 5:
            outs += eng.abort("seeded1")
    return {(o.request_id, o.prompt_index, o.sample_index): o for o in outs}, steps


def differences(got: dict, want: dict) -> list[str]:
    found = [] if got.keys() == want.keys() else [f"samples differ: {got.keys() ^ want.keys()}"]
    for key in want.keys() & got.keys():
        g, w = got[key], want[key]
        if (g.token_ids, g.finish_reason, g.error, g.accept_lengths) != (w.token_ids, w.finish_reason, w.error,
                                                                          w.accept_lengths):
            at = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b),
                      min(len(g.token_ids), len(w.token_ids)))
            found.append(f"{key}: tokens / finish differ from token {at} of {len(w.token_ids)}")
        elif max((abs(a - b) for a, b in zip(g.token_logprobs, w.token_logprobs)), default=0.0) > 1e-3:
            found.append(f"{key}: log-probs differ")
        elif g.support_ids != w.support_ids:
            found.append(f"{key}: masks differ")
    return found


def main() -> None:
    args = parse_args()
    want, sync_steps = run(args.device, False, args.requests, args.tokens, spec=args.spec)
    free_memory()  # the first engine's KV cache takes most of the device
    got, overlap_steps = run(args.device, True, args.requests, args.tokens, spec=args.spec)
    found = differences(got, want)
    print(f"{len(want)} samples, steps: synchronous {sync_steps}, overlapped {overlap_steps}; "
          f"{len(found)} differing")
    for line in sorted(found)[:20]:
        print(" ", line)
    allowed = 0
    if args.device != "cpu":
        # The control: the synchronous loop again with fewer sequences per step, a change of batch
        # composition alone. Its count of differing samples is the rounding noise of this device.
        free_memory()
        control, control_steps = run(args.device, False, args.requests, args.tokens, max_num_seqs=192,
                                     spec=args.spec)
        noise = differences(control, want)
        allowed = max(2 * len(noise), 4)
        print(f"control (synchronous, 192 sequences per step, {control_steps} steps): {len(noise)} differing; "
              f"the overlapped run may differ in at most {allowed}")
        for line in sorted(noise)[:20]:
            print(" ", line)
    sys.exit(1 if len(found) > allowed else 0)


if __name__ == "__main__":
    main()
