"""What would make the host wait for a CUDA GPU, found on a CPU: run the code on fake CUDA
tensors (PyTorch's FakeTensorMode needs no GPU) inside `HostSyncs`, which records each operation
that torch.cuda.set_sync_debug_mode("error") would refuse on a GPU, as this version of torch
dispatches it: a value read on the host (`.item()`, `float()`, `.tolist()`, `bool()`), a copy
between the host and the GPU unless `non_blocking` (`.cpu()`, `.to("cuda")` of a host tensor, an
in-place write of a host tensor into a GPU one, as `t[index] = 1` is on torch 2.11), and an output whose size depends
on the data (`nonzero`, a boolean mask's selection, `unique`). tests/test_gpu.py holds it to the
real sync debug mode on a GPU machine.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Outputs whose size the host must read from the GPU before it can allocate them.
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.repeat_interleave.Tensor}


def devices(tree) -> set[str]:
    return {t.device.type for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class HostSyncs(TorchDispatchMode):
    """Records (operation, why) for each host sync the operations inside it would make on a GPU."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        why = self.why(func, args, kwargs or {})
        if why:
            self.found.append((str(func), why))
        return func(*args, **(kwargs or {}))

    @staticmethod
    def why(func, args, kwargs) -> str | None:
        inputs = devices((args, kwargs))
        if func is aten._local_scalar_dense.default and "cuda" in inputs:
            return "a GPU value read on the host"
        if func in DATA_DEPENDENT and "cuda" in inputs:
            return "an output sized by the GPU's data"
        if func in (aten._to_copy.default, aten.copy_.default) and (kwargs.get("non_blocking") or args[2:3] == (True,)):
            return None  # the caller asked not to wait (from pinned memory, nothing does)
        if func in (aten._to_copy.default, aten.copy_.default, aten.index_put_.default, aten.index_put.default):
            target = kwargs.get("device") or (args[0].device if func is not aten._to_copy.default else None)
            source = devices((args[1:], {k: v for k, v in kwargs.items() if k != "device"})) \
                if func is not aten._to_copy.default else {args[0].device.type}
            target_type = torch.device(target).type if target is not None else next(iter(source), None)
            if source and target_type and source != {target_type}:
                return f"a copy between {'/'.join(sorted(source))} and {target_type}"
        return None


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill one block of memory without gaps or overlaps, in any order
    of its dimensions (contiguous, channels last, permuted)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class StagedCopies(TorchDispatchMode):
    """Records each copy from the host to a GPU that torch stages through new, unpinned host memory:
    where the copy is not one block to one block of the same layout, Copy.cu makes the host source
    contiguous first (its temporaries), unless it is so already; and a copy from unpinned memory may
    hold the host until it is through, `non_blocking` or not. `.to` keeps a dense source's layout
    (its strides), so only a source with gaps is staged there; `copy_` stages a non-contiguous
    source unless both sides are dense with the same strides. The sync debug mode does not see it
    (no sync is called), so HostSyncs does not either. (Advanced indexing, index_put_, not covered.)"""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, tuple[int, ...]]] = []  # (operation, the source's shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default and args[0].device.type == "cpu" and \
                torch.device(kwargs.get("device") or "cpu").type == "cuda":
            staged = not is_dense(args[0])
        elif func is aten.copy_.default and args[1].device.type == "cpu" and args[0].device.type == "cuda":
            target, source = args[0], args[1].expand_as(args[0])
            staged = not source.is_contiguous() and not (
                is_dense(source) and is_dense(target)
                and source.stride() == target.stride())
        else:
            staged = False
        if staged:
            self.found.append((str(func), tuple(args[0 if func is aten._to_copy.default else 1].shape)))
        return func(*args, **kwargs)
