"""Grids of the persistent Triton kernels: programs an SM holds at once, from a compiled kernel's
registers, shared memory and warps (triton_grid)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout.engine.triton_grid import (
    INTERPRETER_PROGRAMS,
    SmLimits,
    compiled_programs_per_sm,
    programs_per_sm,
    resident_programs,
)

KB = 1024


@pytest.mark.parametrize("n_regs, shared, warps, expected", [
    (255, 80 * KB, 4, 2),  # the shared pass: registers and shared memory both allow 2
    (208, 82 * KB, 4, 2),  # the all-heads lone pass: shared memory
    (168, 0, 4, 3),  # 168 x 32 = 21 units of 256: 3 warps a scheduler, 12 an SM
    (169, 0, 4, 2),  # one more register rounds a warp up to 22 units: 2 warps a scheduler
    (96, 20 * KB, 4, 5),  # 5 warps a scheduler; shared memory would allow 10
    (128, 150 * KB, 4, 1),  # one program's shared memory only
    (16, 0, 16, 4),  # threads: 2048 / 512
    (8, 0, 1, 32),  # the program cap
    (255, 300 * KB, 8, 1),  # fits nowhere by these numbers: still 1 (the launch fails, not the grid)
])
def test_programs_an_sm_holds_are_the_least_its_resources_allow(n_regs, shared, warps, expected):
    assert programs_per_sm(n_regs, shared, warps) == expected


def test_limits_change_the_answer():
    assert programs_per_sm(64, 50 * KB, 4) == 4
    assert programs_per_sm(64, 50 * KB, 4, SmLimits(shared_bytes=164 * KB)) == 3  # an A100's shared memory
    assert programs_per_sm(32, 0, 4) == 16 and programs_per_sm(32, 0, 4, SmLimits(threads=1536)) == 12


class FakeKernel:
    """A jit function's warmup: records what it was asked to compile, returns compiled metadata."""

    def __init__(self, n_regs, shared, num_warps):
        self.calls = []
        self.compiled = SimpleNamespace(n_regs=n_regs, metadata=SimpleNamespace(shared=shared, num_warps=num_warps),
                                        _init_handles=lambda: None)

    def warmup(self, *args, grid, **options):
        self.calls.append((args, grid, options))
        return self.compiled


def test_a_compiled_kernel_is_read_for_its_registers_shared_memory_and_warps():
    kernel = FakeKernel(n_regs=255, shared=80 * KB, num_warps=4)
    x = torch.zeros(3)
    assert compiled_programs_per_sm(kernel, (x, 7), dict(BLOCK=32, num_warps=4), SmLimits()) == 2
    (args, grid, options), = kernel.calls
    assert args[0] is x and args[1] == 7 and grid == (1,) and options == dict(BLOCK=32, num_warps=4)


def test_off_cuda_the_interpreter_gets_a_fixed_count_without_compiling():
    kernel = FakeKernel(n_regs=32, shared=0, num_warps=4)
    assert resident_programs(kernel, torch.device("cpu"), (), {}) == INTERPRETER_PROGRAMS
    assert kernel.calls == []
