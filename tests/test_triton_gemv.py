"""The 1-token projection kernel (rollout/engine/triton_gemv.py) against F.linear, on CPU through
Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU; on a GPU the compiled kernel
runs, in bfloat16 too), its launch rule, and where `linear` takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.engine import triton_gemv
from rollout.engine.moe_launch import Tiles
from rollout.engine.triton_attention import supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not supported(16, torch.float32, DEVICE),
                                reason="triton missing: it ships with xgrammar, a dependency")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _operands(n: int, k: int, dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen)  # [1, K]
    w = torch.randn(n, k, generator=gen) / k**0.5  # [N, K]
    b = torch.randn(n, generator=gen) if bias else None  # [N]
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), None if b is None else b.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "launch"), [
    (64, 256, Tiles(16, 64)),  # whole tiles, several K steps
    (50, 128, Tiles(32, 128, stages=2)),  # N not a multiple of block_n: the last tile masked
    (40, 512, Tiles(16, 256, warps=2, stages=1)),  # one stage: no pipeline
])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_f_linear(dtype, n, k, launch, bias):
    x, w, b = _operands(n, k, dtype, bias)
    got = triton_gemv.gemv(x, w, b, launch)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_gemv_reads_only_its_row_and_a_strided_weight_view():
    """x as one row of a larger buffer, the weight a row slice of a packed one (as q|k|v)."""
    x, w, _ = _operands(96, 256, torch.float32, bias=False, seed=1)
    rows = torch.cat([x, torch.full_like(x, float("nan"))])  # a NaN row the kernel must not read
    part = w[32:]  # [64, 256], stride 256
    got = triton_gemv.gemv(rows[:1], part, None, Tiles(16, 128))
    torch.testing.assert_close(got, F.linear(x, part), atol=1e-5, rtol=1e-5)


def test_gemv_rejects_what_it_cannot_stream():
    x, w, _ = _operands(32, 256, torch.float32, bias=False)
    with pytest.raises(ValueError, match="multiple of 512"):
        triton_gemv.gemv(x, w, None, Tiles(16, 512))
    with pytest.raises(ValueError, match="x \\[1, 256\\]"):
        triton_gemv.gemv(torch.cat([x, x]), w, None, Tiles(16, 128))
    with pytest.raises(ValueError, match="contiguous"):
        triton_gemv.gemv(x, w.t().contiguous().t(), None, Tiles(16, 128))
    with pytest.raises(ValueError, match="block_n and block_k must be >= 16"):
        triton_gemv.gemv(x, w, None, Tiles(8, 128))  # tl.dot's smallest tile


def test_launch_rule():
    """The 8B's projections take the kernel; K not a multiple of its block and weights where cuBLAS
    tied or won (the 30B-A3B's attention projections, small models) keep F.linear."""
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]:
        launch = triton_gemv.launch_for(n, k)
        assert launch is not None and k % launch.block_k == 0 and -(-n // launch.block_n) >= 128
        assert launch == (triton_gemv.NARROW if n == 4096 else triton_gemv.WIDE)  # o and down: 5 stages
    for n, k in [(4096, 4000), (5120, 2048), (2048, 4096), (1024, 1024)]:
        assert triton_gemv.launch_for(n, k) is None


def test_linear_takes_the_kernel_only_for_one_cuda_token(monkeypatch):
    """Off CUDA, for more tokens, float32, or ENABLED off, `linear` is F.linear itself."""
    calls = []
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a: calls.append(a) or F.linear(*a[:3]))
    x, w, b = _operands(64, 256, torch.float32, bias=True)
    for args in [(x, w, b), (torch.cat([x, x]), w, b)]:
        torch.testing.assert_close(triton_gemv.linear(*args), F.linear(*args), atol=0, rtol=0)
    assert not calls  # CPU tensors, float32
    if DEVICE.type == "cuda":
        xb, wb = x.bfloat16(), w.bfloat16()
        triton_gemv.linear(xb, wb)
        assert len(calls) == 1
        monkeypatch.setattr(triton_gemv, "ENABLED", False)
        triton_gemv.linear(xb, wb)
        assert len(calls) == 1


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU engine through the interpreter (bfloat16 on CUDA)")
def test_decode_through_the_kernel_equals_the_torch_engine(tiny_random_qwen3, monkeypatch):
    """One sequence decoding on the Triton backend with every 1-token projection (qkv, o,
    gate|up, down, the LM head) through the kernel: tokens and log-probs are the torch engine's, so each layer
    hands the kernel its own weight and bias."""
    from test_spec_engine import PROMPTS, _generate

    from rollout.engine.params import SamplingParams

    taken, fallback = [], triton_gemv.linear

    def through_the_kernel(x, weight, bias=None):
        if x.shape[0] != 1:
            return fallback(x, weight, bias)
        taken.append(tuple(weight.shape))
        return triton_gemv.gemv(x, weight, bias, Tiles(16, 16))

    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want, _ = _generate(tiny_random_qwen3, PROMPTS[1:2], greedy, kernel_backend="torch")
    monkeypatch.setattr(triton_gemv, "linear", through_the_kernel)
    got, _ = _generate(tiny_random_qwen3, PROMPTS[1:2], greedy, kernel_backend="triton")
    assert len(set(taken)) == 5  # qkv, o, gate|up, down, the LM head: the decode steps' projections
    assert got[0].token_ids == want[0].token_ids
    assert got[0].token_logprobs == pytest.approx(want[0].token_logprobs, abs=1e-4)
