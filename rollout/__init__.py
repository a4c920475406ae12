"""rollout: a rollout service for RL post-training.

Speculative generation (DFlash / DSpark) verified losslessly by the target model, with
per-token sampling masks that let the trainer replay the exact policy. See DESIGN.md.
"""

__version__ = "0.1.0"
