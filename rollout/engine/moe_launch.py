"""Launch parameters of the fused MoE kernels (triton_moe.py), one entry per token-count bucket.

A step of T tokens makes T * k (token, expert) pairs. Two paths compute the same function:

* "gemv" (1-token steps): no sort. gate/up runs a program per (pair, column tile)
  that routes its own token from the router logits (top-k in the program: no routing launch)
  and streams its expert's rows; down runs a program per (token, column tile) that reads the
  token's k experts at once and sums them weighted (no separate sum). Three launches per layer
  with the router's GEMM. A pair re-reads its expert even when another pair shares it, so this
  wins while few pairs share experts.
  With `router_in_norm` the router's GEMV runs inside the residual add + RMSNorm launch before
  the block (triton_ops.add_rms_norm_router): two launches per layer's MoE, not three.
* "sorted" (larger steps): route, align the pairs into `block_m`-row blocks of one expert each,
  two grouped GEMMs (tl.dot) that read each touched expert once per block, then the sum of
  each token's k rows.

`Tiles` are one kernel's launch parameters: `block_n` output columns per program, `block_k`
reduction elements per iteration, `warps`, and `stages` of Triton's software pipeline (which
pipelines the loads that feed tl.dot: every kernel's but the gemv down's, which loads its next
tile ahead itself). The dense 1-token projection kernel (triton_gemv.py) takes them too. The
table's values were picked for Qwen3-30B-A3B (hidden 2048, 128 experts, top 8, width 768) on an
H200 with `benchmarks/bench_moe.py`, which times variants of every entry; any valid `Tiles`
computes the same result (tests/test_triton_moe.py runs every entry of the table).
"""

from __future__ import annotations

from dataclasses import dataclass

PATHS = ("gemv", "sorted")


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class Tiles:
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "warps"):
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"Tiles.{name} must be a power of two, got {getattr(self, name)}")
        if self.stages < 1:
            raise ValueError(f"Tiles.stages must be >= 1, got {self.stages}")

    def __str__(self) -> str:
        return f"n{self.block_n}/k{self.block_k}/w{self.warps}/s{self.stages}"


@dataclass(frozen=True)
class MoeLaunch:
    path: str  # one of PATHS
    gate_up: Tiles
    down: Tiles
    block_m: int = 16  # rows per expert block (sorted path; tl.dot needs >= 16)
    route_inside: bool = True  # gemv path: gate/up programs route their token (False: a routing launch first)
    router_in_norm: bool = False  # the router's logits come from the norm's launch (add_rms_norm_router)

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"MoeLaunch.path must be one of {PATHS}, got {self.path!r}")
        if self.path == "sorted" and (self.block_m < 16 or not _power_of_two(self.block_m)):
            raise ValueError(f"MoeLaunch.block_m must be a power of two >= 16, got {self.block_m}")
        dots = (self.gate_up, self.down) if self.path == "sorted" else (self.gate_up,)  # kernels with tl.dot
        if min(n for tiles in dots for n in (tiles.block_n, tiles.block_k)) < 16:
            raise ValueError(f"the {self.path} path's tl.dot tiles must be >= 16, got {self}")

    def __str__(self) -> str:
        rows = f" m{self.block_m}" if self.path == "sorted" else ("" if self.route_inside else " routed")
        router = " router-in-norm" if self.router_in_norm else ""
        return f"{self.path}{rows}{router} gate_up {self.gate_up} down {self.down}"


# (largest token count of the bucket, launch), by increasing token count; the last entry takes
# every larger step too. Measured on the H200 (bench_moe.py, whole layer with the router GEMM;
# BENCHMARKS.md issue 21). 1 token (2026-12-02, `bench_moe_gate_up_h200.json`): 33.3 us with the
# gate/up tiles n32/k64/s5 (every tile within 18.7-19.4 us) and the n8/k256/w8 down, against 40.9
# for the elementwise gate/up of 2026-12-01; the router in the norm's launch 4.3 us against 7.5 for
# the norm and the router's GEMM. Steps of 2-16 tokens: the gemv path's 3% at 8 tokens was on random
# routing, where few of the 64 pairs share an expert, and the engine at batch 8 showed nothing; the
# router in the norm's launch there decoded batch 4 at 0.972x and batch 8 at 0.997x. 2026-12-01: 16
# tokens sorted 215 vs gemv >= 291; 64 tokens 357 us, 512 tokens (64-row blocks) 517 us; the sorted
# entries' tiles are the sweep's fastest per phase.
LAUNCHES: tuple[tuple[int, MoeLaunch], ...] = (
    (1, MoeLaunch("gemv", gate_up=Tiles(32, 64, 4, 5), down=Tiles(8, 256, 8, 2), router_in_norm=True)),
    (16, MoeLaunch("sorted", gate_up=Tiles(32, 128, 4, 3), down=Tiles(64, 128, 4, 3), block_m=16)),
    (256, MoeLaunch("sorted", gate_up=Tiles(128, 128, 8, 2), down=Tiles(64, 128, 4, 3), block_m=16)),
    (1024, MoeLaunch("sorted", gate_up=Tiles(64, 64, 4, 3), down=Tiles(128, 64, 4, 3), block_m=64)),
)


def launch_for(num_tokens: int, path: str | None = None) -> MoeLaunch:
    """The table's launch for a step of `num_tokens` tokens; with `path`, the first entry of
    that path whose bucket holds the step, else that path's last entry."""
    entries = [(most, launch) for most, launch in LAUNCHES if path in (None, launch.path)]
    if not entries:
        raise ValueError(f"the launch table has no {path!r} entry")
    return next((launch for most, launch in entries if num_tokens <= most), entries[-1][1])
