"""Counting the host syncs a piece of code would make on an accelerator, while it runs on the CPU.

On a GPU, reading a tensor's value on the host (item, tolist, bool(t), int(t), .cpu(), .numpy(), torch.equal, ...)
waits for every queued kernel. On the CPU those reads cost nothing, but they are the same calls: `HostSyncCounter`
counts them at the torch-function level (what Python code calls) and, for reads that only show up below it, the
`aten._local_scalar_dense` and device-to-host copies the dispatcher sees.

On the CPU, `.to(device)` of a tensor built on the host and a read back with `.to("cpu")` are the same call, so
`.to` is not counted there: code that reads back says so with `.cpu()`, `.tolist()` or `.item()`. FlexAttention's
eager call compiles itself, which no dispatch mode may watch: `below_functions=False` counts calls only.
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


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.inside_read or func not in HOST_READS:
            return func(*args, **kwargs)
        self.counter.reads.append(getattr(func, "__name__", str(func)))
        self.counter.inside_read = True
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.inside_read = False


class _DispatchLevel(TorchDispatchMode):
    supports_higher_order_operators = True  # e.g. flex_attention, whose kernel reads nothing back

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):  # runs below this mode, unseen
            return func(*args, **kwargs)
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

    def __init__(self, below_functions: bool = True) -> None:
        self.reads: list[str] = []
        self.inside_read = False
        self._modes = (_FunctionLevel(self), _DispatchLevel(self)) if below_functions else (_FunctionLevel(self),)

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
