"""The sampling-mask contract as data (docs/masks.md): the mask modes, the packer of supports
(pack.py) and the validator of finished rollouts (check.py). Pure data: nothing here imports
the engine, the drafters or the server; the engine's capture (rollout.engine.capture) uses the
packer."""

MASK_MODES = ("selected", "support")  # a request's `mask`; unset / "" = no masks
