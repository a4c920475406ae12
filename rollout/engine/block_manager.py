"""Paged KV-cache bookkeeping: block tables, reference counts, prefix sharing. No torch.

Blocks hold `block_size` token slots. A sequence's `block_table` maps its positions to
blocks (slot = block_table[pos // block_size] * block_size + pos % block_size). Blocks are
reference counted: the n samples of one prompt share the prompt's blocks after a fork, and
with prefix caching a full prompt block whose KV is computed is registered under the hash
of its tokens (chained with its predecessors) so a later identical prefix reuses it. A
freed block keeps its hash until it is handed out again, so reuse survives a finish.
"""

from __future__ import annotations

from collections import OrderedDict

from rollout.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many new blocks `seq` needs so that positions < num_tokens have slots."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def ensure_slots(self, seq: Sequence, num_tokens: int, keep_free: int = 0) -> bool:
        """Grow the block table to cover positions < num_tokens. False (and no change) if that
        would leave fewer than `keep_free` blocks free."""
        need = self.blocks_needed(seq, num_tokens)
        if need + keep_free > len(self.free_blocks):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def allocate_prompt(self, seq: Sequence) -> int:
        """Reuse cached full blocks of seq's prompt prefix; returns the number of prompt
        tokens whose KV is already computed (always < prompt length, so the last prompt
        token is recomputed and gives logits)."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        prev = 0
        for i in range(len(seq.prompt_token_ids) // self.block_size):
            if (i + 1) * self.block_size >= seq.num_prompt_tokens:
                break
            h = self._hash(prev, seq.prompt_token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.hash_to_block.get(h)
            if block is None or self.block_hash[block] != h:
                break
            self._ref(block)
            seq.block_table.append(block)
            prev = h
        return len(seq.block_table) * self.block_size

    def register_computed(self, seq: Sequence, old_computed: int) -> None:
        """After a step: register the hashes of prompt blocks that just became full."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        end = min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs
        if end <= old_computed // bs:
            return  # no prompt block became full (every decode step): skip rehashing the prompt
        prev = 0
        for i in range(end):
            h = self._hash(prev, seq.prompt_token_ids[i * bs : (i + 1) * bs])
            if (i + 1) * bs > old_computed:
                block = seq.block_table[i]
                if self.block_hash[block] is None and h not in self.hash_to_block:
                    self.block_hash[block] = h
                    self.hash_to_block[h] = block
            prev = h

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` the KV of parent's prompt: full blocks shared, a partially filled last
        block copied instead, since both will write into it: returns (src, dst) for the KV
        copy, or None. Only the prompt is the child's (the parent may already have accepted
        drafts of its own). The caller must have checked that a free block is available."""
        prompt = parent.num_prompt_tokens  # the parent has computed at least its prompt
        n_full = prompt // self.block_size
        shared = parent.block_table[:n_full]
        for b in shared:
            self._ref(b)
        child.block_table = list(shared)
        child.num_computed_tokens = prompt
        if prompt % self.block_size == 0:
            return None
        dst = self._take_free()
        child.block_table.append(dst)
        return parent.block_table[n_full], dst

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past those covering positions < num_tokens (KV rollback)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self._unref(b)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their KV was computed with weights now replaced)."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks

    # -- internals ---------------------------------------------------------------------

    @staticmethod
    def _hash(prev: int, tokens: list[int]) -> int:
        return hash((prev, tuple(tokens)))

    def _take_free(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
        self.ref_counts[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

