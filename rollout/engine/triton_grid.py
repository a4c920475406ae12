"""Grids of persistent Triton kernels: how many programs of a compiled kernel an SM holds at once.

A kernel whose programs take their work from a queue or a stride (the shared-prefix item kernels)
needs no more programs than fit on the device at once: one more only starts once another has
ended, finds nothing left, and exits, yet each still waits for a free slot (for a kernel holding
82 KB of shared memory, two an SM). A CUDA graph's grid is sized for its capacity, thousands of
programs where a step has a few hundred items of work, so those empty programs would run in
waves after the real ones. `resident_programs` reads the compiled kernel's registers, shared
memory and warps (compiling it first if need be, which a launch would do anyway) and gives the
programs that fit on every SM at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with xgrammar, a dependency
    triton = None

INTERPRETER_PROGRAMS = 2  # the interpreter runs programs one after another: two exercise the loops


@dataclass(frozen=True)
class SmLimits:
    """One SM's resources (sm_80 / sm_90 values by default)."""

    registers: int = 65536
    shared_bytes: int = 233472  # 228 KB
    threads: int = 2048
    programs: int = 32
    quarters: int = 4  # the register file is split among 4 schedulers; a warp's registers lie in one
    reserved_shared: int = 1024  # shared memory the hardware keeps per program


def programs_per_sm(n_regs: int, shared_bytes: int, num_warps: int, limits: SmLimits = SmLimits()) -> int:
    """Programs of a kernel (n_regs a thread, shared_bytes and num_warps a program) resident on
    one SM at once: the least that registers (a warp's allocated in units of 256, per scheduler),
    shared memory, threads and the program cap allow. At least 1."""
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    warps_by_regs = limits.quarters * (limits.registers // limits.quarters // warp_regs)
    by_regs = warps_by_regs // num_warps
    by_shared = limits.shared_bytes // (shared_bytes + limits.reserved_shared)
    by_threads = limits.threads // (num_warps * 32)
    return max(1, min(by_regs, by_shared, by_threads, limits.programs))


def resident_programs(kernel, device: torch.device, args: tuple, options: dict) -> int:
    """Programs of `kernel` (a triton.jit function) launched with `args` and `options` (its
    constexprs and num_warps / num_stages) that the whole device holds at once. Off CUDA (the
    interpreter), INTERPRETER_PROGRAMS."""
    if device.type != "cuda" or triton is None:
        return INTERPRETER_PROGRAMS
    index = device.index or 0
    dtypes = tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args)
    key = (kernel, index, dtypes, tuple(sorted(options.items())))
    if key not in _per_sm_cache:
        _per_sm_cache[key] = compiled_programs_per_sm(kernel, args, options, _limits(index))
    return _per_sm_cache[key] * _sm_count(index)


def compiled_programs_per_sm(kernel, args: tuple, options: dict, limits: SmLimits) -> int:
    """programs_per_sm of `kernel` compiled for `args` and `options` (Triton's warmup: compiled as
    a launch would, or taken from its cache, and not run)."""
    compiled = kernel.warmup(*args, grid=(1,), **options)
    compiled._init_handles()
    return programs_per_sm(compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps, limits)


_per_sm_cache: dict = {}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _limits(index: int) -> SmLimits:
    """This device's SM limits: shared memory from the driver (the per-program opt-in maximum plus
    the reserved kilobyte), threads from torch; registers and the program cap of sm_80 / sm_90."""
    shared = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    threads = torch.cuda.get_device_properties(index).max_threads_per_multi_processor
    return SmLimits(shared_bytes=shared + SmLimits.reserved_shared, threads=threads)
