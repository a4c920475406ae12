"""rollout/engine/triton_linear.py: the skinny linear kernel against F.linear (on CPU through
Triton's interpreter, conftest sets TRITON_INTERPRET=1 without a GPU), its fused silu * up and
add + RMSNorm inputs against triton_ops' kernels, the launch rule, and its dispatch. The engine
tests of the Triton backend (test_triton_attention.py, test_triton_moe.py) run the tiny models'
layers through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.engine import triton_linear
from rollout.engine.triton_linear import MAX_TOKENS, Launch, linear, silu_mul_linear, skinny_linear
from rollout.engine.triton_ops import silu_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("num_tokens", [1, 2, 5, MAX_TOKENS])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_f_linear(num_tokens, bias):
    """Ragged output columns (N not a multiple of the block), several K chunks, float32: the sums
    match F.linear to float rounding, for the multiply-add path (1 token) and tl.dot (2-16)."""
    n, k = 72, 192
    x, w = rand(num_tokens, k, seed=1), rand(n, k, scale=0.1, seed=2)
    b = rand(n, seed=3) if bias else None
    launch = Launch(block_n=16 if num_tokens > 1 else 8, block_k=64)
    got = skinny_linear(x, w, b, launch)
    assert got.shape == (num_tokens, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_fused_silu_input_equals_silu_mul_then_linear(num_tokens):
    """The down projection fed gate|up: the kernel's silu(gate) * up (bfloat16-rounded like
    triton_ops.silu_mul) gives F.linear(silu_mul(gate_up)) to float rounding."""
    n, k = 40, 128
    gate_up, w = rand(num_tokens, 2 * k, seed=4), rand(n, k, scale=0.1, seed=5)
    got = skinny_linear(gate_up, w, None, Launch(block_n=16, block_k=64), silu_input=True)
    torch.testing.assert_close(got, F.linear(silu_mul(gate_up), w), atol=1e-5, rtol=1e-5)
    wrong = F.linear(gate_up[:, k:] * F.silu(gate_up[:, k:]), w)  # silu of the wrong half
    assert (got - wrong).abs().max() > 1e-2


def test_bfloat16_single_token_rounds_once():
    """One token in bfloat16 (the decode case on a GPU): float32 sums rounded once, within one
    bfloat16 step (2**-7 relative; Triton's interpreter may round toward zero) of the float32
    product."""
    x, w = rand(1, 256, dtype=torch.bfloat16, seed=6), rand(96, 256, dtype=torch.bfloat16, scale=0.05, seed=7)
    got = skinny_linear(x, w, None, Launch(block_n=32, block_k=128))
    want = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2 ** -7)


def test_bad_shapes_are_refused():
    w = rand(32, 128)
    with pytest.raises(ValueError, match="skinny_linear"):
        skinny_linear(rand(2, 64), w, None, Launch(16, 64))  # K mismatch
    with pytest.raises(ValueError, match="1..16 tokens"):
        skinny_linear(rand(MAX_TOKENS + 1, 128), w, None, Launch(16, 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        skinny_linear(rand(1, 128), w, None, Launch(16, 256))


def test_rule():
    """Few tokens, K a multiple of 64 and a small weight take the kernel; columns per program
    shrink until the grid has ~256 programs (not below 8, or 16 for tl.dot); K chunks divide K."""
    assert Launch.rule(0, 1024, 512) is None and Launch.rule(MAX_TOKENS + 1, 1024, 512) is None
    assert Launch.rule(1, 1024, 100) is None
    assert Launch.rule(1, 4096, 4096) is None  # an 8B projection: cuBLAS (BENCHMARKS.md, issue 17)
    assert Launch.rule(1, 4096, 256) == Launch(block_n=16, block_k=256)  # 256 programs
    assert Launch.rule(1, 2048, 512) == Launch(block_n=8, block_k=512)
    assert Launch.rule(1, 128, 2048).block_n == 8  # a router: the floor
    assert Launch.rule(4, 1536, 256) == Launch(block_n=16, block_k=128)
    assert Launch.rule(1, 1024, 192).block_k == 64


def test_linear_dispatch(monkeypatch):
    """`linear` takes the kernel for a decode-sized step and F.linear for a prefill-sized one;
    `silu_mul_linear` says None where the kernel does not apply."""
    calls = []
    real = triton_linear.skinny_linear
    monkeypatch.setattr(triton_linear, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    w = rand(64, 128, scale=0.1)
    for t in (1, 8, 64):
        torch.testing.assert_close(linear(rand(t, 128), w), F.linear(rand(t, 128), w), atol=1e-5, rtol=1e-5)
    assert calls == [(1, 128), (8, 128)]
    assert silu_mul_linear(rand(64, 256), w) is None
    assert silu_mul_linear(rand(2, 256), w) is not None and calls[-1] == (2, 256)
    assert linear(rand(1, 128, dtype=torch.float64), w.double()).dtype == torch.float64  # F.linear: no kernel


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_fused_add_norm_equals_add_rms_norm_then_linear(num_tokens):
    """The projection after a residual add and RMSNorm (a layer's qkv, a dense MLP's gate|up):
    the same product as triton_ops.add_rms_norm then F.linear, and the same residual sum."""
    from rollout.engine.triton_ops import add_rms_norm

    n, k = 56, 192
    x, res, norm = rand(num_tokens, k, seed=8), rand(num_tokens, k, seed=9), rand(k, seed=10) + 1.0
    w, b = rand(n, k, scale=0.1, seed=11), rand(n, seed=12)
    normed, want_total = add_rms_norm(x, res, norm, 1e-6)
    got, total = skinny_linear(x, w, b, Launch(block_n=16, block_k=64), add_norm=(res, norm, 1e-6))
    torch.testing.assert_close(total, want_total, atol=0, rtol=0)
    torch.testing.assert_close(got, F.linear(normed, w, b), atol=1e-5, rtol=1e-5)
    unnormed = F.linear(x + res, w, b)
    assert (got - unnormed).abs().max() > 1e-2
    assert triton_linear.add_norm_linear(rand(64, k), rand(64, k), norm, 1e-6, w) is None  # prefill-sized
