"""`rollout.server.loop.EngineLoop` on its own, with a scripted engine: command results and
deliveries reach the event loop in order, a command whose future was cancelled while it waited
still runs and leaves the loop serving, the deliveries of one step come in one wake-up, and a
weight update that comes after the loop stopped is refused instead of waiting forever."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.errors import Unavailable
from rollout.outputs import SampleOutput
from rollout.server.convert import GenerateCall
from rollout.server.loop import Delivery, EngineLoop


class ScriptedEngine:
    """Finishes every running sample in one step, except those of the requests in `keep`; `gate`
    holds each step until it is set."""

    def __init__(self):
        self.running: list[tuple[str, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.steps = 0
        self.keep: set[str] = set()

    def add_request(self, request_id, prompts, params, n=1, mask=None, grammar=None, return_text=False) -> None:
        self.running += [(request_id, p) for p in range(len(prompts))]

    def step(self) -> list[SampleOutput]:
        self.gate.wait()
        self.steps += 1
        done = [r for r in self.running if r[0] not in self.keep]
        self.running = [r for r in self.running if r[0] in self.keep]
        return [SampleOutput(rid, p, 0, [1], token_ids=[2]) for rid, p in done]

    def abort(self, request_id) -> list[SampleOutput]:
        return []

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def weight_update_pending(self) -> bool:
        return False

    def compiled(self) -> dict[str, int]:  # as if the first step captured one CUDA graph
        return dict(graphs=min(self.steps, 1), kernels=0)


def _call(request_id: str, prompts: int = 1) -> GenerateCall:
    return GenerateCall(request_id, [[1]] * prompts, params=None, n=1, mask=None, grammar=None)


def test_cancelled_command_still_runs_and_the_loop_keeps_serving():
    async def main():
        engine = ScriptedEngine()
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop())
        await loop.start()
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        engine.gate.clear()
        await loop.add(_call("a"), inbox.put_nowait)  # the engine now waits inside its step
        late = loop.call(lambda e: "ran")
        late.cancel()  # cancelled while queued behind the step
        engine.gate.set()
        assert (await inbox.get()).done
        assert await loop.call(lambda e: e.steps) == 1
        await loop.stop()

    asyncio.run(asyncio.wait_for(main(), 30))  # a dead engine thread fails instead of hanging


def test_one_step_delivers_every_request_in_one_wake_up():
    async def main():
        engine = ScriptedEngine()
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop())
        await loop.start()
        inboxes = {rid: asyncio.Queue() for rid in "abcd"}
        engine.gate.clear()
        await loop.call(lambda e: [loop._add(e, _call(rid, prompts=2), q.put_nowait) for rid, q in inboxes.items()])
        posted = []
        real = asyncio.get_running_loop().call_soon_threadsafe

        def counting(fn, *args):
            posted.append(fn)
            return real(fn, *args)

        asyncio.get_running_loop().call_soon_threadsafe = counting
        engine.gate.set()
        deliveries = [await inbox.get() for inbox in inboxes.values()]
        assert [len(d.samples) for d in deliveries] == [2, 2, 2, 2] and all(d.done for d in deliveries)
        assert len(posted) == 1
        del asyncio.get_running_loop().call_soon_threadsafe
        await loop.stop()

    asyncio.run(asyncio.wait_for(main(), 30))  # a dead engine thread fails instead of hanging


def test_a_busy_period_is_logged_when_the_engine_goes_idle(caplog):
    """`engine_idle` carries the period's steps, the tokens it finished and the CUDA graphs it
    captured, once per period."""
    import logging

    from rollout.server.logs import LOGGER_NAME

    async def main():
        engine = ScriptedEngine()
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop())
        await loop.start()
        for rid in "ab":  # two busy periods of one step each
            inbox: asyncio.Queue[Delivery] = asyncio.Queue()
            await loop.add(_call(rid, prompts=3), inbox.put_nowait)
            assert (await inbox.get()).done
            await loop.call(lambda e: None)  # the loop has come round to idle
        await loop.stop()

    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        asyncio.run(asyncio.wait_for(main(), 30))
    periods = [r.fields for r in caplog.records if r.getMessage() == "engine_idle"]
    assert len(periods) == 2
    for fields in periods:
        assert fields["steps"] == 1 and fields["finished_tokens"] == 3
        assert 0 <= fields["step_ms"] <= fields["busy_ms"] and fields["cpu_ms"] >= 0
    assert [(p["new_graphs"], p["new_kernels"]) for p in periods] == [(1, 0), (0, 0)]  # the first period's


def test_the_busy_period_says_when_its_first_step_began_and_its_last_request_came(caplog):
    """A request admitted while another runs: the period's log line has the first step at its start
    and the last admission after the step was let go (both in ms from the period's start). Checked
    against the test's own clock readings around each event, not a fixed number of ms (a busy
    machine may delay any of them, so `first_step_ms < 150` could flake); still fails if first_step
    is taken at every step, or last_admitted is never taken."""
    import logging
    import time

    from rollout.server.logs import LOGGER_NAME

    class TimedEngine(ScriptedEngine):
        def step(self):
            clock.setdefault("first_step_entered", time.perf_counter())
            return super().step()

    clock: dict[str, float] = {}

    async def main():
        engine = TimedEngine()
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop())
        await loop.start()
        engine.gate.clear()
        engine.keep.add("a")  # "a" runs until "b" is in
        inboxes = {rid: asyncio.Queue() for rid in "ab"}
        clock["a_sent"] = time.perf_counter()  # the period starts after this
        await loop.add(_call("a"), inboxes["a"].put_nowait)  # its first step now waits at the gate
        late = asyncio.ensure_future(loop.add(_call("b"), inboxes["b"].put_nowait))  # admitted after the step
        await asyncio.sleep(0.2)
        clock["gate_opened"] = time.perf_counter()
        engine.gate.set()
        await late
        clock["b_admitted"] = time.perf_counter()
        await loop.call(lambda e: e.keep.clear())
        for inbox in inboxes.values():
            assert (await inbox.get()).done
        await loop.call(lambda e: None)
        await loop.stop()

    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        asyncio.run(asyncio.wait_for(main(), 30))
    (period,) = [r.fields for r in caplog.records if r.getMessage() == "engine_idle"]
    ms = {name: (t - clock["a_sent"]) * 1e3 for name, t in clock.items()}
    first, last = period["first_step_ms"], period["last_admitted_ms"]  # rounded to 0.01 ms
    assert period["steps"] >= 2
    assert 0 <= first <= ms["first_step_entered"] + 0.01
    assert last - first >= ms["gate_opened"] - ms["first_step_entered"] - 0.02
    assert last <= min(ms["b_admitted"] + 0.01, period["busy_ms"])


def test_an_abort_that_returns_a_failed_sample_fails_the_request():
    """`engine.abort` may hand back a sample that failed (its masks overflowed): the request then
    ends with FAILED_PRECONDITION, as a failed step's sample does, not with a bad row."""
    from rollout.errors import FailedPrecondition

    class FailingAbort(ScriptedEngine):
        def abort(self, request_id):
            self.running = []
            return [SampleOutput(request_id, 0, 0, [1], token_ids=[], finish_reason="error",
                                 error="mask support exceeded its bound of 2")]

    async def main():
        engine = FailingAbort()
        engine.keep.add("a")
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop())
        await loop.start()
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        await loop.add(_call("a"), inbox.put_nowait)
        assert await loop.abort("a", "test") == 1
        delivery = await inbox.get()
        assert delivery.done and delivery.samples == []
        assert isinstance(delivery.error, FailedPrecondition) and "bound" in str(delivery.error)
        await loop.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_draft_budget_is_logged_after_the_first_step_and_when_idle(caplog, monkeypatch):
    """An engine with a draft budget: a `spec_budget` line after the first step, none within
    SPEC_LOG_SECONDS after, then one when the busy period ends (the choices since the last line);
    an engine without one (`ScriptedEngine`) logs none (the other tests)."""
    import logging

    from rollout.server import loop as loop_mod
    from rollout.server.logs import LOGGER_NAME

    class BudgetEngine(ScriptedEngine):
        summaries = 0

        def spec_budget_summary(self) -> dict:
            self.summaries += 1
            return dict(steps=self.steps, drafts_per_row=1.5, request_accept_length={"a": 2.0})

    monkeypatch.setattr(loop_mod, "SPEC_LOG_SECONDS", 3600.0)

    async def main():
        engine = BudgetEngine()
        engine.keep.add("a")
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop())
        await loop.start()
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        await loop.add(_call("a"), inbox.put_nowait)
        while await loop.call(lambda e: e.steps) < 5:
            await asyncio.sleep(0.01)
        await loop.call(lambda e: e.keep.clear())
        assert (await inbox.get()).done
        await loop.call(lambda e: None)
        await loop.stop()
        return engine

    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        engine = asyncio.run(asyncio.wait_for(main(), 30))
    lines = [r.fields for r in caplog.records if r.getMessage() == "spec_budget"]
    assert len(lines) == engine.summaries == 2
    assert lines[0]["steps"] == 1 and lines[1]["steps"] >= 5 and lines[1]["request_accept_length"] == {"a": 2.0}


class _Stage:
    closed = False

    def count(self, draft: bool) -> int:
        return 1

    def close(self) -> None:
        self.closed = True


def test_a_weight_update_queued_after_the_loop_stopped_is_refused_not_left_waiting():
    async def main():
        engine = ScriptedEngine()
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop())
        await loop.start()
        await loop.stop()
        stage = _Stage()
        job = type("Job", (), dict(token="t", update_id="", stage=lambda self, engine, side: stage))()
        with pytest.raises(Unavailable, match="engine loop has stopped"):
            await loop.update_weights(job)
        assert stage.closed

    asyncio.run(asyncio.wait_for(main(), 30))  # a lost update fails instead of hanging
