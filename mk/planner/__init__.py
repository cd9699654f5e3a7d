"""The planner: op DAG, shared-memory and cost models, search, lowering."""

from .device import PRESETS, DeviceSpec, parse_bytes

__all__ = ["PRESETS", "DeviceSpec", "parse_bytes"]
