"""Where a Triton kernel runs: compiled on a CUDA device, interpreted on CPU tensors.

With ``TRITON_INTERPRET=1`` set before triton is imported, ``@triton.jit`` already
returns interpreted kernels. Without it, CPU tensors still get the interpreter here, so a
test or a CPU-only deployment never needs the variable; this works because the kernels in
this package call no ``@triton.jit`` helpers of ``triton.language`` (``tl.sum``,
``tl.cdiv``, ...), which only the variable turns into interpretable functions.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hicache.kernels.tuning import TransferTuning


@functools.cache
def _interpreted(kernel: Any) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


def jit_per_call(*varying: str, pointers: tuple[str, ...] = ()) -> Any:
    """``triton.jit`` for a kernel whose arguments ``varying`` (integers) and ``pointers``
    (index tensors, which may start anywhere in a table) change from one call to the next:
    neither is specialised on (integers equal to 1 or divisible by 16, pointers aligned to
    16 bytes), so one compiled variant serves every call and a fresh process compiles or
    loads it once. Triton releases without ``do_not_specialize_on_alignment`` specialise
    the pointers still (a copy plan's warm-up then launches both alignments)."""
    import inspect

    import triton

    options: dict[str, Any] = {"do_not_specialize": [*varying, *pointers]}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = list(pointers)
    return triton.jit(**options)


def compiled_runner(compiled: Any) -> Any:
    """A launch of ``compiled`` (what a Triton kernel's launch returned on a GPU: the
    compiled variant it chose) without Triton's per-call binding, specialisation and
    cache lookup: ``run(grid, stream, args)`` on a 1-D grid and a raw stream handle, with
    every argument in the kernel's order (pointers may be addresses). Only for calls that
    the same variant fits (the caller keeps the specialised arguments as they were). None
    where ``compiled`` is not a compiled kernel (interpreted)."""
    if compiled is None or not hasattr(compiled, "function") or not hasattr(compiled, "run"):
        return None

    def run(grid: int, stream: int, args: tuple) -> None:
        compiled[(grid, 1, 1)](*args, stream=stream)

    return run


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """``kernel`` as it must be launched for tensors on ``device``."""
    from triton.runtime.interpreter import InterpretedFunction

    if device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return kernel
    return _interpreted(kernel)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def max_programs(device: torch.device, tuning: TransferTuning) -> int:
    """The persistent grid bound for a launch on ``device``."""
    if device.type != "cuda":
        return tuning.interpreter_programs
    index = device.index if device.index is not None else torch.cuda.current_device()
    programs = tuning.programs_per_sm * _sm_count(index)
    return min(programs, tuning.grid_limit) if tuning.grid_limit else programs


def require_device_mapped(name: str, host: torch.Tensor, device: torch.device) -> None:
    """A GPU kernel can address host memory only when it is pinned (or registered)."""
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        raise ValueError(
            f"{name} is pageable host memory, which a GPU kernel cannot address; allocate it "
            f"pinned (tensor.pin_memory() or cudaHostRegister) or pass backend='torch'"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
