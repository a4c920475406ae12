"""Where a decode step of a MoE target spends its time, at batch 1 and 64 (bench_moe.py's second part).

The engine on random weights of the shape (Triton kernels, CUDA graphs), for each batch: (1) its
decode time per step, as bench_engine.py measures it (an N-token run minus a 1-token run); (2)
its captured decode graph replayed alone (the forward without LM head, sampling or host work);
(3) each part of a layer captured as one CUDA graph over all the layers (each layer's own weights
and inputs, taken from one eager forward, so nothing is served from L2 that a real step reads
from DRAM) and timed with events around the replays: the attention block (two residual-add
norms, qkv projection, q/k norm + RoPE + cache write, paged attention, o projection), its two
GEMMs alone, the router GEMM, the MoE kernels phase by phase for the launch the table picks at
that batch, the MoE block, the whole layer; the final norm and LM head; (4) the kernels of one
eager decode step (torch.profiler): names, launches and device time, which count the launches per
layer and, against (2), the time between kernels.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch
from common import SHAPES, eager_step_kernels, metadata, print_table, run_engine, time_us, write_config_dir

from rollout.engine import moe_launch, triton_moe, triton_moe_route, triton_ops
from rollout.engine.config import EngineConfig
from rollout.engine.engine import LLMEngine
from rollout.engine.moe import SparseMoeBlock
from rollout.engine.params import SamplingParams

BLOCK = 16
PROMPT = 128
WHOLE_LAYER_PARTS = ("attention block", "  qkv_proj GEMM", "  o_proj GEMM", "layer")  # the rest: sparse layers


def breakdown(args, bandwidth: float) -> dict:
    shape, batches = SHAPES[args.shape], args.breakdown_batches
    start = time.perf_counter()
    per_seq = -(-(PROMPT + args.decode_tokens + args.context) // BLOCK) + 1
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(EngineConfig(
            model=str(write_config_dir(shape, Path(tmp))), load_format="random", device=args.device,
            num_kv_blocks=max(batches) * per_seq + 8, block_size=BLOCK, max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, max(batches) * PROMPT), enable_prefix_caching=False,
            kernel_backend="triton"))
    print(f"breakdown: engine built in {time.perf_counter() - start:.1f} s", flush=True)
    out = {}
    for batch in batches:
        prompts = [[random.Random(b).randrange(shape["vocab_size"]) for _ in range(PROMPT)] for b in range(batch)]
        rates = engine_rates(engine, prompts, args)
        run = dict(engine=rates, parts=parts(engine, batch, args, bandwidth, rates))
        if args.device == "cuda":
            run["kernels"] = kernel_census(engine, prompts)
        print_breakdown(run, batch, len(engine.model.layers))
        out[f"batch_{batch}"] = run
    del engine
    return out


def engine_rates(engine: LLMEngine, prompts: list[list[int]], args) -> dict:
    """Decode ms per step (after the first token) and the engine's decode graph replayed alone."""
    seconds = {}
    for n in (4, 1, 1, args.decode_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        run = run_engine(engine, [(p, params, {}) for p in prompts], f"b{n}-{time.monotonic_ns()}", args.device)
        seconds[n] = min(seconds.get(n, float("inf")), run.seconds)
    step_ms = (seconds[args.decode_tokens] - seconds[1]) / (args.decode_tokens - 1) * 1e3
    rates = dict(step_ms=step_ms, tokens_per_s=len(prompts) * 1e3 / step_ms)
    keys = [k for k in (engine.graphs.graphs if engine.graphs else ()) if k[0] >= len(prompts) and k[1] == 1]
    if keys:
        replay = engine.graphs.graphs[min(keys)][0]
        rates["forward_graph_ms"] = time_us(replay, args.device, args.reps, capture=False) / 1e3
    return rates


def layer_inputs(model, kv_caches, meta, num_tokens: int) -> list[tuple]:
    """One eager forward of `num_tokens` tokens: each layer's (pending, residual, MLP input,
    router logits or None), then the final norm's (pending, residual)."""
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=kv_caches[0][0].device)
    hidden, pending, inputs = model.embed_tokens(ids), None, []
    for layer, kv in zip(model.layers, kv_caches, strict=True):
        normed, residual = layer.attend_fused(pending, hidden, meta, kv)
        sparse = isinstance(layer.mlp, SparseMoeBlock)
        inputs.append((pending, hidden, normed, layer.mlp.gate(normed) if sparse else None))
        pending, hidden = layer.mlp(normed), residual
    return inputs + [(pending, hidden, None, None)]


@torch.inference_mode()
def parts(engine: LLMEngine, batch: int, args, bandwidth: float, rates: dict) -> list[dict]:
    model, caches, cfg = engine.model, engine.kv_caches, engine.model.config
    meta = metadata([1] * batch, [args.context] * batch, caches[0][0].device)
    inputs = layer_inputs(model, caches, meta, batch)
    layers = list(zip(model.layers, caches, inputs, strict=False))
    sparse = [(ly, kv, i) for ly, kv, i in layers if isinstance(ly.mlp, SparseMoeBlock)]
    elem = model.embed_tokens.weight.element_size()
    qkv_bytes, o_bytes = (cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size * elem, cfg.q_size * cfg.hidden_size * elem
    o_in = torch.randn(batch, cfg.q_size, device=meta.positions.device, dtype=model.embed_tokens.weight.dtype)
    touched = experts_touched(sparse, cfg)
    spec = [  # (part, fn over one layer, bytes a layer reads)
        ("attention block", lambda ly, kv, i: ly.attend_fused(i[0], i[1], meta, kv),
         qkv_bytes + o_bytes + 2 * batch * args.context * cfg.kv_size * elem),
        ("  qkv_proj GEMM", lambda ly, kv, i: ly.self_attn.qkv_proj(i[2]), qkv_bytes),
        ("  o_proj GEMM", lambda ly, kv, i: ly.self_attn.o_proj(o_in), o_bytes),
        ("router GEMM", lambda ly, kv, i: ly.mlp.gate(i[2]), cfg.moe.num_experts * cfg.hidden_size * elem),
        *moe_phases(moe_launch.launch_for(batch), cfg, touched * cfg.hidden_size * cfg.moe.moe_intermediate_size
                    * elem),
        ("MoE block (router + kernels)", lambda ly, kv, i: ly.mlp(i[2]), None),
        ("layer", lambda ly, kv, i: ly.forward_fused(i[0], i[1], meta, kv), None),
    ]
    rows = []
    for name, fn, nbytes in spec:
        over = layers if name in WHOLE_LAYER_PARTS else sparse
        us = time_us(lambda: [fn(ly, kv, i) for ly, kv, i in over], args.device, args.reps) / len(over)  # noqa: B023
        rows.append(_row(name, us, nbytes, len(over), bandwidth))
    pending, residual = inputs[-1][:2]
    head = lambda: model.compute_logits(triton_ops.add_rms_norm(  # noqa: E731
        pending, residual, model.norm.weight, model.norm.eps)[0])
    rows.append(_row("final norm + LM head", time_us(head, args.device, args.reps),
                     model.lm_head.weight.numel() * elem, 1, bandwidth))
    rows.append(dict(part="engine decode step", ms_per_step=rates["step_ms"]))
    if "forward_graph_ms" in rates:
        rows.append(dict(part="  its forward graph alone", ms_per_step=rates["forward_graph_ms"]))
        rows.append(dict(part="  the rest: LM head, sampler, host", ms_per_step=rates["step_ms"]
                         - rates["forward_graph_ms"]))
    return rows


def experts_touched(sparse: list[tuple], cfg) -> float:
    """Distinct experts the step routes to, mean over the sparse layers."""
    k, renorm = cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob
    return sum(triton_moe_route.route(i[3], k, renorm)[1].unique().numel() for _, _, i in sparse) / len(sparse)


def moe_phases(launch, cfg, down_bytes: float) -> list[tuple]:
    """The table's launch, phase by phase, each on the inputs the phases before it made."""
    k, renorm, bm = cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob, launch.block_m
    gate_up_bytes = 2 * down_bytes
    if launch.path == "gemv":
        def gemv_down(ly, i):
            hidden, w, ids = triton_moe.gemv_gate_up(i[2], i[3], ly.mlp.experts.gate_up_proj, k, renorm, launch.gate_up)
            return lambda: triton_moe.gemv_down(hidden, ly.mlp.experts.down_proj, w, ids, k, launch.down)

        return [("MoE gate/up (+ routing)", lambda ly, kv, i: triton_moe.gemv_gate_up(
                    i[2], i[3], ly.mlp.experts.gate_up_proj, k, renorm, launch.gate_up), gate_up_bytes),
                ("MoE down (+ weighted sum)", _prepared(gemv_down), down_bytes)]

    def routed(ly, i):
        w, sp, be = triton_moe.sorted_route(i[3], k, renorm, bm)
        return w, sp, be, triton_moe.sorted_gate_up(i[2], ly.mlp.experts.gate_up_proj, sp, be, k, bm, launch.gate_up)

    def gate_up(ly, i):
        _, sp, be, _ = routed(ly, i)
        return lambda: triton_moe.sorted_gate_up(i[2], ly.mlp.experts.gate_up_proj, sp, be, k, bm, launch.gate_up)

    def down(ly, i):
        w, sp, be, hidden = routed(ly, i)
        pairs = i[2].shape[0] * k
        return lambda: triton_moe.sorted_down(hidden, ly.mlp.experts.down_proj, w, sp, be, pairs, bm, launch.down)

    def total(ly, i):
        pair_out = down(ly, i)()
        return lambda: pair_out.view(i[2].shape[0], k, -1).sum(dim=1)

    return [("MoE route + align", lambda ly, kv, i: triton_moe.sorted_route(i[3], k, renorm, bm), None),
            ("MoE gate/up", _prepared(gate_up), gate_up_bytes), ("MoE down", _prepared(down), down_bytes),
            ("MoE sum of k rows", _prepared(total), None)]


def _prepared(make):
    """A phase whose inputs come from the phases before it: made once per layer (on the warm-up
    call, outside the graph), then only the phase runs."""
    made = {}

    def run(ly, kv, i):
        if id(ly) not in made:
            made[id(ly)] = make(ly, i)
        return made[id(ly)]()

    return run


def _row(name: str, us: float, nbytes: float | None, num_layers: int, bandwidth: float) -> dict:
    row = dict(part=name, us_per_layer=us, ms_per_step=us * num_layers / 1e3)
    if nbytes:
        row.update(gb_per_s=nbytes / us / 1e3, of_copy=nbytes / us / 1e3 / (bandwidth / 1e9))
    return row


def kernel_census(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    """The CUDA kernels of one eager decode step (graphs off): launches and device time per name."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def add_requests():
        for p in prompts:
            engine.add_request(f"census-{time.monotonic_ns()}", [p], params)

    events = eager_step_kernels(engine, add_requests)
    top = [dict(kernel=e.key[:60], launches=e.count, us=e.device_time_total,
                us_per_launch=e.device_time_total / e.count) for e in events]
    device_ms = sum(e.device_time_total for e in events) / 1e3
    return dict(launches=sum(e.count for e in events), device_ms=device_ms, top=top)


def print_breakdown(run: dict, batch: int, num_layers: int) -> None:
    print_table(f"decode breakdown, batch {batch} ({num_layers} layers; each part one CUDA graph over the layers; "
                f"GB/s of the weights and KV it must read)", run["parts"],
                ["part", "us_per_layer", "ms_per_step", "gb_per_s", "of_copy"])
    if "kernels" in run:
        k = run["kernels"]
        print_table(f"kernels of one eager decode step, batch {batch}: {k['launches']} launches "
                    f"({k['launches'] / num_layers:.1f} per layer), {k['device_ms']:.3f} ms of device time",
                    k["top"][:14], ["kernel", "launches", "us", "us_per_launch"])
