"""rollout.engine"""
