"""Generated stubs of package rollout.v1: rollout_pb2 (messages) and rollout_pb2_grpc (service)."""
