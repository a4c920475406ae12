"""Host memory that weight uploads land in, shared by the server's process and the engine's.

One anonymous memory file (memfd) per server, mapped in both processes: the gRPC handler writes
each tensor's bytes into it as pieces arrive, and the engine process reads them from its own
mapping, so a 16 GB update is never pickled through the engine's pipe. The file holds at most
`WeightSpecs.budget()` bytes (every accepted tensor once, page aligned), so an upload cannot take
more than the model's size; `release` gives the pages back to the system after each update
(or keeps them mapped for the next one: faster, the bound stays). A memfd is not limited by the
size of /dev/shm, has no name to leak, and goes away with the last process holding it. The
engine process gets the descriptor at spawn (pickling a `HostArena` while a process is being
spawned passes its descriptor to the child).

Fresh pages cost the kernel an allocation and a zero-fill on first touch, several times the cost
of the copy that touches them. So a tensor's space is populated (MADV_POPULATE_WRITE, Linux
5.14+) by a background thread as soon as it is taken, while its bytes are still on the network.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import threading
import warnings
from multiprocessing import reduction

import torch

from rollout.engine.weight_specs import ALIGN
from rollout.errors import ResourceExhausted

# torch.frombuffer warns that read-only buffers (received messages) are not writable; they are
# only ever read here.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
MADV_POPULATE_WRITE = 23
POPULATE_CHUNK = 64 << 20


class HostArena:
    """A bump allocator over a shared memory file (see the module docstring)."""

    def __init__(self, fd: int | None = None):
        self.fd = os.memfd_create("rollout-weights", os.MFD_CLOEXEC) if fd is None else fd
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None  # [size] uint8 over the mapping
        self.used = 0
        self._resident = 0  # bytes from the start known to be backed by pages (kept by a release)
        self._populator: _Populator | None = None

    def __reduce__(self):  # only while spawning the engine process: the child gets the descriptor
        return _attach, (reduction.DupFd(self.fd),)

    @property
    def size(self) -> int:
        return 0 if self._bytes is None else self._bytes.numel()

    def reserve(self, nbytes: int) -> None:
        """Makes the file (and this process's mapping) at least `nbytes` long (the server's side)."""
        if nbytes > os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, nbytes)
        self.map(nbytes)

    def map(self, nbytes: int) -> None:
        """Maps the first `nbytes` of the file (the engine's side, after the server reserved them).
        A mapping of another size is replaced; views of the old one stay valid."""
        if nbytes != self.size:
            self._map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if nbytes else None

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(offset, [nbytes] uint8 view) of fresh space; ResourceExhausted past the reserved size."""
        offset, end = self.used, self.used + nbytes
        if end > self.size:
            raise ResourceExhausted(f"weights: the upload needs more than the {self.size} bytes reserved for it")
        self.used = -(-end // ALIGN) * ALIGN
        if end > self._resident:
            self._populator = self._populator or _Populator()
            start = max(offset, self._resident)
            self._populator.add(self._bytes.data_ptr() + start, end - start)
        return offset, self.view(offset, nbytes)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """[nbytes] uint8 of the mapping at `offset`."""
        return self._bytes[offset : offset + nbytes]

    def release(self, give_back: bool = True) -> None:
        """Forgets every allocation; `give_back` also returns the pages to the system (the file
        keeps its size, so no mapping ever points past its end)."""
        if give_back and self._map is not None:
            with self._populator.cancelled() if self._populator else contextlib.nullcontext():
                self._map.madvise(mmap.MADV_REMOVE)
            self._resident = 0
        else:
            self._resident = max(self._resident, self.used)
        self.used = 0

    def resident_bytes(self) -> int:
        """Bytes of the file backed by memory now."""
        return os.fstat(self.fd).st_blocks * 512


def _attach(fd: reduction.DupFd) -> HostArena:
    return HostArena(fd.detach())


class _Populator:
    """A daemon thread that populates the pages of address ranges, in order, a chunk at a time
    (ctypes releases the GIL for the call). `cancelled()` drops the ranges queued and holds the
    thread while the caller gives the pages back."""

    def __init__(self):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._ranges: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._generation = 0
        self._works = True
        threading.Thread(target=self._run, name="rollout-weights-populate", daemon=True).start()

    def add(self, address: int, nbytes: int) -> None:
        page = mmap.PAGESIZE
        start = address // page * page
        if self._works and nbytes:
            self._ranges.put((self._generation, start, address + nbytes - start))

    @contextlib.contextmanager
    def cancelled(self):
        with self._lock:
            self._generation += 1
            yield

    def _run(self) -> None:
        while self._works:
            generation, address, nbytes = self._ranges.get()
            for offset in range(0, nbytes, POPULATE_CHUNK):
                with self._lock:
                    if generation != self._generation:
                        break
                    size = min(POPULATE_CHUNK, nbytes - offset)
                    if self._libc.madvise(address + offset, size, MADV_POPULATE_WRITE) != 0:
                        self._works = False  # (an older kernel: EINVAL) the copies fault the pages in
                        break
