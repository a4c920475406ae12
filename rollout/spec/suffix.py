"""A suffix automaton over the samples of one prompt: the longest stored match of a context's
suffix, and the continuation the stored samples agree on most. The structure of the
rollout-history drafter (rollout.spec.history). Pure Python, no torch.

States are the end-position classes of the stored text's substrings (Blumer et al.'s directed
acyclic word graph, built online). Each sample is appended as `START`, its tokens, then a
separator of its own (a negative id no context holds): a match never spans two samples, and a
context that begins with `START` matches the beginnings of samples. Every state keeps `count`,
how many places its strings end at in the stored text, exact online: appending a token adds
one end position to each state on the new state's suffix-link chain (a clone starts with its
original's count). A continuation walks transitions from the matched state, at each position
the most counted one (ties: the lowest token id), with count(next) / count(here), the fraction
of the stored occurrences that continue that way, as its confidence.

Copies share their states' transition dicts (`copy`): a state's dict is copied the first time the
copy writes it (`owned`), so storing a sample in a copy costs the states that sample changes, not a
copy of every state's transitions, and the original never changes.
"""

from __future__ import annotations

from collections.abc import Iterable

START = -1  # the beginning of a sample; separators are -2, -3, ...


class SuffixAutomaton:
    """Samples in, (longest suffix match, most agreed continuation) out."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]  # per state: token -> state
        self.link: list[int] = [-1]  # suffix link (root: -1)
        self.length: list[int] = [0]  # longest string of each state
        self.count: list[int] = [0]  # end positions of each state's strings
        self.owned = bytearray(b"\x01")  # per state: its `next` dict is this automaton's own (see copy)
        self.text_length = 0  # tokens appended, START and separators included
        self.num_samples = 0
        self._last = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

    def add_sample(self, tokens: Iterable[int]) -> None:
        """Append one sample (token ids >= 0)."""
        self._append(START)
        for token in tokens:
            self._append(token)
        self.num_samples += 1
        self._append(START - self.num_samples)

    def copy(self) -> SuffixAutomaton:
        """A copy that changes independently of this one (the history store's copy-on-write: a
        published automaton is never changed again). Both share every state's transitions until
        either writes them (module docstring)."""
        other = SuffixAutomaton.__new__(SuffixAutomaton)
        other.next, other.owned = self.next.copy(), bytearray(len(self.next))
        self.owned = bytearray(len(self.next))
        other.link, other.length, other.count = self.link.copy(), self.length.copy(), self.count.copy()
        other.text_length, other.num_samples, other._last = self.text_length, self.num_samples, self._last
        return other

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        """The longest match after `token` follows a context whose longest match was (state, length)."""
        while state and token not in self.next[state]:
            state = self.link[state]
            length = self.length[state]
        target = self.next[state].get(token)
        return (0, 0) if target is None else (target, length + 1)

    def match(self, context: Iterable[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of `context` that occurs in a stored sample
        ((0, 0): none)."""
        state, length = 0, 0
        for token in context:
            state, length = self.step(state, length, token)
        return state, length

    def continuation(self, state: int, limit: int) -> tuple[list[int], list[float]]:
        """Up to `limit` tokens following the strings of `state`, each the most counted transition
        (ties to the lowest id), and each one's confidence count(next) / count(here). Stops at the
        end of the stored samples, and proposes nothing from the root (no match)."""
        tokens, confidence = [], []
        while state and len(tokens) < limit:
            best, best_count = -1, 0
            for token, target in self.next[state].items():
                c = self.count[target]
                if token >= 0 and (c > best_count or (c == best_count and token < best)):
                    best, best_count = token, c
            if best < 0:
                break
            tokens.append(best)
            confidence.append(best_count / self.count[state])
            state = self.next[state][best]
        return tokens, confidence

    def _new_state(self, length: int, count: int, transitions: dict[int, int]) -> int:
        self.next.append(transitions)
        self.owned.append(1)
        self.link.append(-1)
        self.length.append(length)
        self.count.append(count)
        return len(self.length) - 1

    def _append(self, token: int) -> None:
        """The online construction's extension by one token, then its new end position counted
        (the hot loop of storing a sample: the lists are bound to locals)."""
        nxt, link, length, count, owned = self.next, self.link, self.length, self.count, self.owned
        cur = self._new_state(length[self._last] + 1, 0, {})
        p = self._last
        while p != -1 and token not in nxt[p]:
            if not owned[p]:
                nxt[p], owned[p] = dict(nxt[p]), 1
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._new_state(length[p] + 1, count[q], dict(nxt[q]))
                link[clone] = link[q]
                while p != -1 and nxt[p].get(token) == q:
                    if not owned[p]:
                        nxt[p], owned[p] = dict(nxt[p]), 1
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur
        self.text_length += 1
        state = cur
        while state > 0:
            count[state] += 1
            state = link[state]
