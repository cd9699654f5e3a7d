"""mk's task library: Triton device functions, each also usable as an ordinary op.

Every task file holds ``<task>_tile`` (the ``@triton.jit`` device function a persistent
kernel calls; it touches only its own tile), a standalone launcher (the op), and
``<task>_ref`` (a plain torch reference).
"""

from . import _device  # first: picks compiled CUDA or the interpreter before any @triton.jit
from ._cost import TaskCost
from ._device import INTERPRET, SUPPORTED_DTYPES, default_device, default_dtype
from .rmsnorm import rmsnorm, rmsnorm_ref, rmsnorm_tile

__all__ = [
    "INTERPRET", "SUPPORTED_DTYPES", "TaskCost", "default_device", "default_dtype",
    "rmsnorm", "rmsnorm_ref", "rmsnorm_tile",
]
