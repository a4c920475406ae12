"""rollout.server"""
