"""Host data to the device inside a step without waiting for the device.

`torch.tensor(data, device="cuda")` and a plain `.to("cuda")` are blocking copies: PyTorch
synchronises the stream before returning, so a step that builds a small index tensor after
launching the forward would wait for the whole forward and then launch the rest of the step
serially. `upload` builds the tensor on the host and copies it with `non_blocking=True`: from
pageable memory the driver stages the bytes before returning (so the host tensor may go away)
and, for copies as small as a step's index tensors (well under 64 KiB), does not wait for the
stream (the GPU step profile in BENCHMARKS.md shows it). Very large batches could cross
that size, where pinned host buffers would be the next step. tests/test_host_syncs.py flags
blocking uploads inside a step.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, TypeVar

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}
Group = TypeVar("Group", bound=NamedTuple)


def upload(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or nested list, or host array or tensor) as a tensor on `device`, queued behind the
    stream's work instead of waiting for it. Lists go through numpy, which converts them several
    times faster than torch.tensor does (a long penalty history is millions of ids)."""
    host = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.asarray(data, dtype=_NUMPY[dtype]))
    return host.to(device=device, dtype=dtype, non_blocking=True)


def upload_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several int64 host arrays as device tensors with one copy (see `upload`): flat views of
    one device buffer, in order."""
    packed = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]))
    return list(upload(packed, torch.int64, device).split_with_sizes([a.size for a in arrays]))


def upload_groups(groups: tuple[Group, ...], device: torch.device) -> tuple[Group, ...]:
    """Named tuples of int64 host arrays as the same named tuples of device tensors, all in one
    copy (`upload_packed`): fields are read by name on both sides."""
    flat = iter(upload_packed([a for group in groups for a in group], device))
    return tuple(type(group)._make(itertools.islice(flat, len(group))) for group in groups)
