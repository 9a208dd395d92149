"""Counting device → host reads in Python code, to keep them out of the training step.

On a GPU every read of a device tensor's value from Python (``.item()``, ``.tolist()``,
``.cpu()``, ``float(t)`` ...) makes the host wait until the GPU has drained its queue: the CPU can
no longer run ahead and launch the next kernels while the current ones run. :class:`HostReadCounter`
is a ``TorchFunctionMode`` that counts such calls (and can keep their stacks), so a test can pin the
number per optimizer step and a benchmark can report it. It sees the Python API only: syncs inside
ops (``nonzero``, boolean-mask indexing, ``bincount`` on CUDA) are invisible to it — on a GPU,
``torch.cuda.set_sync_debug_mode("warn")`` reports those (``benchmarks/gpu_check.py``).

On a CPU-only machine every tensor is a host tensor; ``device_type`` selects the tensors whose reads
count (``"cpu"`` there, ``"cuda"`` on a GPU, where reads of CPU tensors — e.g. the stop-flag
agreement — cost no device sync).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReadCounter", "READS"]

# The Python-level ways to read a tensor's values on the host.
READS: dict[object, str] = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__index__: "index",
    torch.Tensor.__array__: "__array__",
}


def _moves_to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` copies a tensor from another device to the CPU (a
    ``.to(device)`` that keeps the device is no read, whatever the device)."""
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            target = a
    return (target is not None and torch.device(target).type == "cpu"
            and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu")


class HostReadCounter(TorchFunctionMode):
    """Context manager counting host reads of tensors on ``device_type``.

    Attributes:
        count: reads so far (set ``counting = False`` to pause).
        kinds: Counter of read kinds (``item``, ``tolist``, ...).
        stacks: with ``keep_stacks``, the Python stack of every counted read (for a test's message).
    """

    def __init__(self, device_type: str = "cpu", keep_stacks: bool = False):
        super().__init__()
        self.device_type, self.keep_stacks = device_type, keep_stacks
        self.counting = True
        self.count = 0
        self.kinds: Counter[str] = Counter()
        self.stacks: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = READS.get(func)
        if kind is None and func is torch.Tensor.to and _moves_to_cpu(args, kwargs):
            kind = "to(cpu)"
        # On a CPU-only machine a call that would read a GPU tensor counts on the CPU tensor that
        # stands in for it (``.cpu()`` included; ``.to(device)`` only when it changes the device).
        if self.counting and kind is not None and args and isinstance(args[0], torch.Tensor):
            if args[0].device.type == self.device_type:
                self.count += 1
                self.kinds[kind] += 1
                if self.keep_stacks:
                    self.stacks.append("".join(traceback.format_stack(limit=12)[:-1]))
        return func(*args, **kwargs)

    def reset(self) -> None:
        self.count = 0
        self.kinds.clear()
        self.stacks.clear()
