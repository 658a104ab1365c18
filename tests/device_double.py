"""A GPU double for machines without one: device discipline, checked on a CPU.

On a GPU, an op that mixes a CUDA tensor with a CPU tensor fails ("Expected all tensors to
be on the same device"), and a CUDA tensor sent through Ray cannot be read by a process that
has no GPU. Neither shows on a CPU-only machine, where every tensor is on the CPU. Under
:class:`DeviceDouble`, tensors can be put on a second device, ``cuda:0`` as far as the code
can tell (``.device``, ``.is_cuda``, ``device=x.device``), while their data stays on the CPU,
and every torch call is checked as CUDA checks it:

- an op whose tensors include one on the device and a CPU tensor of one or more dimensions
  raises :class:`DeviceMix` (0-d CPU tensors are scalars, which CUDA ops accept);
- the transfers are explicit, as on a GPU: ``.to(device)`` / ``.cuda()`` / ``.cpu()`` /
  ``copy_``, and the two implicit ones CUDA performs: indexing a device tensor with CPU
  indices, and assigning a CPU value into it;
- ``.numpy()`` of a device tensor raises, as CUDA's does; ``.tolist()``, ``.item()`` and
  ``int()`` work (a synchronising read, legal on a GPU);
- factory calls with ``device=`` the double's device make device tensors.

It also counts what a GPU would pay for: :attr:`DeviceDouble.to_device` (host-to-device
copies: ``.to`` / ``.cuda``, ``copy_`` into the device, a factory that copies host data to
the device such as ``torch.tensor(list, device=...)``, host indices or values used with a
device tensor, a Python list as an index among them) and :attr:`DeviceDouble.to_host`
(device-to-host copies and synchronising reads: ``.cpu()``, ``copy_`` out, ``tolist``,
``item``, ``int`` / ``float`` / ``bool``), so a test can hold the step to a budget of each
(issue 52: one each way); and :attr:`DeviceDouble.waits`, the calls after which the host has
waited for everything queued on the device: every read (an op whose output's size depends on
a device tensor's values among them: ``nonzero``, a boolean mask as an index, ``unique``,
``repeat_interleave`` of device repeats without ``output_size``), every copy either way not made
``non_blocking`` (CUDA's pageable copies, and torch's blocking ones, wait for the stream:
an implicit one, a list as an index, among them), ``torch.cuda.synchronize`` and an event's
``synchronize`` (:class:`torch.cuda.Event` is the double's here, so code that queues a copy
and waits on its event runs on a CPU). A step launched before the last is read must wait
for nothing (issue 52's overlap: a wait would hold the host until the device is idle).

Everything a model, a proposer or the rejection sampler computes runs under the double with
the weights on the device (:func:`to_double`); what a process returns across a boundary must
hold CPU tensors only (``specserve.serve.wire.host_only``). tests/engine/test_device.py runs
the engine this way and plants mixes to show the double catches them. What it cannot show:
CUDA kernels, streams, NCCL, bf16 numerics (the lent GPU machine's job, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)


class DeviceMix(RuntimeError):
    """A CPU tensor met a device tensor in one op (CUDA's "same device" error)."""


class OnDevice(torch.Tensor):
    """A CPU tensor (``inner``) that reports itself on :data:`DEVICE`. Only
    :class:`DeviceDouble` computes with it: outside the double it is inert."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OnDevice:
        assert not isinstance(inner, OnDevice) and inner.device.type == "cpu"
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(),
                                                   dtype=inner.dtype, device=DEVICE,
                                                   requires_grad=False)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a double-device tensor outside DeviceDouble")

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"


def _on_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


def _unwrap(x):
    return x.inner if isinstance(x, OnDevice) else x


def _wrap(x):
    return OnDevice(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice) else x


# Factories that copy host data (a list, an array) to the device; the others allocate there.
_HOST_DATA_FACTORIES = {"tensor", "as_tensor", "asarray", "from_numpy"}
# Reads of a device tensor's values on the host: each waits for the device.
_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "__format__",
          "__array__"}
# Ops whose output's shape depends on a device tensor's values: CUDA reads the count back
# first, so each waits for the device (a boolean mask as an index, in _count, likewise).
_SIZED_BY_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                    "bincount"}

# Calls that move data between host and device, or read it back: never a mix.
_TRANSFERS = {"to", "cuda", "cpu", "copy_", "tolist", "item", "__int__", "__float__", "__bool__",
              "__index__", "__len__", "__format__", "__repr__", "__getitem__", "__setitem__",
              "index_put_", "__reduce_ex__", "__deepcopy__", "__array__"}


class DeviceDouble(TorchFunctionMode):
    """Context manager: torch calls inside it follow a GPU's device rules (module docstring).
    ``calls`` counts the calls that involved the device, so a test can tell the double was
    exercised at all."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.to_device = 0  # host-to-device copies (module docstring)
        self.to_host = 0    # device-to-host copies and synchronising reads
        self.waits = 0      # calls after which the host waited for the device (module docstring)

    def __enter__(self) -> DeviceDouble:
        # The CUDA runtime calls the engine makes: waiting for the device, and events (no-ops
        # here, where every op has finished when it returns; each wait counted).
        self._cuda = torch.cuda.synchronize, torch.cuda.Event
        torch.cuda.synchronize = lambda device=None: self._waited()
        double = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                pass

            def record(self, stream=None) -> None:
                pass

            def synchronize(self) -> None:
                double._waited()

        torch.cuda.Event = Event
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize, torch.cuda.Event = self._cuda
        super().__exit__(*exc)

    def _waited(self) -> None:
        self.waits += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        on_device = any(isinstance(x, OnDevice) for x in tensors)
        if name == "__get__":  # a property: .device and .is_cuda answer for the wrapper
            prop = func.__self__.__name__
            if on_device and prop == "device":
                return DEVICE
            if on_device and prop == "is_cuda":
                return True
            return func(*tree_map(_unwrap, args), **kwargs)
        if on_device:
            self.calls += 1
            self._count(name, args, kwargs, tensors)
            if name == "numpy":
                raise TypeError("can't convert a cuda:0 device tensor to numpy; copy it to the "
                                "host first (.cpu())")
            if name not in _TRANSFERS:
                host = [x for x in tensors if not isinstance(x, OnDevice) and x.ndim > 0]
                if host:
                    raise DeviceMix(f"{getattr(func, '__qualname__', func)}: expected all tensors "
                                    f"to be on the same device, found cuda:0 and cpu "
                                    f"(a host tensor of shape {tuple(host[0].shape)})")
        if name in ("__getitem__", "index_select") and not isinstance(args[0], OnDevice) and on_device:
            raise DeviceMix("indexing a host tensor with device indices")
        if name in ("to", "cuda", "cpu"):
            out = self._transfer(name, args, kwargs)
            crossed = isinstance(out, OnDevice) != isinstance(args[0], OnDevice)
            self.to_device += crossed and isinstance(out, OnDevice)
            self.to_host += crossed and not isinstance(out, OnDevice)
            self.waits += crossed and not kwargs.get("non_blocking", False)
            return out
        device = kwargs.get("device")
        if _on_device(device):  # a factory call for the device
            self.calls += 1
            self.to_device += name in _HOST_DATA_FACTORIES
            self.waits += name in _HOST_DATA_FACTORIES
            out = func(*tree_map(_unwrap, args), **{**tree_map(_unwrap, kwargs), "device": "cpu"})
            return tree_map(_wrap, out)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if not on_device or name in ("tolist", "item", "__int__", "__float__", "__bool__",
                                     "__index__", "__len__", "__format__", "__repr__"):
            return out
        if name == "__setitem__":
            return out
        return tree_map(_wrap, out)

    def _count(self, name: str, args, kwargs, tensors: list[torch.Tensor]) -> None:
        """Count a device call's implicit transfers (the explicit ones: ``_transfer``)."""
        if name in _READS:
            self.to_host += 1
            self.waits += 1
        elif name in _SIZED_BY_VALUES or (name == "where" and len(args) + len(kwargs) == 1) or (
                name == "repeat_interleave" and "output_size" not in kwargs
                and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), OnDevice)):
            self.waits += 1
            self.to_host += 1
        elif name == "copy_":
            dst, src = args[0], args[1]
            if isinstance(dst, OnDevice) != isinstance(src, OnDevice):
                self.to_device += isinstance(dst, OnDevice)
                self.to_host += not isinstance(dst, OnDevice)
                self.waits += not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_select", "index_copy_",
                      "index_fill_", "scatter_", "gather"):
            leaves, _ = tree_flatten((args[1:], kwargs))
            host = [x for x in leaves if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice)
                    and x.ndim > 0]
            index = args[1] if len(args) > 1 else None
            listed = isinstance(index, list) or (
                isinstance(index, tuple) and any(isinstance(x, list) for x in index))
            self.to_device += bool(host) or listed
            self.waits += bool(host) or listed
            masks = [x for x in (index if isinstance(index, tuple) else (index,))
                     if isinstance(x, OnDevice) and x.dtype == torch.bool]
            if masks and name in ("__getitem__", "__setitem__", "index_put_"):
                self.to_host += 1  # a mask's count (its nonzero) read back first
                self.waits += 1

    @staticmethod
    def _transfer(name, args, kwargs):
        """``.to`` / ``.cuda`` / ``.cpu``: a copy when the data changes sides, as on a GPU."""
        src = args[0]
        if name == "cpu":
            device, dtype = torch.device("cpu"), None
        elif name == "cuda":
            device, dtype = DEVICE, None
        else:
            device, dtype, *_ = torch._C._nn._parse_to(*args[1:], **kwargs)
        here = isinstance(src, OnDevice)
        there = here if device is None else _on_device(device)
        inner = _unwrap(src)
        out = inner.to(dtype=dtype) if dtype is not None else inner
        if there != here and out is inner:
            out = inner.clone()
        if not there:
            return out
        return src if here and out is inner else OnDevice(out)


def to_double(module: torch.nn.Module) -> torch.nn.Module:
    """Put ``module``'s parameters and buffers on the double's device, in place (tied
    parameters stay tied)."""
    seen: dict[int, OnDevice] = {}
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for key, value in store.items():
                if value is None or isinstance(value, OnDevice):
                    continue
                if id(value) not in seen:
                    seen[id(value)] = OnDevice(value.detach())
                store[key] = seen[id(value)]
    return module
