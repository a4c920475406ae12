"""Test doubles for the drafter extension point (tests only)."""

from __future__ import annotations

import torch

from rollout.spec.proposer import Drafter, Drafts


class RepeatDrafter(Drafter):
    """Drafts the anchor token repeated: random tiny models repeat tokens a lot, so these
    drafts are often accepted and exercise accepted, rejected and bonus paths alike."""

    def __init__(self, block_size: int):
        self.num_spec = block_size - 1
        self.target_layer_ids = ()
        self.block = block_size

    def bytes_per_block(self, block_size: int) -> int:
        return 0

    def allocate(self, num_blocks: int, block_size: int) -> None:
        pass

    def propose(self, items, block_tables) -> Drafts:
        counts = [it.num_draft for it in items]
        flat = [it.seq.last_token for it in items for _ in range(it.num_draft)]
        return Drafts(torch.tensor(flat, dtype=torch.int64), counts)

    def update_context(self, target_aux, meta) -> None:
        pass

    def copy_blocks(self, pairs) -> None:
        pass
