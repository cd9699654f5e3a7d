"""Where mk runs, decided by the tensors.

Every ``@jit`` function of mk is an ordinary Triton ``JITFunction`` whose launches follow
their tensors: CUDA tensors run the compiled kernel, CPU tensors run the same kernel
through Triton's interpreter (program after program, float32 only). Nothing depends on
``TRITON_INTERPRET`` or on what was imported first.

This module also holds the argument checks shared by every launcher: a bad argument
raises a ``TypeError`` or ``ValueError`` that names it, before anything is written.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
from typing import Sequence

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction


def interpreting(where) -> bool:
    """True when kernels for ``where`` (a tensor, a device or a device string) run through
    the Triton interpreter: anything off a CUDA GPU."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type != "cuda"


def supported_dtypes(where) -> tuple[torch.dtype, ...]:
    """Dtypes the kernels accept for ``where`` (a tensor or a device): the interpreter has no
    reliable bf16 ``tl.dot``, so on the CPU mk computes in float32 only."""
    return (torch.float32,) if interpreting(where) else (torch.bfloat16, torch.float16, torch.float32)


def default_device() -> torch.device:
    """The device mk's models and examples use unless told: the current CUDA GPU if there is
    one, else the CPU (through the Triton interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_dtype(device=None) -> torch.dtype:
    """float32 on the CPU (interpreter), bfloat16 on a GPU; ``device`` defaults to
    :func:`default_device`."""
    return torch.float32 if interpreting(device if device is not None else default_device()) else torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Kernels that run where their tensors are

# The interpreter runs a kernel as Python and calls its device functions as Python. Triton
# builds interpreter-ready functions only when TRITON_INTERPRET is set before a function is
# decorated, which a library cannot promise (whoever imported triton first decided for its
# standard library: tl.sum, tl.max, ...). So while mk interprets a launch, a call of any
# JITFunction runs it through the interpreter too; outside such a launch a call raises
# Triton's own error. One lock: the interpreter patches triton.language for its duration.
_INTERPRETER_LOCK = threading.RLock()
_interpreting_depth = 0
_jit_call = JITFunction.__call__


def _interpreted(fn: JITFunction):
    """The interpreter's twin of ``fn`` (built once)."""
    twin = fn.__dict__.get("_mk_interpreted")
    if twin is None:
        from triton.runtime.interpreter import InterpretedFunction

        twin = fn.__dict__["_mk_interpreted"] = InterpretedFunction(fn.fn)
    return twin


def _call_in_interpreter(self, *args, **kwargs):
    if _interpreting_depth:
        return _interpreted(self)(*args, **kwargs)
    return _jit_call(self, *args, **kwargs)


def _first_device(args, kwargs) -> torch.device | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        base = getattr(a, "base", None)  # a host-side TensorDescriptor
        if isinstance(base, torch.Tensor):
            return base.device
    return None


class Kernel(JITFunction):
    """A ``triton.jit`` function whose launches run where their tensors are: compiled for a
    CUDA GPU, through Triton's interpreter for CPU tensors. As a device function it is
    inlined by the compiler and called by the interpreter."""

    def run(self, *args, grid, warmup, **kwargs):
        device = _first_device(args, kwargs)
        if device is None or device.type == "cuda":
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        if warmup:
            return None
        global _interpreting_depth
        with _INTERPRETER_LOCK:
            if not _interpreting_depth:
                JITFunction.__call__ = _call_in_interpreter
            _interpreting_depth += 1
            try:
                return _interpreted(self).run(*args, grid=grid, warmup=False, **kwargs)
            finally:
                _interpreting_depth -= 1
                if not _interpreting_depth:
                    JITFunction.__call__ = _jit_call

    def __call__(self, *args, **kwargs):
        return _call_in_interpreter(self, *args, **kwargs)


def jit(fn=None, **kwargs):
    """``triton.jit`` for kernels that run where their tensors are (:class:`Kernel`): use it
    for your own kernels that call mk's device functions, so that they run on the CPU too.
    Takes ``triton.jit``'s keyword arguments."""
    if fn is None:
        return functools.partial(jit, **kwargs)
    return Kernel(fn, **kwargs)


@jit
def load_acquire(ptr, GPU: tl.constexpr, SYS: tl.constexpr = False):
    """Load int32 flags with acquire semantics: what their writers' releases guarded is
    visible after it. GPU scope (another block of this GPU wrote the flag), or system scope
    with ``SYS`` (a peer GPU did). ``ptr`` may be a block of pointers: each thread loads the
    elements it holds, so acquires held by different threads are in flight together, where
    one thread's would wait for one another (an acquire orders every later load of its
    thread). Other threads see what a thread acquired after a block barrier. Under the
    interpreter, a volatile load, with an acquire atomic at GPU scope (none on a peer's
    word: an add of 0 racing its owner's store could undo it, and the interpreter's loads
    are already in program order)."""
    if GPU:
        if SYS:
            return tl.inline_asm_elementwise("ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr],
                                             dtype=tl.int32, is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                             dtype=tl.int32, is_pure=False, pack=1)
    else:
        seen = tl.load(ptr, volatile=True)
        if not SYS:
            tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        return seen


@jit
def record_timeout(error_ptr, failed, worker, task, event, seen, expected):
    """A wait that ran out: the first to fail in a launch (none before it: ``failed`` 0, and
    it wins the flag) records (worker, task, event, seen, expected) in the error buffer
    (:data:`mk.persistent.sync.ERROR_WORDS`), which the host turns into an error naming them."""
    if (failed == 0) & (tl.atomic_cas(error_ptr, 0, 1) == 0):
        tl.store(error_ptr + 1, worker)
        tl.store(error_ptr + 2, task)
        tl.store(error_ptr + 3, event)
        tl.store(error_ptr + 4, seen)
        tl.store(error_ptr + 5, expected)


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

    ``dtype=None`` accepts any of :func:`supported_dtypes` for its device; ``shape`` entries of None
    match any size. ``last_dim_contiguous`` asks only for stride 1 in the last dim
    (rows may be strided). Raises TypeError / ValueError naming ``name``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; mk kernels run on cuda (compiled) or cpu (interpreted)")
    allowed = supported_dtypes(t) if dtype is None else (dtype if isinstance(dtype, (tuple, list)) else (dtype,))
    if t.dtype not in allowed:
        where = " on the CPU (Triton interpreter)" if interpreting(t) and dtype is None else ""
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {list(allowed)}{where}")
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


def check_device(name: str, device: object) -> torch.device:
    """A device mk's kernels can run on, given as a torch.device or a string ("cuda:0"); None
    means :func:`default_device`. TypeError / ValueError naming ``name`` for anything else, a
    device type other than cpu and cuda, or a GPU this process does not see."""
    if device is None:
        return default_device()
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"{name} must be a torch.device, a str or None, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} {device!r} is not a device torch knows") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is {device}; mk kernels run on cuda (compiled) or cpu (interpreted)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"{name} is {device}, but this process sees {count} CUDA GPU(s)")
    return device


def check_real(name: str, value: object, *, positive: bool = False) -> float:
    """A finite real number, >= 0 (> 0 with ``positive``): an epsilon, a frequency base, a
    scaling factor. Returns it as a float; TypeError for anything else than a number (a bool
    too), ValueError for nan, inf or a number out of range, naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


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
    anything the previous kernel may write. Needs Hopper (sm_90) or newer.
    """
    return t.is_cuda and capability(t)[0] >= 9


def _index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def capability(t: torch.Tensor) -> tuple[int, int]:
    """Compute capability of ``t``'s GPU (read once per device)."""
    p = _properties(_index(t))
    return p.major, p.minor


def sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of ``t``'s GPU (read once per device)."""
    return _properties(_index(t)).multi_processor_count


def smem_per_block(t: torch.Tensor) -> int | None:
    """Shared memory (bytes) one block may use on ``t``'s GPU; None off the GPU (no limit)."""
    if not t.is_cuda:
        return None
    props = _properties(_index(t))
    return int(getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 49152))


#: Threads whose Triton allocator is set: Triton keeps it in a context variable, so each
#: thread that launches (a server's scheduler thread too) needs its own.
_ALLOCATOR = threading.local()


def enable_device_descriptors() -> None:
    """Give Triton an allocator for the scratch memory of tensor descriptors made on the
    device (``tl.make_tensor_descriptor``), which TMA-streamed task bodies use. Triton's
    allocator is per thread (a context variable): set once in each thread that calls this
    (torch's caching allocator: CUDA-graph capture works)."""
    if getattr(_ALLOCATOR, "set", False) or not torch.cuda.is_available():
        return
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
    _ALLOCATOR.set = True
