"""The shared-prefix launch variants the benchmarks time: one LaunchConfig each, for decode and
verify steps alike (bench_prefix_attention.py --sweep / --variants), and `use_prefix_launch`, which
makes engines built after it use named variants (bench_rl.py --prefix-launch).
Names stay once measured, so the commands in BENCHMARKS.md still run. Host only: importing it
touches no device and chooses no Triton mode."""

from __future__ import annotations

from dataclasses import replace

from rollout.engine import prefix_launch
from rollout.engine.prefix_launch import DEFAULT_LAUNCH, LaunchConfig

# The sweep: one LaunchConfig for both kinds of step (predictions: prefix_attention_notes.md).
# The first sweep (fused layouts, tile shapes) is recorded in the notes; these time the lone pass:
# suffixes and sequences alone in a second, lean launch (LaunchConfig.lone_pass). Variants measured
# and dropped (other lone tiles and warps, m32 shared tiles beside a lone pass): the notes.
SEPARATE = dict(fuse_suffix=False)
LONE = dict(SEPARATE, lone_pass=True)
HEADS = dict(LONE, lone_all_heads=True, lone_block_n=128, lone_max_keys=256)
VARIANTS = {
    "separate": LaunchConfig(**SEPARATE),  # the default before the lone pass (then one launch; now two)
    "fused": LaunchConfig(),
    "m32t128": LaunchConfig(block_m=32, target_programs=128, **SEPARATE),
    "lone": LaunchConfig(lone_block_n=32, **LONE),  # lone pass m16 n32 w4 s2: 96 registers (5 CTAs / SM)
    "lone_t256": LaunchConfig(target_programs=256, lone_block_n=32, **LONE),
    # decode: every head of a lone item in one program, key tiles of lone_block_n // 8 keys x 8 KV heads
    "heads": LaunchConfig(target_programs=256, lone_all_heads=True, lone_block_n=64, **LONE),
    "heads_s3": LaunchConfig(target_programs=256, lone_all_heads=True, lone_block_n=64, lone_num_stages=3, **LONE),
    "heads_n32": LaunchConfig(target_programs=256, lone_all_heads=True, lone_block_n=32, **LONE),
    "heads_n128": LaunchConfig(target_programs=256, lone_all_heads=True, lone_block_n=128, **LONE),
    # the decode default with lone units cut shorter (measured: no faster; the notes say why)
    "cut64": LaunchConfig(target_programs=256, lone_all_heads=True, lone_block_n=128, lone_max_keys=64, **LONE),
    "cut128": LaunchConfig(target_programs=256, lone_all_heads=True, lone_block_n=128, lone_max_keys=128, **LONE),
    # deeper pipelines: a key tile's loads hang off a block-id load, and below 5 stages Triton's
    # pipeliner waits for every copy at the top of each iteration (async_wait num 0: no overlap)
    "s5n32": LaunchConfig(block_n=32, num_stages=5, target_programs=256, **HEADS),
    "s5n64": LaunchConfig(num_stages=5, target_programs=256, **HEADS),
    "lone64s5": LaunchConfig(target_programs=256, **dict(HEADS, lone_block_n=64, lone_num_stages=5)),
    "lone128s5": LaunchConfig(target_programs=256, **dict(HEADS, lone_num_stages=5)),
    "s5n32_lone64s5": LaunchConfig(block_n=32, num_stages=5, target_programs=256,
                                   **dict(HEADS, lone_block_n=64, lone_num_stages=5)),
    "s5n32_lone32s5": LaunchConfig(block_n=32, num_stages=5, target_programs=256,
                                   **dict(HEADS, lone_block_n=32, lone_num_stages=5)),
    # the defaults before five stages (decode and verify), and the fused layout at five stages
    "s3": LaunchConfig(target_programs=256, **HEADS),
    "s3_verify": LaunchConfig(target_programs=256, **dict(LONE, lone_block_n=32)),
    "fused_s5n32": LaunchConfig(block_n=32, num_stages=5, target_programs=256),
    "fused_s5n32_t512": LaunchConfig(block_n=32, num_stages=5, target_programs=512),
    # decode's default with the merge kernel after the lone pass (before the lone pass merged)
    "merge_kernel": replace(DEFAULT_LAUNCH.decode, lone_merge=False),
    # decode's default whose lone pass's online softmax rescales only where a tile's scores pass the reference max
    # by more than LAZY_SLACK (sm_90, Triton 3.6: its key loop 833 -> 865 instructions a tile, ~40 of them
    # skipped when it does not rescale; in both passes, "lazy" at d27c069, the shared pass lost: 45.0 against
    # 42.6 us, its loop three barriers longer)
    "lone_lazy": replace(DEFAULT_LAUNCH.decode, lone_lazy_rescale=True),  # the default since call 4
    "lone_eager": replace(DEFAULT_LAUNCH.decode, lone_lazy_rescale=False),  # the default before
    # key rows' offsets in int32 (sm_90, Triton 3.6: the shared key loop 379 -> 324 instructions a tile, its
    # 64-bit address products gone; the lone loop 865 -> 845, the default's lazy rescale kept): decode's default
    # since the twenty-second session's call 1; "i64" is the default before. (Measured and removed there:
    # "halves", decode's lone pass in two halves of the query heads, its loop 836 instructions against 865 but
    # 28.95 against 28.23 us a call, 29.6 against 28.0 with int32 offsets.)
    "i32": replace(DEFAULT_LAUNCH.decode, index32=True),
    "i64": replace(DEFAULT_LAUNCH.decode, index32=False),
    # verify's launch with int32 and int64 offsets (for --queries 9: "i32" there is decode's launch, not
    # verify's); int32 is verify's default since the twenty-second session's call 2
    "verify_i32": replace(DEFAULT_LAUNCH.verify, index32=True),
    "verify_i64": replace(DEFAULT_LAUNCH.verify, index32=False),
}


def launch_names(names: str | None) -> tuple[str, str]:
    """--prefix-launch's DECODE[,VERIFY] as (decode, verify) variant names; one name: both; None: "default"."""
    decode, verify = ((names or "default").split(",") * 2)[:2]
    return decode, verify


def use_prefix_launch(names: str | None) -> None:
    """Engines built after this use the named launch variants (--prefix-launch) for shared-prefix
    attention (prefix_plan.planner_for reads prefix_launch.DEFAULT_LAUNCH when an engine is built);
    None: the defaults again."""
    decode, verify = launch_names(names)
    pick = lambda name, default: default if name == "default" else VARIANTS[name]  # noqa: E731
    prefix_launch.DEFAULT_LAUNCH = prefix_launch.LaunchConfigs(pick(decode, DEFAULT_LAUNCH.decode),
                                                               pick(verify, DEFAULT_LAUNCH.verify))
    if names is None:
        return
    print(f"shared-prefix launch: {prefix_launch.DEFAULT_LAUNCH}", flush=True)
