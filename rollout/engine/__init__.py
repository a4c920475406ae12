"""The engine: a target model on a paged KV cache, stepped by `LLMEngine` (engine.py).

The step's parts, in the order `LLMEngine.step` runs them: the scheduler (scheduler.py, over
block_manager.py and sequence.py; pure Python) plans tokens and owns every sequence's state
transition; batch.py lays the step out (a token view and a row view); the drafter interface
(drafter.py) proposes drafts; model.py runs the forward (attention.py, rope.py, graphs.py, the
Triton kernels); rows.py builds per-row parameters and the grammar processor's bitmask
(grammar.py); sampler.py and truncation.py compute the policy (docs/sampling.md); verify.py
accepts drafts losslessly (docs/verification.md); capture.py reads the masks (docs/masks.md);
commit.py appends, finishes and emits. intake.py admits requests, weights.py swaps weights
between steps, loader.py and kv.py load the model and size its cache.

The engine imports nothing of rollout.spec or rollout.server: drafters plug in through
drafter.py (`rollout.build_engine` passes rollout.spec's factory), the server calls the engine.
"""
