"""The ranks of one tensor-parallel model: whether torch.distributed joins them, the checks
and agreements they make together, and whether they are still in step."""

from __future__ import annotations

import torch


class Ranks:
    """This process's place among the ``tp`` ranks of a model (``rank``, on ``device``).

    Also :class:`mk.planner.cache.Ranks` for planning in ``measure`` mode (every rank times
    rank 0's candidates together): :meth:`all` and :meth:`share`.
    """

    def __init__(self, tp: int, rank: int, device: torch.device):
        self.tp, self.rank, self.device = tp, rank, device
        self.lead = rank == 0
        #: Why the ranks are out of step, once one left its peers mid-collective (None until then).
        self.out_of_step: str | None = None

    @property
    def joined(self) -> bool:
        """Whether torch.distributed joins the ranks (several, each a process); not for ranks
        simulated in one process, as the tests' VM runs them, which plan and build alike by
        construction."""
        import torch.distributed as dist

        return self.tp > 1 and dist.is_available() and dist.is_initialized()

    def check_in_step(self) -> None:
        """Refuse work once a rank has left its peers mid-collective: any collective it ran
        next would pair with theirs."""
        if self.out_of_step:
            raise RuntimeError(f"this tensor-parallel model's ranks are out of step ({self.out_of_step}); "
                               f"start the processes again")

    def check_alike(self, mine: dict) -> None:
        """Refuse, on every rank, ranks whose ``mine`` (the options that decide how they cut
        prefill chunks and plan steps) differ (a collective where :attr:`joined`)."""
        import torch.distributed as dist

        if not self.joined:
            return
        everyone = [None] * self.tp
        dist.all_gather_object(everyone, mine)
        odd = sorted({k for other in everyone for k in mine if other[k] != everyone[0][k]})
        if odd:
            raise ValueError("the ranks of a tensor-parallel model must be built alike; they differ in "
                             + "; ".join(f"{k} (by rank: {[other[k] for other in everyone]})" for k in odd))

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a collective: every rank calls it)."""
        import torch.distributed as dist

        box = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        return bool(box.item())

    def share(self, obj):
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj if self.lead else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @staticmethod
    def sum(partial: torch.Tensor) -> torch.Tensor:
        """Every rank's ``partial`` added up in place (NCCL)."""
        import torch.distributed as dist

        dist.all_reduce(partial)
        return partial
