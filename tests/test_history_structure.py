"""The rollout-history drafter's structures without a model: the suffix automaton (longest match,
counts against brute force, ties, the limit), the history's bounds (tokens over many prompts, a
prompt larger than the cap), LRU eviction, eviction by policy version and the seed guard."""

from __future__ import annotations

import random

from rollout.spec.history import SAMPLE_OVERHEAD, History, prompt_key
from rollout.spec.suffix import START, SuffixAutomaton


def _automaton(*samples: list[int]) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    for s in samples:
        sam.add_sample(s)
    return sam


def _occurrences(samples: list[list[int]], pattern: list[int]) -> int:
    """End positions of `pattern` in the samples, each read as START + sample (brute force)."""
    texts = [[START, *s] for s in samples]
    k = len(pattern)
    return sum(t[i:i + k] == pattern for t in texts for i in range(len(t) - k + 1))


def _longest_suffix_in(samples: list[list[int]], context: list[int]) -> int:
    return max((k for k in range(len(context) + 1) if k == 0 or _occurrences(samples, context[-k:])), default=0)


def test_longest_match_and_counts_equal_brute_force():
    rng = random.Random(0)
    samples = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    sam = _automaton(*samples)
    for _ in range(300):
        context = ([START] if rng.random() < 0.3 else []) + [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        state, length = sam.match(context)
        assert length == _longest_suffix_in(samples, context)
        if length:
            assert sam.count[state] == _occurrences(samples, context[-length:])


def test_continuation_follows_the_most_agreed_path_with_its_confidence():
    sam = _automaton([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [9, 2, 7])
    state, length = sam.match([START, 1, 2])
    assert length == 3
    tokens, confidence = sam.continuation(state, 8)
    assert tokens == [3, 5]  # 5 follows "1 2 3" twice, 4 once; the sample ends there
    assert confidence == [1.0, 2 / 3]
    state, _ = sam.match([2])  # "2" continues with 3 three times, 7 once
    assert sam.continuation(state, 1) == ([3], [0.75])


def test_ties_go_to_the_lowest_token_and_the_limit_holds():
    sam = _automaton([5, 8, 1, 1, 1, 1], [5, 6, 1, 1, 1, 1])
    state, _ = sam.match([START, 5])
    assert sam.continuation(state, 1) == ([6], [0.5])
    assert sam.continuation(state, 3)[0] == [6, 1, 1]
    assert sam.continuation(state, 0) == ([], [])


def test_a_match_never_spans_two_samples_and_an_unknown_token_matches_nothing():
    sam = _automaton([1, 2], [3, 4])
    assert sam.match([2, 3])[1] == 1  # "2 3" crosses the boundary: only "3" matches
    assert sam.match([42]) == (0, 0)
    assert sam.continuation(0, 3) == ([], [])  # no match: nothing proposed
    state, _ = sam.match([START, 1, 2])
    assert sam.continuation(state, 4) == ([], [])  # the sample ended: nothing to propose


def test_incremental_steps_equal_a_fresh_match():
    rng = random.Random(1)
    sam = _automaton(*[[rng.randrange(3) for _ in range(20)] for _ in range(5)])
    context = [START] + [rng.randrange(3) for _ in range(40)]
    state, length = 0, 0
    for i, token in enumerate(context):
        state, length = sam.step(state, length, token)
        assert (state, length) == sam.match(context[:i + 1])


def test_stored_tokens_stay_within_the_cap_over_many_prompts():
    rng = random.Random(2)
    cap = 500
    history = History(max_tokens=cap)
    for i in range(400):
        key = prompt_key([rng.randrange(20)])  # 20 prompts revisited at random
        history.add(key, seed=i, tokens=[rng.randrange(50) for _ in range(rng.randrange(1, 60))], version=0)
        assert history.num_tokens <= cap
        assert history.num_tokens == sum(e.num_tokens for e in history.prompts.values())
        assert all(e.automaton.num_states <= 2 * e.num_tokens + 1 for e in history.prompts.values())
    assert history.evicted_prompts > 0


def test_one_prompt_larger_than_the_cap_keeps_its_newest_samples():
    history = History(max_tokens=100)
    key = prompt_key([1, 2, 3])
    for i in range(30):
        history.add(key, seed=i, tokens=[i] * 9, version=0)
        assert history.num_tokens <= 100
    entry = history.prompts.get(key)
    assert [seed for seed, _ in entry.samples][-1] == 29
    assert entry.seeds == {seed for seed, _ in entry.samples}
    assert entry.num_tokens == sum(len(t) + SAMPLE_OVERHEAD for _, t in entry.samples)
    history.add(key, seed=99, tokens=[0] * 200, version=0)  # longer than the cap: not stored
    assert 99 not in history.prompts.get(key).seeds


def test_least_recently_used_prompts_go_first():
    history = History(max_tokens=3 * (10 + SAMPLE_OVERHEAD))
    a, b, c, d = (prompt_key([i]) for i in range(4))
    for key in (a, b, c):
        history.add(key, seed=0, tokens=[1] * 10, version=0)
    history.touch(a)  # a drafted for: b is now the least recently used
    history.add(d, seed=0, tokens=[1] * 10, version=0)
    assert set(history.prompts) == {a, c, d}


def test_earlier_versions_are_dropped_unless_kept():
    key = prompt_key([7])
    dropped, kept = History(1000), History(1000, keep_versions=True)
    for history in (dropped, kept):
        history.add(key, seed=1, tokens=[1, 2, 3], version=0)
        history.policy_updated(1)
        history.add(key, seed=2, tokens=[4, 5], version=0)  # a sample of the old policy, reported late
    assert dropped.prompts.get(key) is None and dropped.num_tokens == 0
    assert kept.prompts.get(key).seeds == {1, 2}
    dropped.add(key, seed=3, tokens=[6], version=1)
    assert dropped.prompts.get(key).seeds == {3}


def test_a_copy_shares_unwritten_states_and_never_changes_its_original():
    rng = random.Random(1)
    samples = [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(10)]
    original = _automaton(*samples[:6])
    frozen = (list(map(dict, original.next)), original.link.copy(), original.count.copy())
    copy = original.copy()
    for s in samples[6:]:
        copy.add_sample(s)
    assert (list(map(dict, original.next)), original.link, original.count) == frozen  # the snapshot held
    fresh = _automaton(*samples)
    assert (copy.next, copy.link, copy.length, copy.count) == (fresh.next, fresh.link, fresh.length, fresh.count)
    shared = sum(a is b for a, b in zip(original.next, copy.next))
    assert 0 < shared < original.num_states  # only the states the new samples wrote were copied
    twice = copy.copy()
    twice.add_sample([0, 1, 2])
    assert copy.next == fresh.next and copy.count == fresh.count  # a copy of a copy leaves the copy alone
