"""The history store's worker thread (rollout.spec.history_store): finished samples are stored by
the worker, not by the engine step; published entries never change (copy on write); a full inbox
drops its oldest samples and counts them; a weight update hides the earlier policy's history at
once, including a batch the worker was building meanwhile. Deterministic: the worker is held at a
gate (threading events), never timed."""

from __future__ import annotations

import threading

import pytest

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.params import SamplingParams
from rollout.spec.history import SAMPLE_OVERHEAD, prompt_key
from rollout.spec.history_store import HistoryStore

KEY, OTHER = prompt_key([1, 2, 3]), prompt_key([4])


class Gate:
    """Holds the worker at the start of each batch it builds, until opened; records its thread."""

    def __init__(self, monkeypatch):
        self.entered, self.open, self.threads = threading.Event(), threading.Event(), set()
        real = HistoryStore._build

        def build(store, batch, version):
            self.threads.add(threading.get_ident())
            self.entered.set()
            self.open.wait()
            return real(store, batch, version)

        monkeypatch.setattr(HistoryStore, "_build", build)


def test_the_worker_stores_samples_and_published_entries_never_change(monkeypatch):
    gate = Gate(monkeypatch)
    store = HistoryStore(1000)
    store.add(KEY, seed=1, tokens=[5, 6, 7], version=0)
    gate.entered.wait()
    assert store.published == {} and store.history.num_tokens == 0  # nothing stored on the caller's thread
    gate.open.set()
    store.flush()
    first = store.published[KEY]
    assert gate.threads and threading.get_ident() not in gate.threads
    assert store.history.num_tokens == 3 + SAMPLE_OVERHEAD and list(first.samples) == [(1, (5, 6, 7))]
    store.add(KEY, seed=2, tokens=[5, 6, 8], version=0)
    store.flush()
    second = store.published[KEY]
    assert second is not first and second.automaton.num_samples == 2
    assert first.automaton.num_samples == 1 and list(first.samples) == [(1, (5, 6, 7))]  # the snapshot held


def test_a_full_inbox_drops_its_oldest_samples(monkeypatch):
    gate = Gate(monkeypatch)
    store = HistoryStore(max_tokens=3 * (8 + SAMPLE_OVERHEAD))
    store.add(OTHER, seed=0, tokens=[9] * 8, version=0)  # the worker takes it and waits at the gate
    gate.entered.wait()
    for seed in range(1, 6):  # 5 samples wait, room for 3: the two oldest go
        store.add(KEY, seed=seed, tokens=[seed] * 8, version=0)
    assert store.dropped == 2
    gate.open.set()
    store.flush()
    assert store.published[KEY].seeds == {3, 4, 5} and store.history.evicted_prompts == 1


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_a_weight_update_hides_the_earlier_policy_at_once(monkeypatch, keep):
    gate = Gate(monkeypatch)
    store = HistoryStore(1000, keep_versions=keep)
    gate.open.set()
    store.add(KEY, seed=1, tokens=[5, 6], version=0)
    store.flush()
    gate.open.clear()
    gate.entered.clear()
    store.add(OTHER, seed=2, tokens=[7], version=0)  # being built while the update comes
    gate.entered.wait()
    store.policy_updated(1)
    assert (KEY in store.published) == keep  # before the worker has heard of it
    store.add(KEY, seed=3, tokens=[8], version=1)
    gate.open.set()
    store.flush()
    if keep:
        assert store.published[KEY].seeds == {1, 3} and OTHER in store.published
    else:
        assert set(store.published) == {KEY} and store.published[KEY].seeds == {3}
        assert set(store.history.prompts) == {KEY}


def test_the_engine_step_does_not_store_finished_samples(tiny_random_qwen3, monkeypatch):
    gate = Gate(monkeypatch)
    eng = build_engine(EngineConfig(model=str(tiny_random_qwen3), spec="history", block_size=4, num_kv_blocks=200,
                                    spec_adaptive=False))
    eng.add_request("r", [[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), n=2)
    steps = 0
    while eng.has_unfinished():  # every sample finishes while the worker is held at the gate
        eng.step()
        steps += 1
    store = eng.drafter.store
    assert steps > 0 and store.history.num_tokens == 0 and store.published == {}
    gate.open.set()
    eng.drafter.flush()
    assert len(store.published) == 2 and store.history.num_tokens == 4 * (6 + SAMPLE_OVERHEAD)
    assert threading.get_ident() not in gate.threads
