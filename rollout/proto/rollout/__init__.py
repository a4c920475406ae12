"""Generated stubs, package rollout (see rollout/proto/__init__.py)."""
