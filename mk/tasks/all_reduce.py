"""Reductions over GPUs inside the megakernel: a tensor-parallel decode step's all-reduce,
and the next token chosen over every rank's share of the vocabulary.

Tensor parallelism splits a layer's O and down projections by their input columns, so
each rank (GPU) ends them holding a partial sum of the layer's output. Every rank writes
its partial into symmetric memory (one buffer on every rank, each copy at its own address,
all addresses known to all ranks: ``peers`` holds each rank's base of the workspace the
buffers are cut from), and a tile of the all-reduce, on every rank, adds the same tile of
every rank's partial to the residual, in rank order, so that every rank's residual stream
stays bit-identical.

Ranks meet per tile, by flags. After its local wait (this rank's partial tile is written)
a task sets the tile's flag in its own symmetric memory to the launch's number + 1 with a
system-scope release (what it observed written becomes visible to the peers first), then
polls every rank's flag until each shows that number: a round of polls is one
system-scope acquire load a rank, each in its own thread, so that all are in flight
together (one thread's acquires would each wait for the one before, a link round trip
apiece; a relaxed round then one system-scope fence cost more still, the fence waiting on
the whole memory system), and a block barrier passes what each thread acquired to the
others. Then the task loads the peers' tiles past L1. Every poll is bounded like the
megakernel's own waits: a dead or stuck peer ends the launch with an error naming the
peer, on every rank.

A buffer is never rewritten while a peer still reads it: each layer has its own partial
buffers and flags, and a rank ends a step only in the choice of its token over the ranks
(:func:`argmax_ranks_tile`, which the lowering requires of a tensor-parallel step), after
every peer has published its candidate, so has read all it reads of this rank's partials
that step (each row's candidate depends on all its layers). The flags count launches, so a
kernel reset after a failed launch (which restarts the count) zeroes them (they are the ops'
sync operands); every rank's launch failed with it.

A projection's tiles may run the all-reduce themselves (``linear`` / ``linear_reduce`` with
``all_reduce``; :func:`all_reduce_box`): each stores its partial, meets the ranks on its own
flag and sums its box, so the all-reduce adds no dependency phase.

The LM head's vocabulary is split too: each rank folds its rows' argmax into ``best``
(:func:`mk.tasks.argmax.argmax_tile_into`); :func:`argmax_publish_tile` moves it, with its
global index, into symmetric memory, and :func:`argmax_ranks_tile` takes the largest over
the ranks (the lowest index on ties, as torch.argmax) and appends the token, the same on
every rank.
"""

from __future__ import annotations

import torch
import triton.language as tl

try:  # inline PTX: compiled GPU code only
    from triton.language.extra.cuda import globaltimer as _globaltimer
except ImportError:  # pragma: no cover - older layouts
    _globaltimer = None

from ._cost import TaskCost
from ._device import check_same_device, check_tensor, jit, load_acquire, record_timeout
from ._spec import OpSpec, Region, as_2d, cdiv, check_pow2, check_sizes, check_tile, operand_view, register
from .append_token import append_one_ref, append_token_tile
from .argmax import argmax_unpack, argmax_unpack_ref

#: Polls a second under the interpreter (whose waits count polls, not time).
INTERPRETER_POLLS_PER_S = 10_000

#: Widest column block of one all-reduce tile.
MAX_BLOCK_N = 1024

#: Threads a block-wide vote covers (the most a block has): one element of the vote a thread.
VOTES = tl.constexpr(1024)

#: Most ranks a meeting polls (the GPUs of one machine): one thread a rank.
MAX_RANKS = tl.constexpr(8)


@jit
def _peer(ptr, peers_ptr, rank, q, ALIGN: tl.constexpr = 1):
    """``ptr`` (into this rank's symmetric workspace) at the same offset in rank q's (q a
    rank or a block of them); said ``ALIGN``-byte aligned, as ``ptr`` must be (the peers'
    table hides it from the compiler)."""
    base = tl.load(peers_ptr + rank)
    peer = (ptr.to(tl.int64) - base + tl.load(peers_ptr + q)).to(ptr.dtype)
    if ALIGN > 1:
        peer = tl.multiple_of(peer, ALIGN)  # (here, where the cast is: on a call's result it is lost)
    return peer


@jit
def _flags_round(flag_ptr, peers_ptr, rank, need, WORLD: tl.constexpr, GPU: tl.constexpr):
    """One round of every rank's flag at ``flag_ptr``'s offset, a rank a thread, each an
    acquire load, all in flight together (one round trip over the link however many
    peers): (the first rank whose flag is short of ``need``, WORLD when none is; the flags,
    ``MAX_RANKS`` of them, need beyond WORLD)."""
    tl.static_assert(WORLD <= MAX_RANKS)
    qs = tl.arange(0, MAX_RANKS)
    ranks = qs < WORLD
    flags = load_acquire(_peer(flag_ptr, peers_ptr, rank, tl.where(ranks, qs, rank)), GPU=GPU, SYS=True)
    flags = tl.where(ranks, flags, need)
    return tl.min(tl.where(flags < need, qs, WORLD), axis=0), flags


@jit
def meet_ranks(flag_ptr, peers_ptr, rank, ok, epoch, timeout, error_ptr, worker, task,
               WORLD: tl.constexpr, USE_TIMER: tl.constexpr):
    """Publish this rank's tile (flag = epoch + 1, system-scope release), then wait, bounded,
    until every peer's flag at the same offset shows it: each poll reads every rank's flag
    at once, a rank a thread, with system-scope acquire loads; a block barrier then passes
    what they acquired to every thread. Returns ok (0 on timeout, or when a worker of this
    launch has failed: the error buffer then names the worker, the task, event -2 - q for a
    peer q short in the last round, and the flag seen and expected)."""
    need = epoch + 1
    ok = ok + tl.zeros([], dtype=tl.int32)  # (a tensor: the waits below may clear it)
    if ok != 0:
        tl.debug_barrier()  # the block's own writes first (as a signal)
        tl.atomic_xchg(flag_ptr, need, sem="release", scope="sys")
        late, flags = _flags_round(flag_ptr, peers_ptr, rank, need, WORLD, USE_TIMER)
        polls = tl.zeros([], dtype=tl.int64)
        waited = tl.zeros([], dtype=tl.int64)
        failed = tl.zeros([], dtype=tl.int32)
        if USE_TIMER:
            start = _globaltimer()
        while (late < WORLD) & (waited < timeout) & (failed == 0):
            late, flags = _flags_round(flag_ptr, peers_ptr, rank, need, WORLD, USE_TIMER)
            if polls % 16 == 15:
                failed = tl.load(error_ptr, volatile=True)
            polls += 1
            if USE_TIMER:
                waited = _globaltimer() - start
            else:
                waited = polls
        # Each warp polls on its own, so at the timeout's edge some may leave the loop having
        # seen every flag and some not: one verdict for the block (the lowest peer any warp
        # found short, WORLD if none did), so that all threads take the same path
        # (record_timeout broadcasts through shared memory behind barriers) and none reads
        # the peers' data unless all will.
        first = tl.min(tl.full([VOTES], late, tl.int32), axis=0)
        if first < WORLD:
            ok = 0
            mine = tl.min(tl.where(tl.arange(0, MAX_RANKS) == late, flags, need), axis=0)
            seen = tl.min(tl.full([VOTES], tl.where(late == first, mine, need), tl.int32), axis=0)
            record_timeout(error_ptr, failed, worker, task, -2 - first, seen, need)
        tl.debug_barrier()  # every thread past every peer's flag before any reads their data
    return ok


@jit
def all_reduce_tile(part_ptr, res_ptr, out_ptr, peers_ptr, rank, pid_n, M, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr, RESIDUAL: tl.constexpr):
    """out[:, tile] = res[:, tile] + sum over ranks q (in order) of rank q's part[:, tile]
    (float32 ``[M, N]``, the same offset in each rank's symmetric workspace). Call after
    :func:`meet_ranks` on the tile's flag."""
    all_reduce_box(part_ptr, res_ptr, out_ptr, peers_ptr, rank, 0, M, pid_n * BLOCK_N, (pid_n + 1) * BLOCK_N, N,
                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WORLD=WORLD, RESIDUAL=RESIDUAL)


@jit
def all_reduce_box(part_ptr, res_ptr, out_ptr, peers_ptr, rank, r0, r1, c0, c1, N,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr, RESIDUAL: tl.constexpr):
    """:func:`all_reduce_tile` over rows [r0, r1) and columns [c0, c1) (at most BLOCK_M and
    BLOCK_N of them; row stride N): the sum a linear tile that meets the other ranks adds
    itself (``linear`` with ``all_reduce``). ``part_ptr``: a buffer's base, 16-byte aligned
    (as the megakernel's operands and the symmetric workspace's buffers are)."""
    rows = r0 + tl.arange(0, BLOCK_M)
    cols = c0 + tl.arange(0, BLOCK_N)
    mask = (rows < r1)[:, None] & ((cols < c1) & (cols < N))[None, :]
    offs = rows[:, None] * N + cols[None, :]
    if RESIDUAL:
        acc = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        # (Volatile: a peer's copy is read once a step, never from a cache of an earlier step's.
        # Its base is a buffer's in the peer's workspace, 16-byte aligned as this rank's is:
        # said so, the loads are 128-bit.)
        acc += tl.load(_peer(part_ptr, peers_ptr, rank, q, ALIGN=16) + offs, mask=mask, other=0.0, volatile=True)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def argmax_publish_tile(best_ptr, shared_ptr, b, rank, V_LOCAL: tl.constexpr):
    """Row b's best candidate of this rank's vocabulary share (``best``, zeroed for the next
    step) into ``shared[b]``, its index made global (rank * V_LOCAL + local index)."""
    packed = tl.atomic_xchg(best_ptr + b, tl.zeros([], tl.int64))
    # The low 31 bits hold 2**31 - 1 - index (mk.tasks.argmax.argmax_pack); 0 is "none".
    packed = tl.where(packed != 0, packed - (rank * V_LOCAL).to(tl.int64), packed)
    tl.store(shared_ptr + b, packed)


@jit
def argmax_ranks_tile(shared_ptr, peers_ptr, next_ids_ptr, pos_ptr, tokens_ptr, b, rank, max_seq,
                      WORLD: tl.constexpr):
    """The largest of every rank's ``shared[b]`` (the lowest global index on ties): row b's
    token, appended to its history (:func:`mk.tasks.append_token.append_token_tile`). Call
    after :func:`meet_ranks` on row b's flag."""
    best = tl.zeros([], tl.int64)
    for q in tl.static_range(WORLD):
        best = tl.maximum(best, tl.load(_peer(shared_ptr, peers_ptr, rank, q) + b, volatile=True))
    tok, _ = argmax_unpack(best)
    append_token_tile(next_ids_ptr, pos_ptr, tokens_ptr, b, max_seq, max_seq, tok=tok)


@jit
def _all_reduce_kernel(part_ptr, res_ptr, out_ptr, flags_ptr, peers_ptr, error_ptr, rank, M, N, epoch, timeout,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr, RESIDUAL: tl.constexpr,
                       USE_TIMER: tl.constexpr):
    pid_n = tl.program_id(0)
    ok = meet_ranks(flags_ptr + pid_n, peers_ptr, rank, 1, epoch, timeout, error_ptr, 0, pid_n, WORLD=WORLD,
                    USE_TIMER=USE_TIMER)
    if ok != 0:
        all_reduce_tile(part_ptr, res_ptr, out_ptr, peers_ptr, rank, pid_n, M, N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                        WORLD=WORLD, RESIDUAL=RESIDUAL)


def all_reduce(part: torch.Tensor, out: torch.Tensor, flags: torch.Tensor, peers: torch.Tensor, rank: int, *,
               residual: torch.Tensor | None = None, epoch: int = 0, timeout_s: float = 10.0) -> torch.Tensor:
    """``out = residual + sum over ranks of part`` (each float32 ``[M, N]``), as one launch on
    every rank at once (:func:`all_reduce_tile`). ``part`` and ``flags`` (int32, one per
    column block, ``epoch`` on every rank before this call) lie in a symmetric workspace
    whose base on each rank ``peers`` (int64 ``[world]``, on the device) lists; with one
    rank that is just this rank's own. Raises RuntimeError naming the peer that did not
    arrive within ``timeout_s``."""
    check_tensor("part", part, ndim=2, dtype=(torch.float32,))
    if part.data_ptr() % 16:
        raise ValueError(f"all_reduce: part must start 16-byte aligned (its peers' copies are read 16 bytes at a "
                         f"time), it starts at {part.data_ptr():#x}")
    M, N = part.shape
    check_tensor("out", out, shape=(M, N), dtype=(torch.float32,))
    if residual is not None:
        check_tensor("residual", residual, shape=(M, N), dtype=(torch.float32,))
    block_n = all_reduce_block_n(N)
    check_tensor("flags", flags, ndim=1, dtype=(torch.int32,))
    if flags.shape[0] < cdiv(N, block_n):
        raise ValueError(f"all_reduce: flags holds {flags.shape[0]} words, the {cdiv(N, block_n)} tiles need one each")
    error, timeout, gpu = _launch_setup("all_reduce", peers, rank, timeout_s, part=part, out=out, flags=flags)
    world = peers.shape[0]
    _all_reduce_kernel[(cdiv(N, block_n),)](part, part if residual is None else residual, out, flags, peers, error,
                                            rank, M, N, epoch, timeout, BLOCK_M=max(1, 1 << (M - 1).bit_length()),
                                            BLOCK_N=block_n, WORLD=world, RESIDUAL=residual is not None,
                                            USE_TIMER=gpu)
    _raise_missed(error, "all_reduce", rank, timeout_s)
    return out


@jit
def _meetings_kernel(flag_ptr, peers_ptr, error_ptr, rank, meetings, timeout, WORLD: tl.constexpr,
                     USE_TIMER: tl.constexpr):
    pid = tl.program_id(0)
    ok = tl.full([], 1, tl.int32)
    for i in range(meetings):
        ok = meet_ranks(flag_ptr + pid, peers_ptr, rank, ok, i, timeout, error_ptr, pid, i, WORLD=WORLD,
                        USE_TIMER=USE_TIMER)


def rank_meetings(flags: torch.Tensor, peers: torch.Tensor, rank: int, meetings: int, *, programs: int = 1,
                  timeout_s: float = 10.0) -> torch.Tensor:
    """Launch ``meetings`` meetings of the ranks one after another (:func:`meet_ranks`) in each
    of ``programs`` programs at once, program p on ``flags[p]`` (int32 words of a symmetric
    workspace that hold 0 on every rank before), on every rank at once: what one hop
    between GPUs costs, alone or among others, for calibration
    (:func:`mk.planner.calibrate.measure_link`). Returns the launch's error buffer without
    waiting for it (timing wraps the launch alone); :func:`check_meetings` reads it."""
    check_tensor("flags", flags, ndim=1, dtype=(torch.int32,))
    if not 1 <= programs <= flags.shape[0]:
        raise ValueError(f"rank_meetings: programs must be in [1, {flags.shape[0]}] (a flag each), got {programs}")
    error, timeout, gpu = _launch_setup("rank_meetings", peers, rank, timeout_s, flags=flags)
    _meetings_kernel[(programs,)](flags, peers, error, rank, meetings, timeout, WORLD=peers.shape[0],
                                  USE_TIMER=gpu)
    return error


def check_meetings(error: torch.Tensor, rank: int, timeout_s: float = 10.0) -> None:
    """Raise RuntimeError naming the peer this rank waited for in vain during
    :func:`rank_meetings` (launched with ``timeout_s``), and the meeting."""
    _raise_missed(error, "rank_meetings", rank, timeout_s, meeting=True)


def _launch_setup(op: str, peers, rank: int, timeout_s: float, **tensors) -> tuple[torch.Tensor, int, bool]:
    """A standalone launch that meets the ranks: checks peers and rank, and returns its error
    buffer, its bound on each wait (ns on a GPU, polls under the interpreter) and whether it
    runs on a GPU."""
    check_tensor("peers", peers, ndim=1, dtype=(torch.int64,))
    if not 0 <= rank < peers.shape[0]:
        raise ValueError(f"{op}: rank {rank} outside the {peers.shape[0]} ranks of peers")
    gpu = check_same_device(peers=peers, **tensors).type == "cuda"
    timeout = int(timeout_s * 1e9) if gpu else max(1, int(timeout_s * INTERPRETER_POLLS_PER_S))
    return torch.zeros(8, dtype=torch.int32, device=peers.device), timeout, gpu


def _raise_missed(error: torch.Tensor, op: str, rank: int, timeout_s: float, meeting: bool = False) -> None:
    """Raise RuntimeError naming the peer a launch of ``op`` waited for in vain (the words
    :func:`meet_ranks` records), if it did."""
    if int(error[0]):
        at = f" at meeting {int(error[2])}" if meeting else ""
        raise RuntimeError(f"{op}: rank {rank} waited {timeout_s} s{at} for rank {-2 - int(error[3])}: "
                           f"its flag showed {int(error[4])}, expected {int(error[5])}")


def all_reduce_ref(parts: list[torch.Tensor], residual: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`all_reduce` in torch, in its order: the residual, then every rank's part."""
    acc = residual.float().clone() if residual is not None else torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc += p.float()
    return acc


def all_reduce_block_n(n: int) -> int:
    """Columns of one all-reduce tile: a power of two, at most MAX_BLOCK_N."""
    return min(MAX_BLOCK_N, max(16, 1 << (n - 1).bit_length()))


def all_reduce_cost(rows: int, n: int, world: int) -> TaskCost:
    """Bytes and flops of one all-reduce on one rank: every rank's partial read (world - 1
    of them over the GPU link), the residual read and the sum written."""
    return TaskCost(rows * n * 4 * (world + 1), rows * n * 4, rows * n * world)


def all_reduce_link_share(world: int) -> float:
    """The part of :func:`all_reduce_cost`'s bytes read that crosses the GPU link (the peers'
    partials)."""
    return (world - 1) / (world + 1)


# ---------------------------------------------------------------------------------------
# Megakernel specs (mk.tasks._spec). ``peer_operands``: read on every rank (the VM hands a
# run each rank's tensor under "@role", rank order).
# ---------------------------------------------------------------------------------------

_MEET_CALL = ("ok = meet_ranks({flag}, peers, rank, ok, epoch, timeout, error_ptr, worker, w3, WORLD=WORLD, "
              "USE_TIMER=USE_TIMER)\n")
_MEET = "ok, last_ev, last_need, t_ready = task_wait(task_wait_args, task_wait_state, TASK_WAIT_FLAGS)\n" + _MEET_CALL

#: What a task that sums its box over the ranks itself (``linear`` / ``linear_reduce`` with
#: ``all_reduce``) binds besides its own operands, and the import its body needs.
RANKS_SUM_OPERANDS = ("res", "total", "flags", "peers")
RANKS_SUM_IMPORT = "from mk.tasks.all_reduce import all_reduce_box, meet_ranks"


def ranks_sum_tail(rows: int, cols: int, tasks_n: int, world: int) -> tuple[str, dict]:
    """The end of a task body (and its constexprs) that, its float32 partial of a box of
    ``rows`` x ``cols`` (task (pid_m, pid_n) of ``tasks_n`` a row block) stored into out in
    symmetric memory, meets the ranks on its word of flags and writes ``total = res + every
    rank's partial`` of its box (rank order: the same bits on every rank; :func:`all_reduce_box`)."""
    body = ("\n" + _MEET_CALL.format(flag="flags + pid_m * AR_TASKS_N + pid_n") +
            "if ok != 0:\n"
            "    all_reduce_box(out, res, total, peers, rank, pid_m * AR_ROWS, tl.minimum(M, pid_m * AR_ROWS + AR_ROWS), "
            "pid_n * AR_COLS, pid_n * AR_COLS + AR_COLS, N, BLOCK_M=AR_BLOCK_M, BLOCK_N=AR_BLOCK_N, WORLD=WORLD, "
            "RESIDUAL=1)")
    return body, dict(WORLD=world, AR_ROWS=rows, AR_COLS=cols, AR_TASKS_N=tasks_n,
                      AR_BLOCK_M=1 << (rows - 1).bit_length(), AR_BLOCK_N=1 << (cols - 1).bit_length())


def ranks_sum_ref(b: dict, box: tuple[int, int, int, int], word: int, parts: list[torch.Tensor]) -> None:
    """VM: :func:`ranks_sum_tail`'s sum of ``box`` (r0, r1, c0, c1) given every rank's float32
    partial of it (the task stores its own rank's into out itself), and its flag word."""
    r0, r1, c0, c1 = box
    total = as_2d(b["total"])
    total[r0:r1, c0:c1] = all_reduce_ref(parts, as_2d(b["res"])[r0:r1, c0:c1]).to(total.dtype)
    as_2d(b["flags"])[0, word] += 1


def ranks_sum_regions(bind: dict, box: tuple[int, int, int, int], word: int) -> list[Region]:
    """What :func:`ranks_sum_tail` writes besides the partial: the box of total, the flag."""
    r0, r1, c0, c1 = box
    return [Region(bind["total"], r0, r1, c0, c1), Region(bind["flags"], 0, 1, word, word + 1)]


def _check_rank(op: str, bufs: dict, a: dict, role: str) -> None:
    """VM: the task's rank argument names the rank it runs on (its own copy of ``role`` is
    that rank's entry of every rank's copies): a step lowered for another rank would read its
    peers at the wrong offsets on the GPU."""
    if not 0 <= a["rank"] < len(bufs["@" + role]) or bufs["@" + role][a["rank"]] is not bufs[role]:
        raise ValueError(f"{op}: a task with rank={a['rank']} runs on another rank of {len(bufs['@' + role])}")


@register("all_reduce")
def all_reduce_op(M: int, N: int, world: int, *, residual: bool = True, block_n: int | None = None,
                  num_warps: int = 4) -> OpSpec:
    """One column block of ``out = res + sum over ranks of part`` (float32 ``[M, N]``).

    Operands: part (symmetric), res (with ``residual``), out, flags int32 (symmetric, one
    word per column block), peers int64 ``[world]``. Args: pid_n, rank."""
    check_sizes("all_reduce", M=M, N=N, world=world)
    block_n = check_pow2("all_reduce", "block_n", block_n or all_reduce_block_n(N))
    tiles = cdiv(N, block_n)

    def cols(a):
        check_tile("all_reduce", "pid_n", a["pid_n"], tiles)
        return a["pid_n"] * block_n, min(N, (a["pid_n"] + 1) * block_n)

    def run(b, a):
        c0, c1 = cols(a)
        _check_rank("all_reduce", b, a, "part")
        parts = [operand_view("all_reduce", "part", p, M, N)[:, c0:c1] for p in b["@part"]]
        res = operand_view("all_reduce", "res", b["res"], M, N)[:, c0:c1] if residual else None
        out = operand_view("all_reduce", "out", b["out"], M, N)
        out[:, c0:c1] = all_reduce_ref(parts, res).to(out.dtype)
        as_2d(b["flags"])[0, a["pid_n"]] += 1

    def reads(a, bind):
        c0, c1 = cols(a)
        return [Region(bind[r], 0, M, c0, c1) for r in ("part",) + (("res",) if residual else ())]

    def writes(a, bind):
        c0, c1 = cols(a)
        return [Region(bind["out"], 0, M, c0, c1), Region(bind["flags"], 0, 1, a["pid_n"], a["pid_n"] + 1)]

    body = (_MEET.format(flag="flags + pid_n") +
            "if ok != 0:\n"
            "    all_reduce_tile(part, res, out, peers, rank, pid_n, M, N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, "
            "WORLD=WORLD, RESIDUAL=RESIDUAL)")
    operands = ("part",) + (("res",) if residual else ()) + ("out", "flags", "peers")
    return OpSpec(name="all_reduce", operands=operands, args=("pid_n", "rank"),
                  body=body if residual else body.replace("(part, res, out", "(part, part, out"),
                  imports=("from mk.tasks.all_reduce import all_reduce_tile, meet_ranks",),
                  constexprs={"M": M, "N": N, "BLOCK_M": max(1, 1 << (M - 1).bit_length()), "BLOCK_N": block_n,
                              "WORLD": world, "RESIDUAL": int(residual)},
                  num_warps=num_warps, waits_in_body=True, run=run, reads=reads, writes=writes,
                  peer_operands=("part",), sync_operands=("flags",),
                  tiles=lambda _: [{"pid_n": n} for n in range(tiles)])


@register("argmax_publish")
def argmax_publish_op(batch: int, v_local: int) -> OpSpec:
    """Row b's best candidate of this rank's vocabulary share (operand best int64 ``[batch]``,
    folded by the LM head) into operand shared int64 ``[batch]`` (symmetric), its index
    global; best[b] back to 0. Args: b, rank."""
    check_sizes("argmax_publish", batch=batch, v_local=v_local)

    def row(a):
        check_tile("argmax_publish", "b", a["b"], batch)
        return a["b"]

    def run(bufs, a):
        b = row(a)
        best = operand_view("argmax_publish", "best", bufs["best"], 1, batch)[0]
        shared = operand_view("argmax_publish", "shared", bufs["shared"], 1, batch)[0]
        packed = int(best[b])
        shared[b] = packed - a["rank"] * v_local if packed else 0
        best[b] = 0

    def regions(a, bind):
        b = row(a)
        return [Region(bind["best"], 0, 1, b, b + 1)]

    def writes(a, bind):
        b = row(a)
        return [Region(bind["best"], 0, 1, b, b + 1), Region(bind["shared"], 0, 1, b, b + 1)]

    return OpSpec(name="argmax_publish", operands=("best", "shared"), args=("b", "rank"),
                  body="argmax_publish_tile(best, shared, b, rank, V_LOCAL=V_LOCAL)",
                  imports=("from mk.tasks.all_reduce import argmax_publish_tile",),
                  constexprs={"BATCH": batch, "V_LOCAL": v_local}, num_warps=1, run=run, reads=regions,
                  writes=writes, sync_operands=("best",), tiles=lambda _: [{"b": b} for b in range(batch)])


@register("argmax_ranks")
def argmax_ranks_op(batch: int, max_seq: int, world: int) -> OpSpec:
    """Row b's token: the best of every rank's shared[b] (operand shared int64 ``[batch]``,
    symmetric), written to next_ids[b] and appended at tokens[b, pos[b] + 1]; pos[b]
    advanced (:mod:`mk.tasks.append_token`). Operands: shared, flags int32 ``[batch]``
    (symmetric), peers int64 ``[world]``, next_ids, pos, tokens. Args: b, rank."""
    check_sizes("argmax_ranks", batch=batch, max_seq=max_seq, world=world)

    def row(a):
        check_tile("argmax_ranks", "b", a["b"], batch)
        return a["b"]

    def run(bufs, a):
        b = row(a)
        _check_rank("argmax_ranks", bufs, a, "shared")
        best = max(int(operand_view("argmax_ranks", "shared", s, 1, batch)[0, b]) for s in bufs["@shared"])
        next_ids = operand_view("argmax_ranks", "next_ids", bufs["next_ids"], 1, batch)[0]
        next_ids[b] = argmax_unpack_ref(best)
        as_2d(bufs["flags"])[0, b] += 1
        append_one_ref(next_ids, operand_view("argmax_ranks", "pos", bufs["pos"], 1, batch)[0],
                       operand_view("argmax_ranks", "tokens", bufs["tokens"], batch, max_seq), b)

    def reads(a, bind):
        b = row(a)
        return [Region(bind["shared"], 0, 1, b, b + 1), Region(bind["pos"], 0, 1, b, b + 1)]

    def writes(a, bind):
        b = row(a)
        return [Region(bind["flags"], 0, 1, b, b + 1), Region(bind["next_ids"], 0, 1, b, b + 1),
                Region(bind["pos"], 0, 1, b, b + 1), Region(bind["tokens"], b, b + 1, 0, max_seq)]

    body = (_MEET.format(flag="flags + b") +
            "if ok != 0:\n"
            "    argmax_ranks_tile(shared, peers, next_ids, pos, tokens, b, rank, MAX_SEQ, WORLD=WORLD)")
    return OpSpec(name="argmax_ranks", operands=("shared", "flags", "peers", "next_ids", "pos", "tokens"),
                  args=("b", "rank"), body=body,
                  imports=("from mk.tasks.all_reduce import argmax_ranks_tile, meet_ranks",),
                  constexprs={"BATCH": batch, "MAX_SEQ": max_seq, "WORLD": world}, num_warps=1,
                  waits_in_body=True, run=run, reads=reads, writes=writes, peer_operands=("shared",),
                  sync_operands=("flags",),
                  tiles=lambda _: [{"b": b} for b in range(batch)])
