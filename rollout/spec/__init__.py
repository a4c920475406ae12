"""rollout.spec"""
