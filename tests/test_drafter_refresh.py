"""Online drafter refresh (rollout/spec/refresh.py, `--drafter-refresh`): greedy outputs do not change
with it on; the live drafter's weights change only between steps; the buffer holds exactly the
committed tokens' target-layer outputs (checked against transformers' hidden states), stays within
its bound and keeps only the current policy version's data; training on a repeated greedy rollout
raises the drafter's acceptance on it; the fetched checkpoint loads back and drafts as the live one."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.engine.drafter import Drafts
from rollout.engine.intake import new_sequence
from rollout.engine.loader import load_model
from rollout.engine.params import SamplingParams
from rollout.engine.scheduler import ScheduledSeq
from rollout.errors import InvalidArgument
from rollout.spec import refresh as refresh_mod
from rollout.spec.draft_loader import checkpoint_tensors, load_drafter

PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [42], [1, 2, 3, 4, 5, 6],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _engine(model, spec="none", draft=None, refresh="off", **kw):
    """An engine whose refresh slices run one training step each (not timed: the time bound has
    its own test, test_slice_keeps_to_its_time_bound)."""
    cfg = EngineConfig(model=str(model), spec=spec, draft=draft, block_size=4, num_kv_blocks=400,
                       max_num_batched_tokens=32, spec_adaptive=False, drafter_refresh=refresh,
                       drafter_refresh_lr=kw.pop("lr", 1e-3), **kw)
    eng = build_engine(cfg)
    refresh = getattr(eng.drafter, "refresh", None)
    if refresh is not None:
        refresh.train_slice = lambda idle=False, bound=None: refresh.buffer.num_outputs() and refresh.train_step()
    return eng


def _run(eng, prompts, params=GREEDY, n=1, request_id="r"):
    eng.add_request(request_id, prompts, params, n=n)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return sorted(outs, key=lambda o: (o.prompt_index, o.sample_index))


@pytest.fixture(scope="module")
def greedy_base(tiny_random_qwen3):
    return [o.token_ids for o in _run(_engine(tiny_random_qwen3), PROMPTS, n=2)]


@pytest.mark.parametrize("spec", ["dflash", "dspark", "dflash+history"])
def test_greedy_outputs_identical_with_refresh(tiny_random_qwen3, random_drafters, greedy_base, spec):
    eng = _engine(tiny_random_qwen3, spec, random_drafters[spec.removesuffix("+history")], "always")
    assert [o.token_ids for o in _run(eng, PROMPTS, n=2)] == greedy_base
    stats = eng.drafter.stats()
    assert stats["refresh_steps"] > 0 and stats["refresh_swaps"] > 0  # it did train and swap meanwhile


def test_live_weights_change_only_between_steps(tiny_random_qwen3, random_drafters):
    eng = _engine(tiny_random_qwen3, "dflash", random_drafters["dflash"], "always")
    drafter, seen = eng.drafter, []  # (step, checksum of the live weights) at every drafter forward
    step_index = [0]

    def checksum():
        seen.append((step_index[0], float(drafter.model.fc.weight.double().sum())))

    def watch(fn):
        def wrapped(*args, **kwargs):
            checksum()
            out = fn(*args, **kwargs)
            checksum()
            return out
        return wrapped

    drafter._block_forward = watch(drafter._block_forward)
    drafter.update_context = watch(drafter.update_context)
    step = eng.step

    def counted_step():
        step_index[0] += 1
        return step()

    eng.step = counted_step
    _run(eng, PROMPTS)
    by_step: dict[int, set[float]] = {}
    for s, checksum in seen:
        by_step.setdefault(s, set()).add(checksum)
    assert all(len(v) == 1 for v in by_step.values())  # one set of weights within each step
    assert len({c for _, c in seen}) > 2  # and new ones between steps
    assert eng.drafter.stats()["refresh_swaps"] > 2


def test_buffer_holds_committed_taps_within_bound(tiny_random_qwen3, random_drafters):
    """Every stored row is the committed token at its position and the target's layer outputs there
    (transformers' hidden states of the finished sample's tokens); a small ring keeps the newest rows."""
    transformers = pytest.importorskip("transformers")
    eng = _engine(tiny_random_qwen3, "dflash", random_drafters["dflash"], "always", drafter_refresh_tokens=48)
    seqs = {}
    begin = eng.drafter.refresh.begin_step

    def remember(items):
        seqs.update({it.seq.seq_id: it.seq for it in items})
        begin(items)

    eng.drafter.refresh.begin_step = remember
    _run(eng, PROMPTS, n=2)
    buffer = eng.drafter.refresh.buffer
    assert buffer.size == buffer.capacity == 48 and buffer.taps.shape[0] == 48
    assert sum(len(p) for p in buffer.slots.values()) <= 48
    assert buffer.nbytes == 48 * buffer.taps.shape[1] * 4 + 48 * 25
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_random_qwen3, dtype=torch.float32).eval()
    layers = eng.drafter.target_layer_ids
    for key, positions in buffer.slots.items():
        seq = seqs[key]
        tokens = seq.prompt_token_ids + seq.output_token_ids
        with torch.no_grad():
            hidden = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        want = torch.cat([hidden[i + 1][0] for i in layers], dim=-1)  # [L, n*Ht]
        for pos, row in positions.items():
            assert buffer.token[row] == tokens[pos] and buffer.output[row] == (pos >= seq.num_prompt_tokens)
            torch.testing.assert_close(buffer.taps[row], want[pos], atol=1e-4, rtol=1e-4)


def test_weight_update_clears_the_buffer(tiny_random_qwen3, random_drafters):
    eng = _engine(tiny_random_qwen3, "dspark", random_drafters["dspark"], "idle")
    _run(eng, PROMPTS[:2])
    refresh = eng.drafter.refresh
    assert refresh.buffer.num_outputs() == 2 * GREEDY.max_tokens - 2  # (each sample's last token: no row yet)
    old_keys = set(refresh.buffer.slots)
    eng.update_weights(load_file(str(tiny_random_qwen3 / "model.safetensors")))
    eng.step()  # the update applies between steps
    assert eng.policy_version == 1 and refresh.buffer.size == 0 and not refresh.buffer.slots
    assert refresh.stats.version == 1
    _run(eng, PROMPTS[2:3], request_id="r2")
    assert refresh.buffer.slots and not set(refresh.buffer.slots) & old_keys


def test_idle_training_is_bounded_and_stops(tiny_random_qwen3, random_drafters):
    """`idle` trains after steps of at most max(1, max_num_seqs // 8) sequences (here 1: the tail of the
    batch) and while the engine is idle, until the buffer has been trained on IDLE_PASSES times."""
    eng = _engine(tiny_random_qwen3, "dflash", random_drafters["dflash"], "idle", max_num_seqs=8)
    refresh = eng.drafter.refresh
    batch_sizes, trained_after = [], []
    committed, one_step = refresh.committed, refresh.train_slice

    def note_batch(items, drafts, accepted):
        batch_sizes.append(len(drafts.num_per_item))
        committed(items, drafts, accepted)

    def note_slice(idle=False, bound=None):
        trained_after.append(batch_sizes[-1])
        one_step()

    refresh.committed, refresh.train_slice = note_batch, note_slice
    _run(eng, PROMPTS)
    assert max(batch_sizes) > 1 and trained_after and max(trained_after) == 1
    before, slices = refresh.stats.steps, 0
    while eng.idle_work():
        slices += 1
        assert slices < 200
    assert refresh.stats.steps > before and not eng.idle_work()
    assert refresh.stats.trained_tokens >= refresh_mod.IDLE_PASSES * refresh.buffer.num_outputs()


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("step_ms, idle, steps", [(7, False, 2), (7, True, 2), (25, False, 0), (25, True, 1)])
def test_slice_keeps_to_its_time_bound(tiny_random_qwen3, random_drafters, monkeypatch, step_ms, idle, steps):
    """--drafter-refresh-ms 20: a slice starts a training step only while its time so far plus the last
    step's duration fits (an idle slice runs one at least)."""
    cfg = EngineConfig(model=str(tiny_random_qwen3), spec="dflash", draft=random_drafters["dflash"], block_size=4,
                       num_kv_blocks=64, drafter_refresh="always", drafter_refresh_ms=20.0)
    refresh = build_engine(cfg).drafter.refresh
    clock = _Clock()
    monkeypatch.setattr(refresh_mod.time, "perf_counter", clock)
    monkeypatch.setattr(refresh.buffer, "num_outputs", lambda: 1)
    refresh.stats.steps, refresh.step_s = 5, step_ms / 1e3  # past the warm-up, one step measured

    def fake_step():
        clock.now += step_ms / 1e3
        refresh.stats.steps += 1
        return True

    refresh.train_step = fake_step
    refresh.train_slice(idle=idle)
    assert refresh.stats.steps - 5 == steps
    assert clock.now <= 0.020 or (idle and steps == 1)


def test_training_after_steps_keeps_to_its_share_of_the_steps_time(tiny_random_qwen3, random_drafters,
                                                                    monkeypatch):
    """--drafter-refresh-share 0.05 with 2 ms training steps after 10 ms engine steps: the steps earn 0.5
    ms of credit each, so training runs one step in about four and never takes more than the share
    (plus the one step a slice may overdraw); the credit saved while no slice may run is capped at
    CREDIT_SLICES slices. Idle slices spend none."""
    cfg = EngineConfig(model=str(tiny_random_qwen3), spec="dflash", draft=random_drafters["dflash"], block_size=4,
                       num_kv_blocks=64, drafter_refresh="always", drafter_refresh_ms=20.0,
                       drafter_refresh_share=0.05)
    refresh = build_engine(cfg).drafter.refresh
    clock = _Clock()
    monkeypatch.setattr(refresh_mod.time, "perf_counter", clock)
    monkeypatch.setattr(refresh.buffer, "num_outputs", lambda: 1)
    refresh.stats.steps, refresh.step_s = 5, 0.002  # past the warm-up, one step measured

    def fake_step():
        clock.now += 0.002
        refresh.stats.steps += 1
        return True

    refresh.train_step = fake_step
    for _ in range(400):  # 4 s of engine steps
        refresh.after_step(0.010)
        clock.now += 0.010
    trained = (refresh.stats.steps - 5) * 0.002
    assert 0.8 * 0.05 * 4.0 <= trained <= 0.05 * 4.0 + 0.002, trained
    refresh.step_rows = refresh.small_batch + 1  # idle mode, a wide step: no slice, the credit saves up
    refresh.mode = "idle"
    for _ in range(10_000):
        refresh.after_step(0.010)
    assert refresh.credit == pytest.approx(refresh_mod.CREDIT_SLICES * 0.020)
    credit = refresh.credit
    refresh.train_slice(idle=True)
    assert refresh.credit == credit and refresh.stats.steps > 5 + trained / 0.002


def test_the_long_tail_check_reads_every_committed_step(tiny_random_qwen3, random_drafters):
    """after_step trains in `idle` mode only after a small step: the size it checks is the last
    committed step's, also when that step left nothing to buffer (no layout)."""
    cfg = EngineConfig(model=str(tiny_random_qwen3), spec="dflash", draft=random_drafters["dflash"], block_size=4,
                       num_kv_blocks=64, max_num_seqs=64, drafter_refresh="idle")
    refresh = build_engine(cfg).drafter.refresh
    refresh.committed([], Drafts(torch.zeros(0, dtype=torch.int64), [0] * 2), [0] * 2)
    assert refresh.step_rows == 2
    refresh.committed([], Drafts(torch.zeros(0, dtype=torch.int64), [0] * 40), [0] * 40)
    assert refresh.step_rows == 40 > refresh.small_batch


def test_a_stop_token_among_accepted_drafts_stores_rows_up_to_it(tiny_random_qwen3, random_drafters):
    """A decode item verified 3 drafts and accepted them all, but the first was a stop token: the
    sample kept that one token. No row is stored at or past the last committed token (as without
    drafts, where the stop token is sampled and never an input): the anchor's row only. The old code
    stored rows for the cut drafts' positions too, whose tokens were never committed."""
    cfg = EngineConfig(model=str(tiny_random_qwen3), spec="dflash", draft=random_drafters["dflash"], block_size=4,
                       num_kv_blocks=64, drafter_refresh="always")
    refresh = build_engine(cfg).drafter.refresh
    seq = new_sequence(1, (), request_id="r", prompt_index=0, sample_index=0, prompt_token_ids=[5, 6, 7],
                       params=SamplingParams(max_tokens=8, stop_token_ids=[9]), seed=0)
    seq.output_token_ids = [11]
    seq.num_computed_tokens = 3  # the anchor (11, position 3) is this step's one new token
    item = ScheduledSeq(seq, 1, 3)
    refresh.begin_step([item])
    seq.output_token_ids += [9]  # the commit: the first accepted draft is the stop token, the rest cut
    refresh.committed([item], Drafts(torch.tensor([9, 4, 4]), [3]), [3])
    buffer = refresh.buffer
    assert buffer.slots == {1: {3: 0}} and buffer.token[0] == 11 and buffer.output[0]


def test_training_is_not_counted_in_the_step_time_the_budget_learns(tiny_random_qwen3, random_drafters,
                                                                     monkeypatch):
    """A training slice after each step (made to take 100 s of a clock that the engine reads too)
    runs after the draft budget has taken the step's wall time: no recorded step holds a slice."""
    cfg = EngineConfig(model=str(tiny_random_qwen3), spec="dflash", draft=random_drafters["dflash"], block_size=4,
                       num_kv_blocks=64, drafter_refresh="always", drafter_refresh_share=1.0)
    eng = build_engine(cfg)
    refresh, slices, recorded, skew = eng.drafter.refresh, [], [], [0.0]
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skew[0])

    def slice_(idle=False, bound=None):
        skew[0] += 100.0
        slices.append(bound)

    refresh.train_slice = slice_
    record = eng.spec_budget.record
    eng.spec_budget.record = lambda step, acc, seconds, graphed, choice: (recorded.append(seconds),
                                                                         record(step, acc, seconds, graphed, choice))
    _run(eng, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(slices) == len(recorded) >= 3
    assert max(recorded) < 100.0, recorded


def test_refresh_raises_acceptance_on_a_repeated_rollout(tiny_random_qwen3, random_drafters):
    """One prompt generated greedily many times: the refreshed drafter's acceptance on it beats the
    untrained drafter's."""
    torch.manual_seed(0)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def acceptance(eng):
        before = dict(eng.draft_counts.by_key)
        _run(eng, prompt, params, request_id=f"m{len(before)}-{eng.drafter.num_proposals}")
        (proposed, accepted), = [(p - before.get(k, (0, 0))[0], a - before.get(k, (0, 0))[1])
                                 for k, (p, a) in eng.draft_counts.by_key.items()]
        return accepted / proposed

    untrained = acceptance(_engine(tiny_random_qwen3, "dflash", random_drafters["dflash"]))
    eng = _engine(tiny_random_qwen3, "dflash", random_drafters["dflash"], "idle", lr=3e-3)
    _run(eng, prompt, params, n=4)
    for _ in range(60):
        eng.drafter.refresh.train_step()
    refreshed = acceptance(eng)
    assert refreshed > untrained + 0.2, (untrained, refreshed)


def test_fetched_checkpoint_loads_back_and_drafts_alike(tiny_random_qwen3, random_drafters, tmp_path):
    eng = _engine(tiny_random_qwen3, "dspark", random_drafters["dspark"], "always")
    _run(eng, PROMPTS[:2])
    assert eng.drafter.stats()["refresh_swaps"] > 0
    config, data = eng.drafter.checkpoint()
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "model.safetensors").write_bytes(data)
    target = load_model(tiny_random_qwen3)
    loaded = load_drafter(tmp_path, target)
    live = eng.drafter.model
    for name, tensor in checkpoint_tensors(live).items():
        assert torch.equal(checkpoint_tensors(loaded)[name], tensor), name
    g = torch.Generator().manual_seed(0)
    width = live.config.context_size
    aux, ids = torch.randn(2, 12, width, generator=g), torch.randint(0, 200, (2, 12), generator=g)
    anchors, prev = torch.tensor([[2, 6], [1, 5]]), torch.randint(0, 200, (2, 2, 3), generator=g)
    with torch.no_grad():
        ours, theirs = live.train_logits(aux, ids, anchors, prev), loaded.train_logits(aux, ids, anchors, prev)
    torch.testing.assert_close(ours[0].argmax(-1), theirs[0].argmax(-1), rtol=0, atol=0)
    torch.testing.assert_close(ours[1], theirs[1])


def test_refresh_needs_a_drafter_model():
    with pytest.raises(InvalidArgument, match="drafter_refresh"):
        EngineConfig(spec="history", drafter_refresh="idle")
    with pytest.raises(InvalidArgument, match="drafter_refresh"):
        EngineConfig(spec="dflash", drafter_refresh="sometimes")
    with pytest.raises(InvalidArgument, match="drafter_refresh_tokens"):
        EngineConfig(spec="dflash", drafter_refresh="idle", drafter_refresh_tokens=0)
