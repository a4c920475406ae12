"""A detector of host waits for the tests: every operation that, run on a GPU, would make the host
wait for the device (a device -> host read, or a blocking copy), found on CPU.

On CPU nothing waits, so the detector recognises the operations themselves, at two levels:

* dispatch (`TorchDispatchMode`): every aten op the scope runs is also run on the meta device,
  which has shapes but no data. An op whose output cannot be computed there needs the data on
  the host: a value read back (`item`, `is_nonzero`, `equal`, `allclose`), or a shape that
  depends on the data (`nonzero`, `argwhere`, one-argument `where`, `masked_select`, `unique`,
  `bincount`, boolean-mask indexing, `repeat_interleave` without `output_size`, `one_hot`
  without `num_classes`, ...). This is what "running the device part on the meta device" finds,
  op by op, with no list of op names to keep up to date. One data-dependent op runs on meta
  anyway: `index_put_` with a boolean index (`x[mask] = v`), which on CUDA finds the mask's
  nonzeros first; it is flagged by name.
* Python (`TorchFunctionMode`): the readbacks that never reach an aten op on CPU, where the
  tensor already lives on the host: `tolist`, `numpy`, `__array__`, `cpu()`, and the scalar
  conversions (`item`, `bool`, `int`, `float`, `index`), and the blocking copies:
  `.to(device)` / `.cuda()` without `non_blocking=True`, and `torch.tensor` / `as_tensor` /
  `asarray` / `new_tensor` given a device. A host -> device copy is not a read, but a blocking
  one makes the host wait for the stream (rollout/engine/transfer.py), and on CPU a device
  argument cannot tell an upload from a readback (`torch.as_tensor(device_tensor,
  device="cpu")`), so both count. A non-blocking copy (`transfer.upload`, the step's `_to_host`)
  does not wait; reading its result does, and that read is caught where it happens.

* explicit synchronisation: `torch.cuda.synchronize()`, `Stream.synchronize()`,
  `Event.synchronize()` (recorded, and not called where there is no GPU).

A readback recorded at the Python level silences the dispatch level until it returns, so each
wait is counted once. Each wait is recorded with its site: the innermost frame outside torch and
this file. `paused()` leaves out what the test sanctions (the step's one synchronisation).

On CPU every tensor lives on the host, so a read of a genuinely host-side buffer (the grammar's
bitmask, filled by xgrammar on the host) would count: the test declares such buffers with
`on_host`. Not classified: `dst.copy_(src)` between existing tensors (same device on CPU; inside
a step they are device-to-device copies, the copy into host memory being the sanctioned one).
Verdicts of the meta runs are cached per op and argument signature; views and pointwise ops are
not run (their shapes follow from their arguments) unless tagged data-dependent.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

REPO = Path(__file__).resolve().parents[1].as_posix() + "/"
T = torch.Tensor
READBACKS = {T.tolist, T.numpy, T.__array__, T.cpu, T.item, T.__bool__, T.__int__, T.__float__, T.__index__,
             T.__complex__}
UPLOADS = {torch.tensor, torch.as_tensor, torch.asarray, T.new_tensor}  # a host -> device copy given a device
DATA_TAGS = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}  # `equal` is also "pointwise"
SYNCHRONISE = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
BOOL_INDEXED = {torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                torch.ops.aten._index_put_impl_.default}


@dataclass(frozen=True)
class Wait:
    what: str
    file: str  # the site's path from the repository root, e.g. rollout/engine/intake.py
    function: str
    line: int

    def __str__(self) -> str:
        return f"{self.what} at {self.file}:{self.line} ({self.function})"


class HostWaits:
    """`with HostWaits() as waits:` records every host wait in its scope into `waits.found`."""

    def __init__(self):
        self.found: list[Wait] = []
        self._paused = 0
        self._quiet = 0  # inside a Python-level wait already recorded
        self._host: Counter[int] = Counter()  # live storages the test declared host memory (`on_host`)
        self._stack: ExitStack | None = None

    def __enter__(self) -> HostWaits:
        self._stack = ExitStack()
        for owner, name in SYNCHRONISE:
            self._stack.enter_context(_replaced(owner, name, self._synchronise(getattr(owner, name))))
        self._stack.enter_context(_PythonLevel(self))
        self._stack.enter_context(_DispatchLevel(self))
        return self

    def _synchronise(self, real):
        def wrapped(*args, **kw):
            if self.recording:
                self.record(f"{real.__qualname__}()")
            return real(*args, **kw) if torch.cuda.is_available() else None
        return wrapped

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def pausing(self, fn):
        """`fn` run with the detector paused."""
        def wrapped(*args, **kw):
            with self.paused():
                return fn(*args, **kw)
        return wrapped

    def on_host(self, fn):
        """`fn`, whose result is a tensor in host memory (a pinned staging buffer, the grammar's
        bitmask): reading it, or a view of it, is no wait (until it is freed: its address may then
        hold a device tensor)."""
        def wrapped(*args, **kw):
            out = fn(*args, **kw)
            ptr = out.untyped_storage().data_ptr()
            self._host[ptr] += 1
            weakref.finalize(out, self._host.subtract, [ptr])
            return out
        return wrapped

    @property
    def recording(self) -> bool:
        return not self._paused and not self._quiet

    def on_device(self, args, kwargs) -> bool:
        """Whether any tensor among the arguments is not declared host memory."""
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        return not tensors or any(self._host[t.untyped_storage().data_ptr()] <= 0 for t in tensors)

    def record(self, what: str) -> None:
        self.found.append(Wait(what, *_site()))


class _PythonLevel(TorchFunctionMode):
    def __init__(self, waits: HostWaits):
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _python_wait(func, args, kwargs) if self.waits.recording else None
        if what is not None and not self.waits.on_device(args, kwargs):
            what = None
        if what is None:
            return func(*args, **kwargs)
        self.waits.record(what)
        self.waits._quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.waits._quiet -= 1


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, waits: HostWaits):
        super().__init__()
        self.waits = waits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.waits.recording and self.waits.on_device(args, kwargs):
            what = _data_dependent(func, args, kwargs)
            if what is not None:
                self.waits.record(what)
        return func(*args, **kwargs)


def _python_wait(func, args, kwargs) -> str | None:
    name = getattr(func, "__name__", str(func))
    if func in READBACKS:
        return f"Tensor.{name}()"
    if func in UPLOADS and (kwargs.get("device") is not None or (func is torch.as_tensor and len(args) > 2)):
        return f"torch.{name}(..., device=...): a blocking copy"
    if func in (T.to, T.cuda) and _blocking_transfer(func, args, kwargs):
        return f"Tensor.{name}(device) without non_blocking: a blocking copy"
    return None


def _blocking_transfer(func, args, kwargs) -> bool:
    """Whether a `Tensor.to` / `Tensor.cuda` call copies to a device and waits for it."""
    positional = args[1:]
    flags = [a for a in positional if isinstance(a, bool)]  # to(device, dtype, non_blocking, copy)
    non_blocking = kwargs.get("non_blocking", flags[0] if flags else False)
    if func is T.cuda:
        return not non_blocking
    first = positional[0] if positional else None
    to_device = kwargs.get("device") is not None or isinstance(first, (str, torch.device, int, torch.Tensor)) \
        and not isinstance(first, bool)
    return to_device and not non_blocking


def _data_dependent(func, args, kwargs) -> str | None:
    """Why `func` needs its inputs' data on the host, or None."""
    if func in BOOL_INDEXED and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
        return f"{func} with a boolean index"
    tags = set(func.tags)
    if not tags & DATA_TAGS and (func.is_view or torch.Tag.pointwise in tags):  # shapes from the arguments alone
        return None
    key = (func, _signature((args, kwargs)))
    if key not in _VERDICTS:
        try:
            func(*tree_map(_to_meta, args), **{k: _meta_kwarg(k, v) for k, v in kwargs.items()})
            _VERDICTS[key] = None
        except Exception as exc:  # no data-independent implementation
            _VERDICTS[key] = f"{func}: {str(exc).splitlines()[0][:120]}"
    return _VERDICTS[key]


_VERDICTS: dict = {}  # (op, signature) -> the meta run's verdict


def _signature(x):
    """What the meta run's verdict can depend on: the op's arguments with each tensor reduced to its
    dtype and rank, each list of ints to its length (sizes), other values kept."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.dim())
    if isinstance(x, (list, tuple)):
        if x and all(type(v) is int for v in x):
            return ("ints", len(x))
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    if isinstance(x, torch.device):
        return "device"
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.layout,
                               torch.memory_format)) else type(x).__name__


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


def _meta_kwarg(name: str, value):
    if name == "device":
        return torch.device("meta")
    if name == "pin_memory":
        return False
    return tree_map(_to_meta, value)


@contextmanager
def _replaced(owner, name: str, value):
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _site() -> tuple[str, str, int]:
    """The innermost frame outside torch and this file: (path from the repository root, function,
    line)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith("/tests/host_waits.py") or "/contextlib.py" in path:
            continue
        if path.startswith(REPO):
            path = path[len(REPO):]
        return path, frame.name, frame.lineno or 0
    return "?", "?", 0
