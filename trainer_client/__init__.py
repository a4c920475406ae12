"""trainer_client: what an RL trainer imports to talk to `rollout` servers."""
