"""What a task moves and computes: the numbers the planner's cost model starts from."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TaskCost:
    """Bytes read and written through device memory, and floating-point operations."""

    bytes_read: int
    bytes_written: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def __add__(self, other: "TaskCost") -> "TaskCost":
        return TaskCost(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written,
                        self.flops + other.flops)

    def to_dict(self) -> dict:
        return asdict(self)
