"""Launch parameters of shared-prefix attention: the one table to edit after a GPU sweep
(benchmarks/bench_prefix_attention.py --sweep times variants of these fields on the issue's
shapes and prints which is fastest).

Host only (no torch, no triton): the planner (prefix_plan.py) cuts work items by `block_m`,
`block_n`, `target_programs`, `min_chunk`, `fuse_suffix` and (with a lone pass) `lone_max_keys`,
shares only the groups that `SHARE_RULE` (the measured crossover) admits, and drops whole steps
where `enabled` is False or no group is left (the plain paged kernel runs them); the kernels
(triton_prefix_attention.py) compile with the same `block_m`, `block_n`, `num_warps` and
`num_stages`, and the lone pass with its `lone_*` fields, read from the plan, so the two always
agree. A step's parameters depend on its longest query alone (`pick`): a CUDA
graph captured for a query length replays with the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """How one step's shared-prefix attention is cut and compiled."""

    block_m: int = 64  # query rows (token x query head of one KV head) per shared unit's item
    block_n: int = 64  # keys per inner iteration; key chunks are multiples of it
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the key loads
    target_programs: int = 512  # cut key ranges into chunks until about this many (item, KV head) pairs
    min_chunk: int = 256  # keys: a shorter chunk is not worth its partial result
    fuse_suffix: bool = True  # a group member's own keys join its group's items (no partial result)
    enabled: bool = True  # False: steps of this kind run the plain paged kernel
    index32: bool = False  # key rows' offsets in int32 where every element of the caches lies within 2**31 of
    # their start (triton_prefix_tiles.index32_fits; else int64): fewer instructions a tile
    # Lone units' items (suffixes read alone, sequences in no group) in a launch of their own after
    # the shared units', compiled with these: a lean body fits more programs on an SM than the
    # shared one, and short items are bound by their chain of dependent loads, not by bandwidth.
    # Always so where their row tile differs from block_m; lone_pass asks for it where it does not.
    lone_pass: bool = False
    lone_all_heads: bool = False  # decode steps: a lone item's every head in one program, key tiles of
    # lone_block_n // KV heads keys x every KV head (all of a key's heads in one contiguous read)
    lone_block_n: int = 64
    lone_num_warps: int = 4
    lone_num_stages: int = 2
    lone_max_keys: int = 0  # cut a lone unit's keys into chunks of at most this many (0: no cap)
    lone_merge: bool = True  # the all-heads lone pass merges each token's partial results (no merge
    # kernel) where every token has a lone unit (no fused suffixes); False: the merge kernel does
    lone_lazy_rescale: bool = False  # the all-heads lone pass's online softmax moves a row's reference max only
    # where a tile's scores pass it by more than triton_prefix_tiles.LAZY_SLACK (one branch a tile): most
    # tiles then skip rescaling their accumulator

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "lone_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for warps, stages in ((self.num_warps, self.num_stages), (self.lone_num_warps, self.lone_num_stages)):
            if warps not in (1, 2, 4, 8, 16) or stages < 1:
                raise ValueError(f"num_warps must be a power of two <= 16 and num_stages >= 1, got {warps}, {stages}")
        if self.lone_max_keys and self.lone_max_keys < self.block_n:
            raise ValueError(f"lone_max_keys must be 0 (no cap) or >= block_n, got {self.lone_max_keys}")
        if self.target_programs < 1 or self.min_chunk < self.block_n:
            raise ValueError(f"need target_programs >= 1 and min_chunk >= block_n, got "
                             f"{self.target_programs}, {self.min_chunk}")


def lone_launch(config: LaunchConfig, suffix_block_m: int) -> bool:
    """Whether lone units' items run in a launch of their own (a lone pass): asked for, or their row
    tile differs from the shared units' (one kernel would hold both bodies)."""
    return config.lone_pass or config.block_m != suffix_block_m


@dataclass(frozen=True)
class LaunchConfigs:
    """Decode steps (one query per sequence) and the rest (verify blocks, prefill chunks beside
    them) differ: 4 query rows of a sequence per KV head against 36 at 9 verify tokens."""

    decode: LaunchConfig
    verify: LaunchConfig

    def pick(self, max_query_len: int) -> LaunchConfig:
        return self.decode if max_query_len <= 1 else self.verify


# Measured on the H200 (benchmarks/results/prefix_attention_notes.md, "Results", "The lone pass" and
# "Five stages"; ms per layer call, ratio to the plain kernel): lone units' items in a lone pass of
# their own, in decode steps every head of a token in one program with key tiles of 16 keys x 8 KV
# heads and lone units cut at 256 keys (32x8x1024 q=1 0.420 against 0.536 with suffixes in the shared
# launch; uncut, a step of 16 groups beside 128 long sequences alone lost to plain: 1.169, cut 0.966),
# in verify steps per KV head in tiles of 32 keys, uncut (that mixed step 1.005 uncut, 1.172 cut).
# Five pipeline stages: a key tile's copies hang off its block-id load, and with fewer stages
# Triton's pipeliner waits for every copy at the top of each iteration, so no copy overlaps the
# tile before it (decode's shared pass 51 -> 44 us at 32x8x1024, 91 -> 78 at 16x16x4096; with 32-key
# tiles, whose five stages fit two programs an SM). The all-heads lone pass is faster at two stages,
# and with the lazy rescale (28.4 against 30.0 us at 32x8x1024, twenty-first session, calls 3-4; in the
# shared pass it lost, 45.0 against 42.6: the branch's reduction adds three barriers to its key loop).
# Key offsets in int32 where the caches fit (twenty-second session): decode's layer call 69.3 against 70.6 us
# at 32x8x1024 and 102.9 against 104.9 at 16x16x4096 (call 1), the goal step's attention 2.854 against 2.998 ms
# a step (call 2, medians of four rounds side by side); verify's (9 queries) 0.225 against 0.258 ms and 0.507
# against 0.582 (call 2).
DEFAULT_LAUNCH = LaunchConfigs(
    decode=LaunchConfig(block_m=64, block_n=32, num_warps=4, num_stages=5, target_programs=256, fuse_suffix=False,
                        lone_pass=True, lone_all_heads=True, lone_block_n=128, lone_num_warps=4, lone_num_stages=2,
                        lone_max_keys=256, lone_lazy_rescale=True, index32=True),
    verify=LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=5, target_programs=256, fuse_suffix=False,
                        lone_pass=True, lone_block_n=32, lone_num_warps=4, lone_num_stages=5, index32=True),
)


@dataclass(frozen=True)
class GroupRule:
    """The least a group needs to be read through the shared-prefix kernel: members (sequences
    holding the same blocks) and its own shared keys (the unit's key range, tokens)."""

    min_members: int = 2
    min_keys: int = 1


@dataclass(frozen=True)
class ShareRule:
    """Which groups the planner shares, by the kind of their rows: decode (every member's query is
    one token) or verify (longer queries, at most `max_verify_query_len`). Each kind has steps of
    GroupRules, a group sharing where any of them admits it (the fewer members, the more keys a
    group needs to win). A group that fails it is not shared: its members read their whole
    context alone, and a step with no group left runs the plain paged kernel. The
    default-constructed rule shares every group (tests)."""

    decode: tuple[GroupRule, ...] = (GroupRule(),)
    verify: tuple[GroupRule, ...] = (GroupRule(),)
    max_verify_query_len: int = 1 << 30

    def __post_init__(self) -> None:
        for kind in ("decode", "verify"):
            steps = getattr(self, kind)
            if not steps or not all(isinstance(step, GroupRule) for step in steps):
                raise ValueError(f"{kind} must be a non-empty tuple of GroupRules, got {steps!r}")


# Measured on the H200 with the default launch (notes: "The lone pass", crossover run), ratio of
# the shared-prefix kernel to the plain one per layer call, P prompts x n samples x prompt tokens,
# samples' own tokens uniform in [1, 150]:
# - decode: wins at n=8 / 256 (0.803), n=8 / 512 (0.592), n=4 / 1024 (0.607), n=8 / 1024 (0.426),
#   n=16 / 4096 (0.182); n=2 / 1024 only just (0.940): left to the plain kernel.
# - verify (q=9): wins at n=4 / 1024 (0.836), n=8 / 1024 (0.741), n=16 / 4096 (0.550); loses at
#   n=8 / 256 (1.152) and n=2 / 1024 (1.027); nothing measured past q=9. n=8 / 512 won then (0.921)
#   and loses at five stages (1.089, sixteenth session, call 3: the plain kernel's verify got
#   faster, 0.40 -> 0.32 ms at 32x8x1024), where n=4 / 1024 still wins (0.948): 1024 keys.
# Again with int32 offsets in both kernels (twenty-second session, calls 5-6; 256 sequences a step, 128 at
# 4096 tokens), smaller groups win from more keys:
# - decode: n=2 loses at 256 (1.167), ties at 512 (0.975), wins from 1024 (0.830; 2048 0.739, 4096 0.685);
#   n=3 wins from 512 (0.792; 1024 0.667); n=4 from 256 (0.892; 512 0.680); n=8 / 256 0.731.
# - verify: n=2 loses to 1024 (1.581, 1.256, 1.023), wins from 2048 (0.872; 4096 0.780); n=3 loses at
#   512 (1.081), wins at 1024 (0.851); n=4 loses at 512 (1.099), wins at 1024 (0.852); n=8 / 512 1.030.
SHARE_RULE = ShareRule(
    decode=(GroupRule(min_members=4, min_keys=256), GroupRule(min_members=3, min_keys=512),
            GroupRule(min_members=2, min_keys=1024)),
    verify=(GroupRule(min_members=3, min_keys=1024), GroupRule(min_members=2, min_keys=2048)),
    max_verify_query_len=9)


MAX_FUSED_SEGMENTS = 32  # past this many segments a row tile's lookup spills registers: suffixes read alone


def max_segments(block_m: int, groups: int) -> int:
    """Most sequences one row tile of `block_m` rows (token x query head, `groups` heads a
    token) holds, as a power of two: the kernel's bound on a tile's fused suffix segments."""
    tokens = block_m // groups if block_m % groups == 0 else block_m // groups + 2
    return 1 << max(tokens - 1, 0).bit_length()
