"""Speculative drafters: DFlash and DSpark block drafters behind the engine's `Drafter`
interface (rollout.engine.drafter).

draft_model.py is the drafter network, draft_loader.py reads, checks and writes its published
checkpoint layouts, draft_graphs.py replays its block forward as CUDA graphs, and proposer.py
is `BlockDrafter` plus `build_drafter`, the factory `rollout.build_engine` hands the engine.
spec imports the engine (its interface, model layers, sampler draws); the engine never imports
spec. Verification, which keeps every drafter lossless, lives with the engine
(rollout.engine.verify, docs/verification.md).
"""
