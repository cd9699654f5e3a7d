"""mk: LLM decoding as one persistent Triton kernel.

``import mk`` works on any machine and in any import order: kernels run where their
tensors are, compiled for a CUDA GPU or through the Triton interpreter on the CPU (see
:mod:`mk.tasks._device`). ``import mk`` itself is light (torch and Triton load with the
first name used), so that ``python -m mk`` answers at once and a Ctrl-C while it starts
ends cleanly.
"""

__version__ = "0.1.0"
__all__ = ["default_device", "default_dtype", "interpreting", "jit", "__version__"]


def __getattr__(name: str):
    if name in __all__:
        from .tasks import _device

        return getattr(_device, name)
    raise AttributeError(f"module 'mk' has no attribute {name!r}")
