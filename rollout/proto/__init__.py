"""Generated gRPC stubs of proto/rollout/v1/rollout.proto (regenerate: python scripts/gen_proto.py)."""
