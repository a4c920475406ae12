"""Speculative drafters: DFlash and DSpark block drafters, and the rollout-history drafter, behind
the engine's `Drafter` interface (rollout.engine.drafter).

draft_model.py is the drafter network, draft_loader.py reads, checks and writes its published
checkpoint layouts, draft_graphs.py replays its block forward as CUDA graphs, and proposer.py
is `BlockDrafter` plus `build_drafter`, the factory `rollout.build_engine` hands the engine.
history_drafter.py is `--spec history` (no model: drafts from the samples already generated for
the same prompt), over history_store.py (a worker thread storing finished samples, snapshots for
the drafter), history.py (the bounded per-prompt store) and suffix.py (its automaton). combined.py
is `--spec dflash+history` / `dspark+history`: per request and step, the proposer with the higher
expected accepted length drafts.
spec imports the engine (its interface, model layers, sampler draws); the engine never imports
spec. Verification, which keeps every drafter lossless, lives with the engine
(rollout.engine.verify, docs/verification.md).
"""
