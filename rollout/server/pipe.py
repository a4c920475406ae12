"""The engine child's messages to the server's process: pickles whose large buffers (the samples'
masks, numpy arrays) travel out of band.

`send_message` writes the pickle (protocol 5) and then each buffer of `IN_BAND_BYTES` or more
from where it lies, with the GIL released, instead of copying it into the pickle under the engine
process's GIL and out of it again in the parent. One writer per connection.
"""

from __future__ import annotations

import pickle
from typing import Any

IN_BAND_BYTES = 1 << 16  # smaller buffers stay inside the pickle (one write less each)


def send_message(conn, obj: Any) -> None:
    """obj pickled with its large buffers out of band: one pipe message for the pickle (prefixed by
    the number of buffers), then one per buffer. Read with `recv_message`."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < IN_BAND_BYTES:
            return True
        buffers.append(buffer)
        return False

    head = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    conn.send_bytes(len(buffers).to_bytes(4, "little") + head)
    for buffer in buffers:
        conn.send_bytes(buffer.raw())


def recv_message(conn) -> Any:
    """The object `send_message` sent (its out-of-band arrays read-only, on the received bytes)."""
    head = conn.recv_bytes()
    buffers = [conn.recv_bytes() for _ in range(int.from_bytes(head[:4], "little"))]
    return pickle.loads(memoryview(head)[4:], buffers=buffers)
