"""The rollout history off the engine thread: finished samples are handed over at the cost of an
append, a worker thread builds the suffix automata (rollout.spec.history), and the drafter reads
a published snapshot of every prompt's history.

Threads. The engine thread calls `add`, `policy_updated`, `published.get` and `touch`; the worker
thread owns the `History` (its LRU order, totals, eviction) and nothing else touches it. What
crosses between them:
* the inbox (finished samples, a policy version not yet applied), written by the engine thread and
  taken whole by the worker, both under `_lock`, which is held only for those appends and swaps and
  the worker's publishing of a batch's changed entries (dict assignments): never while an automaton
  is built, never across a step;
* `published`, prompt key -> PromptHistory, replaced only under `_lock` and read by the engine
  thread without it (a dict `get` is atomic under the GIL). A published entry never changes: the
  History copies an entry before changing it (copy on write), so a sample's match reads one
  consistent automaton for as long as it holds it, and sees a newer one by identity;
* `used`, prompt keys drafted for (LRU marks), appended by the engine thread, drained by the
  worker (deque appends and pops are atomic).

A full inbox drops its oldest samples: at most `max_tokens` tokens wait (more could not be stored
anyway), the engine thread never blocks, `dropped` counts the samples lost, and the newest samples,
the likeliest to predict the next ones, stay.

Policy versions: `policy_updated` (engine thread, between steps) publishes an empty history at
once unless versions are kept, so nothing of an earlier policy drafts from the next step on, and
the worker applies the version (dropping its store) before the samples queued after it. A batch
the worker was building while the version changed is not published: its samples were taken before
the change (the change waits in the inbox and drops them next; with versions kept nothing is dropped, and the
batch is published).

`flush` waits until everything handed over is stored and published (tests, benchmarks).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rollout.spec.history import SAMPLE_OVERHEAD, History, PromptHistory

USED_MARKS = 1 << 16  # LRU marks waiting for the worker at most (older ones are forgotten)


@dataclass(frozen=True)
class Finished:
    """A finished sample of the prompt `key`, drawn with `seed` by policy `version`."""

    key: bytes
    seed: int
    tokens: tuple[int, ...]
    version: int


class HistoryStore:
    """The history, built on a worker thread, read through `published` (see module docstring)."""

    def __init__(self, max_tokens: int, keep_versions: bool = False):
        self.history = History(max_tokens, keep_versions)  # the worker's
        self.published: dict[bytes, PromptHistory] = {}
        self.used: deque[bytes] = deque(maxlen=USED_MARKS)
        self.dropped = 0  # samples dropped from a full inbox
        self._inbox: deque[Finished] = deque()
        self._inbox_tokens = 0
        self._version: int | None = None  # a policy version the worker has not applied yet
        self._versions = 0  # policy updates handed over (see _run)
        self._busy = False  # the worker builds a batch it has taken
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None

    def add(self, key: bytes, seed: int, tokens: Sequence[int], version: int) -> None:
        """Hand a finished sample over (engine thread; never blocks on the worker's building)."""
        cost = len(tokens) + SAMPLE_OVERHEAD
        if cost > self.history.max_tokens:
            return
        with self._changed:
            self._inbox.append(Finished(key, seed, tuple(tokens), version))
            self._inbox_tokens += cost
            while self._inbox_tokens > self.history.max_tokens:
                self._inbox_tokens -= len(self._inbox.popleft().tokens) + SAMPLE_OVERHEAD
                self.dropped += 1
            self._changed.notify_all()
        self._start()

    def policy_updated(self, version: int) -> None:
        """Policy `version` samples from now on (engine thread, between steps)."""
        with self._changed:
            if not self.history.keep_versions:
                self.published = {}
            self._version = version
            self._versions += 1
            self._changed.notify_all()
        self._start()

    def touch(self, key: bytes) -> None:
        """The prompt `key` is drafted for (engine thread): it is used, for the LRU eviction."""
        self.used.append(key)

    def flush(self) -> None:
        """Wait until every sample handed over so far is stored and published."""
        with self._changed:
            while self._inbox or self._version is not None or self._busy:
                self._changed.wait()

    def _start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="history-store", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._inbox and self._version is None:
                    self._changed.wait()
                batch, version, versions = self._inbox, self._version, self._versions
                self._inbox, self._inbox_tokens, self._version, self._busy = deque(), 0, None, True
            changes = self._build(batch, version)
            with self._changed:
                if versions == self._versions or self.history.keep_versions:
                    published = self.published
                    for key, entry in changes.items():
                        if entry is None:
                            published.pop(key, None)
                        else:
                            published[key] = entry
                self._busy = False
                self._changed.notify_all()

    def _build(self, batch: deque[Finished], version: int | None) -> dict[bytes, PromptHistory | None]:
        """The worker's part: the policy version first, then the LRU marks and the samples."""
        history = self.history
        if version is not None:
            history.policy_updated(version)
        while self.used:
            history.touch(self.used.popleft())
        for sample in batch:
            history.add(sample.key, sample.seed, sample.tokens, sample.version)
        return history.take_changes()
