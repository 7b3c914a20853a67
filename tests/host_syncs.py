"""Counting the host syncs a piece of code would make on an accelerator, while it runs on the CPU.

On a GPU, reading a tensor's value on the host (item, tolist, bool(t), int(t), .cpu(), .numpy(), torch.equal, ...)
waits for every queued kernel. On the CPU those reads cost nothing, but they are the same calls: `HostSyncCounter`
counts them at the torch-function level (what Python code calls) and, for reads that only show up below it, the
`aten._local_scalar_dense` and device-to-host copies the dispatcher sees.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.is_nonzero,
    torch.Tensor.equal,
    torch.equal,
    torch.allclose,
    torch.Tensor.allclose,
}


def _names_cpu(value: object) -> bool:
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu"


def _is_host_read(func, args, kwargs) -> bool:
    """A call that hands a tensor's value to the host: a listed read, or `.to` the CPU."""
    if func in HOST_READS:
        return True
    if func is torch.Tensor.to:
        return any(_names_cpu(a) for a in args[1:]) or _names_cpu(kwargs.get("device"))
    return False


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.inside_read or not _is_host_read(func, args, kwargs):
            return func(*args, **kwargs)
        self.counter.reads.append(getattr(func, "__name__", str(func)))
        self.counter.inside_read = True
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.inside_read = False


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter.inside_read:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.counter.reads.append("_local_scalar_dense")
            elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                source = args[1] if func is torch.ops.aten.copy_.default else args[0]
                target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
                if source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu":
                    self.counter.reads.append(f"{func} to the host")
        return func(*args, **kwargs)


class HostSyncCounter:
    """`with HostSyncCounter() as syncs: ...`, then `syncs.reads` lists each host read made inside, by name."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.inside_read = False
        self._modes = (_FunctionLevel(self), _DispatchLevel(self))

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.reads)
