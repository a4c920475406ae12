"""The engine: a target model on a paged KV cache, stepped by `LLMEngine` (engine.py).

The step's parts, in the order `LLMEngine.step` runs them: the scheduler (scheduler.py, over
block_manager.py and sequence.py; pure Python) plans tokens and owns every sequence's state
transition; batch.py lays the step out (a token view and a row view, with the shared-prefix
attention plan of prefix_plan.py); the drafter interface (drafter.py) proposes drafts; model.py
runs the forward (attention.py, prefix_attention.py, rope.py, moe.py for Qwen3-MoE, graphs.py,
the Triton kernels); rows.py builds per-row parameters and the grammar processor's bitmask
(grammar.py); sampler.py and truncation.py compute the policy (docs/sampling.md); verify.py
accepts drafts losslessly (docs/verification.md); capture.py reads the masks (docs/masks.md);
commit.py appends, finishes and emits. intake.py admits requests, weights.py swaps weights
between steps, loader.py loads the model, kv.py allocates its cache, and memory.py sizes the
pool from profile.py's run of the largest step.

The engine imports nothing of rollout.spec or rollout.server: drafters plug in through
drafter.py (`rollout.build_engine` passes rollout.spec's factory), the server calls the engine.
"""
