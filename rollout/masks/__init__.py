"""rollout.masks"""
