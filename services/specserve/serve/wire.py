"""What crosses a process boundary, counted: the bytes a unit's coordinator receives from its
target and draft groups (``specserve:unit_received_bytes_total``; tests/serve/test_wire.py
holds it under 1 KB per row and step for sampled rows).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

import torch


class DeviceTensorCrossing(TypeError):
    """A tensor off the host was about to cross a process boundary."""


def wire_bytes(obj) -> int:
    """The bytes ``obj`` takes on the wire: its pickle, each tensor counted at its data size
    (Ray ships tensor data as out-of-band buffers; pickling them here would only copy them).
    Raises :class:`DeviceTensorCrossing` for a tensor that is not on the CPU: a process
    without that device could not read it (and the copy would be hidden in the pickle)."""
    buffer = io.BytesIO()
    counter = _Counter(buffer, protocol=5)
    counter.dump(obj)
    return buffer.tell() + counter.data


class _Counter(pickle.Pickler):
    """A pickler that writes each tensor as a placeholder and adds up its data's bytes
    (one class for every call: :func:`wire_bytes` runs on every reply of every step)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.data = 0

    def reducer_override(self, value):
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise DeviceTensorCrossing(
                    f"a {value.device} tensor of shape {tuple(value.shape)} would cross a "
                    "process boundary; only CPU tensors and plain data may")
            self.data += value.nbytes
            return tuple, ((),)
        return NotImplemented


def host_only(obj):
    """``obj``, after checking that it holds no tensor off the host (what an actor returns
    passes through here)."""
    wire_bytes(obj)
    return obj


@dataclass
class Traffic:
    """Bytes received from one group, and the calls they came in."""

    bytes: int = 0
    calls: int = 0

    def add(self, obj) -> None:
        self.bytes += wire_bytes(obj)
        self.calls += 1
