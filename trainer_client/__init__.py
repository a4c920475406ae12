"""trainer_client: what an RL trainer imports to talk to `rollout` servers.

`RolloutClient` / `AsyncRolloutClient` reach one server over gRPC and return Arrow tables;
`to_torch` turns a table into padded training tensors (with `model_inputs` / `output_logits` for
one forward of the trainer's model), `masked_logprobs` replays the rollout's sampling masks on
the trainer's logits at each row's own temperature, and `decode` turns token ids back into text.
`RolloutFleet` runs servers as Ray actors (imported on first use, so Ray stays optional for
single-server users).
"""

from trainer_client.aio import AsyncRolloutClient
from trainer_client.client import RolloutClient
from trainer_client.tensors import RolloutBatch, masked_logprobs, to_torch
from trainer_client.text import decode

__all__ = ["AsyncRolloutClient", "RolloutBatch", "RolloutClient", "RolloutFleet", "decode", "masked_logprobs",
           "to_torch"]


def __getattr__(name: str):
    if name == "RolloutFleet":
        from trainer_client.fleet import RolloutFleet

        return RolloutFleet
    raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
