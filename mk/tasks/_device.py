"""Where mk runs, decided in one place.

With a CUDA GPU, every `@triton.jit` function in mk compiles to GPU code. Without one,
mk switches Triton to its interpreter (``TRITON_INTERPRET=1``) before any kernel is
defined, so the same kernels run on the CPU, program after program, in float32.
Setting ``TRITON_INTERPRET`` yourself (to 1 or 0) overrides the choice.

This module also holds the argument checks shared by every launcher: a bad argument
raises a ``TypeError`` or ``ValueError`` that names it, before anything is written.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch


def _decide_interpret() -> bool:
    env = os.environ.get("TRITON_INTERPRET")
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    return not torch.cuda.is_available()


#: True when kernels run through the Triton interpreter on the CPU.
INTERPRET: bool = _decide_interpret()
if INTERPRET:
    # Must happen before triton.jit decorates anything: the decorator reads it.
    os.environ["TRITON_INTERPRET"] = "1"

#: Dtypes the kernels accept here. The interpreter has no reliable bf16 `tl.dot`,
#: so on the CPU mk computes in float32 only.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    (torch.float32,) if INTERPRET else (torch.bfloat16, torch.float16, torch.float32)
)


def default_device() -> torch.device:
    """The device mk's kernels run on: ``cpu`` under the interpreter, else ``cuda``."""
    return torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())


def default_dtype() -> torch.dtype:
    """float32 on the CPU (interpreter), bfloat16 on a GPU."""
    return torch.float32 if INTERPRET else torch.bfloat16


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    contiguous: bool = True,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check one launcher argument and return it.

    ``dtype=None`` accepts any of :data:`SUPPORTED_DTYPES`; ``shape`` entries of None
    match any size. ``last_dim_contiguous`` asks only for stride 1 in the last dim
    (rows may be strided). Raises TypeError / ValueError naming ``name``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = SUPPORTED_DTYPES if dtype is None else (dtype if isinstance(dtype, (tuple, list)) else (dtype,))
    if t.dtype not in allowed:
        where = " on the CPU (Triton interpreter)" if INTERPRET and dtype is None else ""
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {list(allowed)}{where}")
    want = default_device()
    if t.device.type != want.type:
        raise ValueError(f"{name} is on {t.device}, but mk kernels run on {want.type} here")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in dims:
            raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            pretty = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {pretty}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if last_dim_contiguous and t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got strides {t.stride()}")
    return t


def check_same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    """All named tensors share one dtype; returns it."""
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"dtypes differ: {', '.join(f'{n}={d}' for n, d in dtypes.items())}")
    return next(iter(dtypes.values()))


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All named tensors live on one device; returns it."""
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {', '.join(f'{n}={d}' for n, d in devices.items())}")
    return next(iter(devices.values()))


def check_positive_int(name: str, value: object, *, maximum: int | None = None) -> int:
    """An int ≥ 1 (and ≤ maximum when given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1 or (maximum is not None and value > maximum):
        bound = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be >= 1{bound}, got {value}")
    return value


def is_capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on ``t``'s device.

    Checks that read tensor values back to the host (token ids in range, lengths within
    the cache) would break the capture; launchers skip them then and trust the values.
    """
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def use_pdl(t: torch.Tensor) -> bool:
    """Launch with programmatic dependent launch (PDL) on ``t``'s device?

    With PDL a kernel may start while the previous kernel on the stream drains; mk's
    kernels that take it issue their weight prefetches, then ``gdc_wait`` before touching
    anything the previous kernel may write. Needs Hopper (sm_90) or newer; ``MK_PDL=0``
    turns it off.
    """
    if INTERPRET or not t.is_cuda or os.environ.get("MK_PDL", "1").strip() in ("0", "false", "no", "off"):
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


@functools.lru_cache(maxsize=None)
def _smem_optin(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 49152))


def smem_per_block(t: torch.Tensor) -> int | None:
    """Shared memory (bytes) one block may use on ``t``'s GPU; None off the GPU (no limit)."""
    if INTERPRET or not t.is_cuda:
        return None
    return _smem_optin(t.device.index if t.device.index is not None else torch.cuda.current_device())


_ALLOCATOR_SET = False


def enable_device_descriptors() -> None:
    """Give Triton an allocator for the scratch memory of tensor descriptors made on the
    device (``tl.make_tensor_descriptor``), which TMA-streamed task bodies use. Sets Triton's
    process-wide allocator once (torch's caching allocator: CUDA-graph capture works)."""
    global _ALLOCATOR_SET
    if _ALLOCATOR_SET or INTERPRET:
        return
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
    _ALLOCATOR_SET = True
