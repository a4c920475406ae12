"""Cost of the policy (docs/sampling.md) plus verification per step, before and after issue 14's sampler.

For each batch shape (E sequences, each with K drafts: E x (K + 1) logits rows; the defaults are
256 x 0 = 256 rows of plain decoding and 256 x 8 = 2304 rows of a speculative step at block 9,
vocabulary 151936, float32 logits as `compute_logits` returns them) and each kind of row, it times
`policy` + `verify` with the current code ("new") and with the implementation this issue replaced
("old", kept below as the baseline: every non-greedy row sorted the whole vocabulary), and
records the peak device memory above the step's inputs (logits, and the drafts' q: [D, V]
probabilities for the old code, the drafter's tempered logits for the new one, as each drafter
hands them over). The new code runs as the engine calls it, on its logits in place (the copy it is
handed is made before the peak is measured, so it counts as an input). Kinds: greedy, dense
(temperature 1, no truncation: the RL default), top_k64 (top_k 64, top_p 0.95: the mask
workload), top_k4096 (the largest mask bound), top_p (0.95 without top-k), min_p (0.05), mixed
(the five kinds in turn per sequence). Sampled drafts are random tokens with random q (mostly
rejected: the residual path runs for almost every sequence). A case the baseline cannot fit
reports OOM.

Logits are N(0, 9) per token (top_p 0.95 keeps ~13k of 151,936 tokens), except two more top-p
cases: top_p_peaked, whose rows' scales (4 to 5.5) make top_p 0.95 keep ~50-2000 tokens as a
trained model's rows do, and top_p_flat (scale 1, ~110k tokens). Top-p cases also time "sort":
the current code with its top-p rows sorted outright (no candidate stage: the code before the
candidate preselection), and report the median support and the share of rows settled by the
first candidates (cand_share) and by the sort (sort_share).

    python benchmarks/bench_sampler.py --device cuda
    python benchmarks/bench_sampler.py --device cuda --drafts 8 --cases top_p top_p_peaked top_p_flat
    python benchmarks/bench_sampler.py --device cpu --quick   # script check
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from common import environment, free_memory, print_table, sync, time_ms, write_json

import rollout.engine.top_p as top_p_mod
from rollout.engine.sampler import (
    PURPOSE_ACCEPT,
    PURPOSE_SAMPLE,
    RowParams,
    RowPlan,
    apply_processors,
    policy,
    uniform,
    uniform_keys,
    uniform_of_keys,
)
from rollout.engine.verify import Proposal, verify

KINDS = {
    "greedy": dict(temperature=0.0),
    "dense": dict(),
    "top_k64": dict(top_k=64, top_p=0.95),
    "top_k4096": dict(top_k=4096),
    "top_p": dict(top_p=0.95),
    "min_p": dict(min_p=0.05),
}
TOP_P_KINDS = {"top_p_peaked": (4.0, 5.5), "top_p_flat": (1.0, 1.0)}  # top_p 0.95; the rows' logit scales
CASES = (*KINDS, "mixed", *TOP_P_KINDS)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="8 sequences, vocabulary 4096, few iterations (CPU check)")
    p.add_argument("--entries", type=int, default=256, help="sequences per step")
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 8], help="drafts per sequence, one shape each")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default="benchmarks/results/bench_sampler.json")
    args = p.parse_args()
    if args.quick:
        args.entries, args.vocab, args.iters = 8, 4096, 2
    return args


# -- the step's inputs ---------------------------------------------------------------------------

@dataclass
class Step:
    logits: torch.Tensor  # [R, V] float32
    rows: RowParams
    drafts: torch.Tensor  # [D] int64
    q_old: torch.Tensor | None  # [D, V] float32 probabilities (the old drafter's hand-over)
    q_new: Proposal | None  # the same q as the new drafter hands it over
    layout: SimpleNamespace  # what verify reads of a StepBatch


def make_step(case: str, entries: int, k: int, vocab: int, device: str) -> Step:
    g = torch.Generator(device=device).manual_seed(0)
    kinds = [KINDS[c] for c in (KINDS if case == "mixed" else ["top_p" if case in TOP_P_KINDS else case])]
    per_entry = [kinds[e % len(kinds)] for e in range(entries)]
    per_row = [spec for spec in per_entry for _ in range(k + 1)]
    greedy = [spec.get("temperature", 1.0) == 0 for spec in per_row]
    top_k = [1 if gr else min(spec.get("top_k", vocab), vocab) for spec, gr in zip(per_row, greedy)]
    top_p = [spec.get("top_p", 1.0) for spec in per_row]
    min_p = [spec.get("min_p", 0.0) for spec in per_row]
    temp = [1.0 if gr else spec.get("temperature", 1.0) for spec, gr in zip(per_row, greedy)]
    rows = RowParams(temperature=torch.tensor(temp, device=device), top_k=torch.tensor(top_k, device=device),
                     top_p=torch.tensor(top_p, device=device), min_p=torch.tensor(min_p, device=device),
                     all_greedy=all(greedy))
    rows.plan = None if rows.all_greedy else RowPlan.of(top_k, top_p, min_p, vocab)
    num_rows, num_drafts = entries * (k + 1), entries * k
    low, high = TOP_P_KINDS.get(case, (3.0, 3.0))
    scale = torch.linspace(low, high, num_rows, device=device)[torch.randperm(num_rows, generator=g, device=device)]
    logits = torch.randn(num_rows, vocab, generator=g, device=device) * scale[:, None]
    drafts = torch.randint(0, vocab, (num_drafts,), generator=g, device=device)
    q_old = q_new = None
    if k and not all(greedy):
        z = torch.randn(num_drafts, vocab, generator=g, device=device) * 3
        q_new = Proposal(z, torch.logsumexp(z, dim=1), torch.zeros(num_drafts, dtype=torch.bool, device=device),
                         drafts)
        q_old = torch.softmax(z, dim=1)
    return Step(logits, rows, drafts, q_old, q_new, _layout(entries, k, device))


def _layout(entries: int, k: int, device: str) -> SimpleNamespace:
    num_draft = [k] * entries
    cu_rows = list(range(0, entries * (k + 1) + 1, k + 1))
    judge = [r for e in range(entries) for r in range(cu_rows[e], cu_rows[e] + k)]
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return SimpleNamespace(num_draft=num_draft, judge_row=as_t(judge), draft_of_row=as_t(list(range(entries * k))),
                           row_seed=as_t(list(range(cu_rows[-1]))), row_position=as_t([7] * cu_rows[-1]),
                           entry_first_row=as_t(cu_rows[:-1]), entry_num_draft=as_t(num_draft),
                           entry_first_draft=as_t(list(itertools.accumulate(num_draft[:-1], initial=0))))


def run_new(step: Step, logits: torch.Tensor):
    return verify(policy(logits, step.rows, overwrite=True), step.drafts, step.q_new, step.layout)


def run_sort(step: Step, logits: torch.Tensor):
    """The current code with top-p rows sorted outright (no candidate stage)."""
    widths, top_p_mod.STAGE_WIDTHS = top_p_mod.STAGE_WIDTHS, ()
    try:
        return run_new(step, logits)
    finally:
        top_p_mod.STAGE_WIDTHS = widths


def top_p_paths(step: Step) -> dict:
    """Median support of the top-p rows and the share settled by the first candidates / the sort."""
    reads, real = [], top_p_mod._short_rows  # (short, next stage) per stage that read
    top_p_mod._short_rows = lambda reached, reachable: reads.append(real(reached, reachable)) or reads[-1]
    try:
        pol = policy(step.logits.clone(), step.rows, overwrite=True)
    finally:
        top_p_mod._short_rows = real
    sizes = torch.isfinite(pol.vocab_logp).sum(dim=1) if pol.vocab_logp is not None else None
    if pol.cand_logp is not None:
        cand = torch.isfinite(pol.cand_logp).sum(dim=1)
        sizes = cand if sizes is None else torch.where(pol.in_cand, cand, sizes)
    rows = len(reads[0][0]) if reads else 1
    sorted_rows = sum(int((short & ~later).sum()) for short, later in reads)  # short, not worth the next stage
    return {"support_median": int(sizes.float().median()),
            "cand_share": 1.0 - float(reads[0][0].sum()) / rows if reads else 1.0, "sort_share": sorted_rows / rows}


def run_old(step: Step, logits: torch.Tensor):
    return old_verify(old_policy(logits, step.rows), step.drafts, step.q_old, step.layout)


def measure(name: str, step: Step, device: str, iters: int) -> dict:
    """Mean ms over `iters` steps (each on a fresh copy of the logits, copied outside the timing
    only for the peak; in the timing both arms include one copy: the old code's own, the new
    code's handed-in) and peak MiB above the inputs."""
    fn = {"new": run_new, "sort": run_sort, "old": run_old}[name]
    try:
        ms = time_ms(lambda: fn(step, step.logits.clone() if name != "old" else step.logits), device, iters, 2)
        peak = _peak_mib(lambda logits: fn(step, logits), step, device, copy=name != "old")
        return {"ms": ms, "peak_mib": peak}
    except torch.OutOfMemoryError:
        free_memory()
        return {"ms": "OOM", "peak_mib": "OOM"}


def _peak_mib(fn, step: Step, device: str, copy: bool) -> float | None:
    if device != "cuda":
        return None
    logits = step.logits.clone() if copy else step.logits
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(logits)
    sync(device)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# -- the baseline: the sorted-vocabulary policy and its verification, as of 84d8b3a ------------

@dataclass
class OldPolicy:
    sorted_ids: torch.Tensor  # [N, V'] int64
    sorted_logp: torch.Tensor  # [N, V'] float32
    support_len: torch.Tensor  # [N] int64

    def logprob_of(self, rows, tokens):
        hit = self.sorted_ids[rows] == tokens[:, None]
        return torch.where(hit, self.sorted_logp[rows], float("-inf")).amax(dim=1)


def old_policy(logits: torch.Tensor, rows: RowParams) -> OldPolicy:
    z = apply_processors(logits.float().clone(), rows)
    if rows.all_greedy:
        ids = z.argmax(dim=1, keepdim=True)
        allowed = z.gather(1, ids) > float("-inf")
        logp = torch.zeros(ids.shape, device=z.device).masked_fill_(~allowed, float("-inf"))
        return OldPolicy(ids, logp, allowed[:, 0].long())
    z = z / rows.temperature[:, None]
    sorted_z, sorted_ids = torch.sort(z, dim=1, descending=True, stable=True)
    rank = torch.arange(z.shape[1], device=z.device)
    keep = (rank[None, :] < rows.top_k[:, None]) & (sorted_z > float("-inf"))
    probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=1)
    keep &= ((probs.cumsum(dim=1) - probs) < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1.0)
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    sorted_logp = torch.log_softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=1)
    return OldPolicy(sorted_ids, sorted_logp, keep.sum(dim=1))


def sample_sorted(sorted_probs, support_len, u):
    cdf = sorted_probs.cumsum(dim=-1)
    idx = (cdf <= (u * cdf[..., -1])[..., None]).sum(dim=-1)
    return torch.minimum(idx, (support_len - 1).clamp(min=0))


def old_verify(pol: OldPolicy, drafts, draft_q, step):
    if not any(step.num_draft):
        u = uniform(step.row_seed, step.row_position, PURPOSE_SAMPLE)
        idx = sample_sorted(pol.sorted_logp.exp(), pol.support_len, u)[:, None]
        return pol.sorted_ids.gather(1, idx), pol.sorted_logp.gather(1, idx)
    num_e, k_max = len(step.num_draft), max(step.num_draft)
    greedy = pol.sorted_ids.shape[1] == 1 and draft_q is None
    keys = uniform_keys(step.row_seed, step.row_position)
    d_tok = drafts[step.draft_of_row]
    p_d = pol.logprob_of(step.judge_row, d_tok)
    q_d = torch.ones_like(p_d) if draft_q is None else draft_q[step.draft_of_row].gather(1, d_tok[:, None])[:, 0]
    ok = p_d > float("-inf") if greedy else uniform_of_keys(keys[step.judge_row], PURPOSE_ACCEPT) * q_d < p_d.exp()
    cu, n_draft, first = step.entry_first_row, step.entry_num_draft, step.entry_first_draft
    entry_of = torch.repeat_interleave(torch.arange(num_e, device=cu.device), n_draft, output_size=len(d_tok))
    table = torch.zeros(num_e, k_max + 1, dtype=torch.bool, device=cu.device)
    table[entry_of, step.judge_row - cu[entry_of]] = ok
    num_accepted = table.int().cumprod(dim=1).sum(dim=1)
    final_rows = cu + num_accepted
    ids, logp = pol.sorted_ids[final_rows], pol.sorted_logp[final_rows]  # [E, V]
    p = logp.exp()
    at = (first + num_accepted).clamp(max=len(drafts) - 1)
    q = (ids == drafts[at][:, None]).float() if draft_q is None else draft_q[at].gather(1, ids)
    residual = torch.where((num_accepted < n_draft)[:, None], (p - q).clamp(min=0), p)
    residual = torch.where(residual.sum(dim=1, keepdim=True) <= 0, p, residual)
    idx = sample_sorted(residual, pol.support_len[final_rows], uniform_of_keys(keys[final_rows], PURPOSE_SAMPLE))
    return ids.gather(1, idx[:, None]), num_accepted


# -- the run -------------------------------------------------------------------------------------

def main() -> None:
    args = parse_args()
    out = {"environment": environment(args.device), "args": vars(args), "results": []}
    for k, case in itertools.product(args.drafts, args.cases):
        step = make_step(case, args.entries, k, args.vocab, args.device)
        row = {"rows": step.logits.shape[0], "drafts_per_seq": k, "kind": case}
        top_p = case == "top_p" or case in TOP_P_KINDS
        for name in ("old", "sort", "new") if top_p else ("old", "new"):
            result = measure(name, step, args.device, args.iters)
            row.update({f"{name}_{key}": value for key, value in result.items()})
        if isinstance(row["old_ms"], float):
            row["speedup"] = row["old_ms"] / row["new_ms"]
        if top_p:
            row.update(top_p_paths(step))
        out["results"].append(row)
        print(f"{row}", flush=True)
        write_json(args.json, out)
        del step
        free_memory()
    print_table(f"policy + verify, vocabulary {args.vocab}, {args.entries} sequences ({args.device})",
                out["results"], ["rows", "kind", "old_ms", "sort_ms", "new_ms", "speedup", "old_peak_mib",
                                 "sort_peak_mib", "new_peak_mib", "support_median", "cand_share", "sort_share"])
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
