"""Symmetric memory for a tensor-parallel megakernel: buffers every rank holds at its own
address, each rank able to load and store its peers' copies (NVLink peer access).

One workspace per step is allocated with :mod:`torch.distributed._symmetric_memory`
(a collective: every rank calls it, in the same order) and cut into the step's buffers;
a task finds a peer's copy of a buffer at the same offset from that peer's base, so one
int64 table of the bases (``peers``) is all the kernel needs besides its own pointers.
"""

from __future__ import annotations

import datetime
import os

import torch

#: Alignment of each buffer in the workspace (vector loads, and room for the flags' words).
ALIGN = 256

#: Seconds torch.distributed's setup and collectives wait for a missing rank.
SETUP_TIMEOUT_S = 120


def launch_env() -> tuple[int, int, int]:
    """``(world size, rank, local rank)`` as torchrun sets them (``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK``; ``(1, 0, 0)`` outside torchrun). Raises ValueError naming a variable that
    is not an int, or out of range (a rank outside ``[0, WORLD_SIZE)``)."""
    def var(name: str, default: int) -> int:
        text = os.environ.get(name)
        if text is None or text.strip() == "":
            return default
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"environment variable {name} must be an integer (torchrun sets it), "
                             f"got {text!r}") from None

    world = var("WORLD_SIZE", 1)
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {world}")
    rank, local = var("RANK", 0), var("LOCAL_RANK", 0)
    for name, value in (("RANK", rank), ("LOCAL_RANK", local)):
        if not 0 <= value < world:
            raise ValueError(f"environment variable {name} must be in [0, WORLD_SIZE={world}), got {value}")
    return world, rank, local


def check_gpu_ranks(what: str) -> None:
    """Refuse, before any work, ranks started by torchrun (``WORLD_SIZE`` > 1) that cannot each
    have a CUDA GPU of their own: the ranks of a megakernel share memory over NVLink, which the
    CPU's interpreter cannot (``what``: what is being started, for the message)."""
    world, _, local = launch_env()
    if world == 1:
        return
    if not torch.cuda.is_available():
        raise ValueError(f"{what} over {world} ranks (WORLD_SIZE={world}) runs one process per CUDA GPU, and "
                         f"this machine has none; run it without torchrun")
    if local >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local}, but this machine has {torch.cuda.device_count()} CUDA GPU(s): "
                         f"start at most that many processes per node")


def join_ranks(what: str = "this", ranks: int | None = None) -> tuple[int, int]:
    """(rank, world size) of torch.distributed, setting it up from torchrun's environment
    (NCCL on this process's GPU, LOCAL_RANK; gloo without GPUs) where the caller has not,
    with collectives bounded by :data:`SETUP_TIMEOUT_S`. Raises ValueError naming torchrun
    when the process was not started by it (``what``: what needs the ``ranks`` ranks), or
    naming a torchrun variable that is not an int."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(f"{what} runs one process per GPU: start it with torchrun --nproc-per-node "
                             f"{ranks or 'N'}")
        _, _, local = launch_env()
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S))
    return dist.get_rank(), dist.get_world_size()


class SymmetricWorkspace(dict):
    """Name -> tensor: the views of one symmetric workspace (:func:`symmetric_workspace`).
    It holds the allocation and the mapping of the peers' copies for as long as it lives;
    whoever launches kernels over its views keeps it (a tensor-parallel step does), and drops
    it once no launch that reads it is left on any rank."""

    def __init__(self, views: dict[str, torch.Tensor], keep: tuple):
        super().__init__(views)
        self._keep = keep


def symmetric_workspace(meta: dict[str, torch.Tensor], device: torch.device, *, peers: str,
                        group=None) -> SymmetricWorkspace:
    """Zeroed tensors of ``meta``'s shapes and dtypes (by name) in one symmetric workspace
    on ``device``, and under ``peers`` the int64 table of every rank's workspace base (rank
    order). A collective over ``group`` (default: the world): every rank must call it with
    the same ``meta``. Raises RuntimeError when torch.distributed is not initialised."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("symmetric_workspace: torch.distributed is not initialised (run under torchrun)")
    group = group or dist.group.WORLD
    offsets, total = {}, 0
    for name, t in meta.items():
        if name == peers:
            continue
        total = -(-total // ALIGN) * ALIGN
        offsets[name] = total
        total += t.numel() * t.element_size()
    total = max(-(-total // ALIGN) * ALIGN, ALIGN)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # (older releases ask for it first)
        symm_mem.enable_symm_mem_for_group(group.group_name)
    buf, failed = None, None
    try:
        buf = symm_mem.empty(total, dtype=torch.uint8, device=device)
    except Exception as e:  # (out of memory on one rank: every rank leaves here, none waits in the rendezvous)
        failed = e
    ok = torch.tensor([int(failed is None)], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if failed is not None:
        raise failed
    if not ok.item():
        raise RuntimeError("symmetric_workspace: allocating the workspace failed on another rank; its error names "
                           "the cause")
    handle = symm_mem.rendezvous(buf, group.group_name)
    buf.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group)  # every rank's zeros before any rank's step writes into its peers' memory
    out = {}
    for name, off in offsets.items():
        t = meta[name]
        out[name] = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    bases = [int(p) for p in handle.buffer_ptrs]
    rank = dist.get_rank(group)
    if bases[rank] != buf.data_ptr():
        raise RuntimeError(f"symmetric_workspace: rank {rank}'s own base in the peers' table is {bases[rank]:#x}, "
                           f"its buffer is at {buf.data_ptr():#x}")
    out[peers] = torch.tensor(bases, dtype=torch.int64, device=device)
    return SymmetricWorkspace(out, (buf, handle))
