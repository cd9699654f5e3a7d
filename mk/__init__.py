"""mk: LLM decoding as one persistent Triton kernel.

``import mk`` works on any machine: with a CUDA GPU the kernels compile for it, without
one they run through the Triton interpreter on the CPU (see :mod:`mk.tasks._device`).
"""

from .tasks import _device  # noqa: F401  (must run before anything defines a kernel)
from .tasks._device import INTERPRET, default_device, default_dtype

__version__ = "0.1.0"
__all__ = ["INTERPRET", "default_device", "default_dtype", "__version__"]
