"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step's chain.

A small decode step is a chain of short kernels, and each one's launch and start-up sit between
the previous one's last program and its own first load. With PDL (Hopper and later), a kernel
launched with `launch_pdl` may be scheduled while the kernel before it still runs: each kernel
that opts in calls `start(PDL)`, which waits (griddepcontrol.wait) until the previous kernel has
completed and its writes are visible, then lets the next kernel be launched
(griddepcontrol.launch_dependents). A kernel launched without the attribute (cuBLAS, torch)
waits for its predecessor as usual.

The rule for a kernel that opts in: before `start` it may only read what the kernel launched just
before it does not write (every earlier kernel has completed by then: that one waited for them
before it let this one launch), and it writes nothing. The kernels here read parameters (norm and
router weights) and the step's metadata (positions, slots, sequence lengths) there, nothing built
lazily (torch makes the RoPE table on first use, so RoPE reads it after its wait);
everything else comes after the wait, so the values every kernel computes are those of launches
without PDL (bench_engine.py --compare no-pdl checks the tokens are identical).

`ENABLED` (read at each launch, so a benchmark can flip it; CUDA graphs record what was launched)
turns it on for CUDA tensors; the interpreter never sees it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with xgrammar, a dependency
    triton = None

ENABLED = True


def _supported() -> bool:
    """Whether this Triton launches with PDL and has the grid-dependency instructions."""
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda_extra, "gdc_wait")


SUPPORTED = triton is not None and _supported()

if triton is not None:
    import triton.language as tl

    @triton.jit
    def start(PDL: tl.constexpr):
        """Wait for the previous kernel, then let the next one launch (what a kernel may do
        before this: the module's rule)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


def launch(like: Tensor) -> dict:
    """Keyword arguments for a launch on `like`'s device: the kernel's PDL constexpr and
    Triton's `launch_pdl` option, on for CUDA devices of compute capability 9 or later when ENABLED."""
    on = ENABLED and SUPPORTED and like.is_cuda and _hopper_or_later(like.device.index or 0)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9
