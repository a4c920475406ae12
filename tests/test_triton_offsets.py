"""The Triton kernels index memory with 64-bit offsets (issue 14): a 262,144-token step of the
Qwen3-8B shape put token x width (262,144 x 2 x 12,288 for the MLP's gate|up) past 2**31 and
crashed with an illegal memory access.

Built without 2**31 real elements: the inputs are views over a sparse file (torch.from_file,
shared), so only the few pages the kernels touch exist. Their rows, or the KV pool's blocks, sit
past 2**31 elements from the view's start, and the view itself starts 2**31 elements into the
file, so an offset that wrapped in 32 bits still lands inside the file (on zeros) and gives a
wrong value instead of a crash. Each kernel must give exactly what it gives on the same data
laid out compactly. CPU only: the kernels run through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_attention import _ragged_case

from rollout.engine.attention import write_kv
from rollout.engine.triton_attention import paged_attention_triton, supported
from rollout.engine.triton_ops import add_rms_norm, qk_norm_rope_store, silu_mul

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not supported(16, torch.float32, torch.device("cpu")),
                                reason="the interpreter on CPU (sparse host memory), with triton present")

WRAP = 1 << 31  # 32-bit offsets wrap here
FAR_STRIDE = (1 << 30) + 64  # a row stride whose row 2 lies past WRAP


@pytest.fixture
def sparse(tmp_path):
    """sparse(numel, dtype): a tensor over a sparse file, whose element 0 is WRAP elements in."""
    files = iter(range(1000))

    def make(numel: int, dtype: torch.dtype) -> torch.Tensor:
        path = tmp_path / f"sparse{next(files)}"
        return torch.from_file(str(path), shared=True, size=WRAP + numel, dtype=dtype)[WRAP:]

    return make


def far_rows(sparse, rows: torch.Tensor) -> torch.Tensor:
    """The same values as rows ([N, W]), row i at element i * FAR_STRIDE of a sparse file."""
    n, width = rows.shape
    view = sparse((n - 1) * FAR_STRIDE + width, rows.dtype).as_strided((n, width), (FAR_STRIDE, 1))
    view.copy_(rows)
    return view


def test_silu_mul_with_rows_past_2_31(sparse):
    gate_up = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(0))
    want = silu_mul(gate_up)
    assert torch.equal(silu_mul(far_rows(sparse, gate_up)), want)


def test_add_rms_norm_with_rows_past_2_31(sparse):
    gen = torch.Generator().manual_seed(1)
    x, res, weight = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen), torch.rand(40) + 0.5
    want = add_rms_norm(x, res, weight, 1e-6)
    got = add_rms_norm(far_rows(sparse, x), far_rows(sparse, res), weight, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _pool(sparse, blocks: int, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """A contiguous [blocks, BS, Hkv, D] float32 KV pool over a sparse file."""
    return sparse(blocks * block_size * kv_heads * head_dim, torch.float32).view(blocks, block_size, kv_heads,
                                                                                  head_dim)


def test_qk_norm_rope_store_with_rows_and_slots_past_2_31(sparse):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen)
    positions, table = torch.tensor([0, 5, 9]), torch.randn(16, 2 * dim, generator=gen)
    q_w, k_w = torch.rand(dim, generator=gen) + 0.5, torch.rand(dim, generator=gen) + 0.5
    far_block = WRAP // (block_size * kv_heads * dim)  # slot x slot stride reaches 2**31 here
    caches = [torch.zeros(3, block_size, kv_heads, dim) for _ in range(2)]
    far = [_pool(sparse, far_block + 3, block_size, kv_heads, dim) for _ in range(2)]
    slots = torch.tensor([1, 6, 11])
    want = qk_norm_rope_store(qkv, positions, table, q_w, k_w, 1e-6, heads, kv_heads, dim, *caches, slots)
    got = qk_norm_rope_store(far_rows(sparse, qkv), positions, table, q_w, k_w, 1e-6, heads, kv_heads, dim,
                             *far, slots + far_block * block_size)
    assert torch.equal(got, want)
    for pool, cache in zip(far, caches, strict=True):
        assert torch.equal(pool[far_block:], cache)


@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
def test_paged_attention_reads_blocks_past_2_31(sparse, table_dtype):
    """The engine's tables are int64; with int32 ones block id x block stride wrapped until the
    kernel widened the loaded block id."""
    q, k, v, k_cache, v_cache, meta = _ragged_case([1, 5], [70, 9], 4, 2, 16, 4)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    args = (meta.context_lens, meta.cu_seqlens_q, meta.max_query_len, meta.max_context_len, 0.25)
    want = paged_attention_triton(q, k_cache, v_cache, meta.block_tables, *args)
    far_block = WRAP // k_cache[0].numel()
    far = []
    for cache in (k_cache, v_cache):
        pool = _pool(sparse, far_block + cache.shape[0], *cache.shape[1:])
        pool[far_block:] = cache
        far.append(pool)
    tables = (meta.block_tables + far_block).to(table_dtype)
    assert torch.equal(paged_attention_triton(q, *far, tables, *args), want)
