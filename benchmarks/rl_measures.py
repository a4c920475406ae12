"""What bench_rl.py measures besides time: each step's memory-bound limit (Costs: an engine's bytes and
FLOPs a step, from the steps StepLog records off the engine's build_step) and the attention kernels'
device time on a profiled window of a run (profile_attention), with the GPU's clocks after it
(gpu_state)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

from common import ATTENTION_KERNELS, kernel_trace, kernel_us, path_us, sync, weight_bytes

import rollout.engine.engine as engine_module
from rollout.engine.engine import LLMEngine
from rollout.engine.kv import bytes_per_block
from rollout.engine.params import SamplingParams


@dataclasses.dataclass
class Costs:
    """An engine's per-step cost coefficients (bytes read, matmul FLOPs)."""

    weight_bytes: int  # the target's weights and the drafter's own
    kv_bytes_per_token: int  # the target's KV and the drafter's context K/V
    flops_per_token: float  # the target's linear layers and the drafter's context projection
    flops_per_row: float  # the LM head of a logits row
    flops_per_qk: float  # attention: a query times a key, all layers (QK^T and PV)
    flops_per_draft: float  # a drafter block: its layers and its LM head

    @classmethod
    def of(cls, engine: LLMEngine) -> Costs:
        cfg, model, drafter = engine.loaded.config, engine.model, engine.drafter
        linear = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
        elem = model.embed_tokens.weight.element_size()
        costs = cls(weight_bytes(model), bytes_per_block(cfg, 1, elem), 2 * linear,
                    2 * cfg.hidden_size * cfg.vocab_size,
                    4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers, 0.0)
        if drafter is not None:
            draft = drafter.model
            layers = sum(p.numel() for p in draft.layers.parameters() if p.dim() == 2)
            ctx = draft.fc.weight.numel() + sum(a.self_attn.qkv_proj.weight[a.self_attn.q_size:].numel()
                                                for a in draft.layers)
            costs.weight_bytes += weight_bytes(draft)
            costs.kv_bytes_per_token += drafter.bytes_per_block(1)
            costs.flops_per_token += 2 * ctx
            costs.flops_per_draft = 2 * drafter.block * layers + (drafter.block - 1) * costs.flops_per_row
        return costs

    def step_seconds(self, record: tuple, bandwidth: float, rate: float, unique: bool = False) -> float:
        """The step's memory-bound or compute-bound time, whichever is larger; `unique`: KV read
        once per distinct token (a group's shared prompt blocks once), else once per sequence."""
        tokens, rows, context, qk, drafting, distinct = record
        read = self.weight_bytes + (distinct if unique else context) * self.kv_bytes_per_token
        flops = (tokens * self.flops_per_token + rows * self.flops_per_row + qk * self.flops_per_qk
                 + drafting * self.flops_per_draft)
        return max(read / bandwidth, flops / rate)


def profile_attention(engine: LLMEngine, case: dict, prompts, sampling: SamplingParams, steps: int, device: str,
                      after: int = 0) -> dict:
    """Device ms per step of the attention kernels (triton_attention.py, triton_prefix_attention.py)
    and of every kernel, over `steps` steps of a fresh run of the case (`sampling` its samples'
    parameters) once every sample has
    generated `after` tokens (0: half its output length), with the mean context there
    (common.kernel_us; off CUDA: 0); the run is then aborted. `attention_ms` sums the attention
    kernels' times, which with programmatic dependent launch include each one's wait for the kernel
    ahead; `attention_path_ms` is what they add to the stream (common.path_us): the comparison."""
    after = after or case["output_len"] // 2
    if after >= case["output_len"]:
        raise SystemExit(f"--profile-after {after} must be below the case's output length {case['output_len']}")
    engine.add_request("profile", prompts, sampling, n=case["n"], mask=case["mask"])
    sched = engine.scheduler
    while engine.has_unfinished() and (
            sched.waiting or min((s.num_output_tokens for s in sched.running), default=0) < after):
        engine.step()
    context = sum(s.num_tokens for s in sched.running) / max(len(sched.running), 1)
    sync(device)
    trace = kernel_trace(engine.step, steps) if device == "cuda" else []
    kernels = kernel_us(engine.step, steps, trace=trace)
    state = gpu_state() if device == "cuda" else {}  # right after the profiled steps: the clocks they ran at
    engine.abort("profile")
    while engine.has_unfinished():
        engine.step()
    by_kernel = {k: sum(us for name, us in kernels.items() if k in name) / 1e3 for k in ATTENTION_KERNELS}
    return dict(attention_ms=sum(by_kernel.values()), attention_path_ms=path_us(trace, ATTENTION_KERNELS, steps) / 1e3,
                kernels_ms=sum(kernels.values()) / 1e3, profiled_context=context,
                attention_kernels_ms={k: ms for k, ms in by_kernel.items() if ms},
                **{f"profiled_{k}": v for k, v in state.items()})


class StepLog:
    """`with StepLog(block_size) as log:` records every step's (tokens, logits rows, total context,
    sum of query x context, drafting sequences, distinct context) from the engine's build_step.
    Distinct context counts the full prompt blocks of a prompt's samples once (forks share them)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.records: list[tuple] = []

    def __enter__(self) -> StepLog:
        real = self._real = engine_module.build_step

        def build_step(items, num_drafts, *args, **kw):
            step = real(items, num_drafts, *args, **kw)
            context = qk = distinct = 0
            prompts = {}
            for item, k in zip(items, num_drafts):
                seq = item.seq
                end = seq.num_computed_tokens + item.num_new_tokens + k
                shared = min(len(seq.prompt_token_ids) // self.block_size * self.block_size, end)
                prompts[(seq.request_id, seq.prompt_index)] = shared
                context += end
                distinct += end - shared
                qk += (item.num_new_tokens + k) * end
            self.records.append((step.tokens.input_ids.shape[0], step.rows.cu_rows[-1], context, qk,
                                 sum(map(bool, num_drafts)), distinct + sum(prompts.values())))
            return step

        engine_module.build_step = build_step
        return self

    def __exit__(self, *exc) -> None:
        engine_module.build_step = self._real


GPU_STATE = {"sm_mhz": "clocks.sm", "mem_mhz": "clocks.mem", "temp_c": "temperature.gpu", "power_w": "power.draw",
             "throttle": "clocks_throttle_reasons.active"}


def gpu_state() -> dict:
    """The GPU's clocks, temperature, power and active throttle reasons now (nvidia-smi; fields it
    does not know are left out, {} where it is missing): a run's kernels slow down with its clocks,
    so results can say which held."""
    if shutil.which("nvidia-smi") is None:
        return {}
    for keys in (list(GPU_STATE), [k for k in GPU_STATE if k != "throttle"]):  # older / newer names
        values = _smi_query([GPU_STATE[k] for k in keys])
        if values is not None:
            return {k: v if k == "throttle" else _number(v) for k, v in zip(keys, values, strict=True)}
    return {}


def _smi_query(fields: list[str]) -> list[str] | None:
    """One line of `nvidia-smi --query-gpu` for GPU 0, split; None where it fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in out.strip().splitlines()[0].split(",")] if out.strip() else []
    return values if len(values) == len(fields) else None


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text  # "[N/A]"
