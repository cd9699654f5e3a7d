"""mk: LLM decoding as one persistent Triton kernel.

``import mk`` works on any machine and in any import order: kernels run where their
tensors are, compiled for a CUDA GPU or through the Triton interpreter on the CPU (see
:mod:`mk.tasks._device`).
"""

from .tasks._device import default_device, default_dtype, interpreting, jit

__version__ = "0.1.0"
__all__ = ["default_device", "default_dtype", "interpreting", "jit", "__version__"]
