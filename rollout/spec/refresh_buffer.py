"""The drafter refresh's training data: committed tokens and the target hidden states the drafter read.

`TapBuffer` is a ring of `capacity` rows, one per committed token of the current policy version:
the concatenated outputs of the drafter's target layers (`taps`, [capacity, n * Ht] in the
target's dtype, on the target's device, allocated once at startup so the KV pool's plan leaves room
for it) and, on the host, the token id, its sequence, its position and whether it is an output
token (a sample of the policy) or prompt context. Its bound: capacity x (n * Ht x element size)
bytes on the device plus 25 bytes per row on the host, and a position index per stored sequence.
Rows are written in commit order and the oldest is overwritten first. `clear()` empties it (a
weight update: the new policy's data only from then on).

`windows` draws training windows: runs of consecutive positions of one sequence (a row chosen
at random, then the positions after it that are stored), which is the layout the drafter's dense
training forward reads (rollout.spec.draft_model.DraftModel.train_logits).
"""

from __future__ import annotations

import numpy as np
import torch

HOST_BYTES_PER_ROW = 25  # token id, sequence key, position (int64 each), output flag (bool)


class TapBuffer:
    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device):
        self.capacity, self.width = capacity, width
        self.taps = torch.zeros(capacity, width, dtype=dtype, device=device)  # [N, n*Ht]
        self.token = np.zeros(capacity, dtype=np.int64)
        self.key = np.full(capacity, -1, dtype=np.int64)  # -1: empty
        self.position = np.zeros(capacity, dtype=np.int64)
        self.output = np.zeros(capacity, dtype=bool)
        self.slots: dict[int, dict[int, int]] = {}  # sequence key -> position -> row
        self.next = 0  # the row written next (the oldest once full)
        self.size = 0

    @property
    def nbytes(self) -> int:
        """The bound: device bytes of the taps plus the host arrays (the index aside)."""
        return self.taps.numel() * self.taps.element_size() + self.capacity * HOST_BYTES_PER_ROW

    def clear(self) -> None:
        self.key.fill(-1)
        self.slots.clear()
        self.next = self.size = 0

    def append(self, key: np.ndarray, position: np.ndarray, token: np.ndarray, output: np.ndarray,
               taps: torch.Tensor) -> None:
        """Store rows (the newest win a full ring); key, position, token, output: [n] host arrays;
        taps: [n, n*Ht] on the buffer's device."""
        n = len(key)
        if n > self.capacity:  # more than the ring holds: only the last rows
            key, position, token, output, taps = key[-self.capacity:], position[-self.capacity:], \
                token[-self.capacity:], output[-self.capacity:], taps[-self.capacity:]
            n = self.capacity
        rows = (self.next + np.arange(n)) % self.capacity  # [n]
        self._forget(rows)
        self.key[rows], self.position[rows], self.token[rows], self.output[rows] = key, position, token, output
        for row, k, p in zip(rows.tolist(), key.tolist(), position.tolist()):
            self.slots.setdefault(k, {})[p] = row
        index = torch.from_numpy(rows).to(self.taps.device, non_blocking=True)
        self.taps.index_copy_(0, index, taps.to(self.taps.dtype))
        self.next = int((self.next + n) % self.capacity)
        self.size = min(self.capacity, self.size + n)

    def _forget(self, rows: np.ndarray) -> None:
        """Drop the index entries of the rows about to be overwritten (unless a newer row took the position)."""
        for row in rows[self.key[rows] >= 0].tolist():
            k, p = int(self.key[row]), int(self.position[row])
            positions = self.slots.get(k)
            if positions is not None and positions.get(p) == row:
                del positions[p]
                if not positions:
                    del self.slots[k]

    def num_outputs(self) -> int:
        """Output tokens stored (those a training window can learn)."""
        return int(self.output[self.key >= 0].sum())

    def windows(self, rng: np.random.Generator, count: int, length: int) -> list[np.ndarray]:
        """`count` windows of at most `length` rows each (their buffer rows in position order),
        each starting at a stored row drawn uniformly, continuing while the next position is stored."""
        starts = rng.integers(0, self.size, size=count)
        out = []
        for row in starts.tolist():
            positions = self.slots[int(self.key[row])]
            p, rows = int(self.position[row]), []
            while len(rows) < length and p in positions:
                rows.append(positions[p])
                p += 1
            out.append(np.asarray(rows, dtype=np.int64))
        return out
