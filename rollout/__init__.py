"""rollout: a rollout service for RL post-training.

Speculative generation (DFlash / DSpark) verified losslessly by the target model, with
per-token sampling masks that let the trainer replay the exact policy. The contracts are in
docs/ (docs/README.md lists them); README.md's layout section maps the packages.

`build_engine` is the one place where the packages meet: it gives the engine (rollout.engine,
which imports no drafter) the drafter factory of rollout.spec. Its imports stay inside it, so
that importing a light module (rollout.errors, rollout.schema, the validator) does not load
the engine.
"""

from __future__ import annotations

__version__ = "0.1.0"


def build_engine(config, drafter_factory=None, load_progress=None, step_cost=None):
    """An `LLMEngine` for `config` (a rollout.engine.config.EngineConfig) whose drafter, when
    `config.spec` names one, is rollout.spec's DFlash / DSpark drafter, its rollout-history
    drafter, or the two combined; `drafter_factory(config, target)` replaces it (a custom drafter, a test double).
    `load_progress` shows the checkpoint reads, the target's and rollout.spec's drafter's
    (rollout.engine.loader.LoadProgress). `step_cost` gives the adaptive draft budget its cost
    model instead of the startup profile (tests; rollout.engine.step_cost). Module-level, so that
    `functools.partial(build_engine, config)` pickles (the engine may be built in its own process)."""
    import functools

    from rollout.engine.engine import LLMEngine

    if drafter_factory is None and config.spec == "history":
        from rollout.spec.history_drafter import build_history_drafter

        drafter_factory = build_history_drafter
    elif drafter_factory is None and config.history_drafts:
        from rollout.spec.combined import build_combined_drafter

        drafter_factory = functools.partial(build_combined_drafter, progress=load_progress)
    elif drafter_factory is None and config.spec != "none":
        from rollout.spec.proposer import build_drafter

        drafter_factory = functools.partial(build_drafter, progress=load_progress)
    return LLMEngine(config, drafter_factory, load_progress=load_progress, step_cost=step_cost)
