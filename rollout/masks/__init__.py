"""The sampling-mask contract as data (docs/masks.md): the mask modes, the packer of supports
(pack.py) and the validator of finished rollouts (check.py; check_settings.py checks each row
against the sampling settings it carries). Pure data: nothing here imports the engine, the
drafters or the server; the engine's capture (rollout.engine.capture) uses the packer, and the
engine takes the request settings' vocabularies below from here."""

MASK_MODES = ("selected", "support")  # a request's `mask`; unset / "" = no masks
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # a grammar's `kind` (rollout.engine.grammar)
TEMPERATURE_RANGE = (1e-5, 1e5)  # a temperature's range besides 0, greedy (rollout.engine.params)
