"""The one outbox (rollout.server.outbox) behind the engine loop and both ends of the engine
process: one send per batch (per event-loop iteration when given a loop), and a batch that fails
is sent one message at a time, the messages that still fail going to `on_error`."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rollout.server.outbox import Outbox


class Pipe:
    """A pipe-like `send` that pickles its batch, as multiprocessing's Connection.send does."""

    def __init__(self):
        self.sent: list[list] = []

    def send(self, batch: list) -> None:
        pickle.dumps(batch)
        self.sent.append(list(batch))


def test_posts_of_one_loop_iteration_go_in_one_send():
    pipe = Pipe()

    async def main():
        out = Outbox(pipe.send, asyncio.get_running_loop())
        for i in range(3):
            out.post(i)
        await asyncio.sleep(0)
        out.post(3)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert pipe.sent == [[0, 1, 2], [3]]


def test_a_message_that_cannot_be_sent_does_not_take_the_others_with_it():
    pipe, failed = Pipe(), []
    out = Outbox(pipe.send, on_error=lambda message, exc: failed.append((message, type(exc))))
    out.post("a")
    out.post(lambda: None)  # does not pickle
    out.post("b")
    out.flush()
    assert pipe.sent == [["a"], ["b"]]
    assert [type(m).__name__ for m, _ in failed] == ["function"] and failed[0][1] is not None


def test_without_on_error_a_failed_send_raises_and_an_empty_outbox_sends_nothing():
    pipe = Pipe()
    out = Outbox(pipe.send)
    out.flush()
    assert pipe.sent == []
    out.post(lambda: None)
    with pytest.raises(Exception, match="pickle"):
        out.flush()
    out.flush()  # the failed batch is not kept
    assert pipe.sent == []
