"""What the planner knows about a GPU: :class:`DeviceSpec`, its presets, and calibration.

A plan depends on the GPU through a handful of numbers: how many SMs there are (how many
persistent workers), how much shared memory a block may use (which tiles fit), how many
blocks can be resident at once (co-residency of the persistent grid), and the rates and
overheads the cost model divides by. ``DeviceSpec`` holds exactly those.

Three ways to get one:

* ``DeviceSpec.preset("h200")`` — spec-sheet numbers for a known part, so plans can be
  made and tested on a machine without that GPU (or without any GPU);
* ``DeviceSpec.from_gpu()`` — the live CUDA device, with rates from the closest preset and
  cost-model constants from this device's calibration file when one exists;
* ``DeviceSpec.from_json(text)`` — one written earlier by :meth:`DeviceSpec.to_json`.

Calibration (``python -m mk calibrate``) measures the cost-model constants on the GPU and
stores them with :func:`save_calibration` under :func:`calibration_path`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mk.tasks import cache_dir

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Cost-model constants that calibration measures; everything else is a hardware fact.
CALIBRATED_FIELDS = ("dram_bandwidth", "bf16_flops", "tma_worker_bandwidth", "worker_bandwidth",
                     "task_overhead_s", "wait_overhead_s", "launch_overhead_s")
#: The GPU link's constants, which calibration measures under torchrun (several ranks).
LINK_FIELDS = ("link_bandwidth", "link_latency_s", "link_crowd_s")
#: What the stored link constants timed: hops of the all-reduce's pushed words. A file's
#: link constants stamped otherwise (or not at all: measured from meetings of flags and
#: peer reads, the all-reduce before) price another protocol, and are not loaded.
LINK_METHOD = "pushed-words"

# Shared memory the driver reserves per block on sm_80 and later
# (cudaDevAttrReservedSharedMemoryPerBlock). It is not in the opt-in per-block limit nor
# in Triton's reported `shared`, but it is taken from the SM's pool for every block.
_RESERVED_SMEM_PER_BLOCK = 1 * KiB

# Registers are allocated per warp in units of this many (sm_70 .. sm_90).
_REG_ALLOC_UNIT = 256
# Shared memory is allocated per block in units of this many bytes (sm_80 .. sm_90).
_SMEM_ALLOC_UNIT = 128
# PTX caps a thread at 255 registers; a kernel's n_regs above that is a caller's bug.
_MAX_REGS_PER_THREAD = 255

# Resident blocks per SM by compute capability (CUDA programming guide, table of
# technical specifications); torch does not report it.
_MAX_BLOCKS_PER_SM = {(7, 0): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16,
                      (8, 9): 24, (9, 0): 32}

_INT_FIELDS = ("sm_count", "smem_per_block", "smem_per_sm", "regs_per_sm", "max_threads_per_sm",
               "max_blocks_per_sm", "l2_bytes", "max_threads_per_block", "reserved_smem_per_block",
               "l1_reserve_per_sm")
_RATE_FIELDS = ("dram_bandwidth", "bf16_flops", "link_bandwidth")
_OVERHEAD_FIELDS = ("task_overhead_s", "wait_overhead_s", "launch_overhead_s", "load_latency_s", "chunk_overhead_s",
                    "chunk_exposed_s", "link_latency_s", "link_crowd_s")
# Per-worker rates: 0 means "not measured" (see DeviceSpec.worker_rate).
_WORKER_RATE_FIELDS = ("tma_worker_bandwidth", "worker_bandwidth", "dot_worker_bandwidth", "xmajor_dot_bandwidth")
_FRACTION_FIELDS = ("xmajor_kernel_slowdown",)


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU as the planner sees it. Sizes in bytes, rates per second, times in seconds.

    Hardware facts:
        name: the device name (as ``torch.cuda.get_device_name`` reports it for a live GPU).
        sm_count: streaming multiprocessors, i.e. the most persistent workers at one block/SM.
        smem_per_block: the opt-in maximum dynamic shared memory one block may use
            (what a tile configuration must fit under; lowered by :meth:`with_smem_budget`).
        smem_per_sm: shared memory per SM (the pool resident blocks share).
        regs_per_sm: 32-bit registers per SM.
        max_threads_per_sm, max_blocks_per_sm: residency limits per SM.
        l2_bytes: L2 cache size.
        compute_capability: ``(major, minor)``.
        max_threads_per_block: largest block (1024 on every part here).
        reserved_smem_per_block: shared memory the driver reserves for each resident block.
        l1_reserve_per_sm: of the SM's shared memory, what the search leaves to the L1 cache
            (they are one array: a kernel's shared memory sets the carveout). A plan whose
            largest tile takes it runs every other task with less L1: on an H200 at batch
            8, LM-head tiles of 104 KiB (two workers an SM: 47 KiB of L1 left) made the
            1B step 1.247 ms against 1.231 with 128-row tiles peaking at 56 KiB, though
            the LM head itself ran 10 us faster (its RoPE reduces ran 4.1 against 3.0 us a
            task); 8B 4.926 against 4.889 ms. 0: no reserve.

    Rates (presets use spec sheets; calibration replaces them with measurements):
        dram_bandwidth: bytes/s of a device-to-device copy, counting bytes read plus
            written — the figure a weight-streaming kernel is compared against.
        bf16_flops: dense bf16 tensor-core flop/s.
        tma_worker_bandwidth, worker_bandwidth: bytes/s one persistent worker streams a
            GEMV tile's weights at when DRAM is not the limit (few workers busy): through
            the TMA ring, and through registers (every other task). 0 until measured:
            :meth:`worker_rate` then falls back to an even share of ``dram_bandwidth``.
        dot_worker_bandwidth: bytes/s of weights one worker gets through in a weight-major
            decode tl.dot tile (:func:`mk.tasks.linear.weight_major`: wgmma reads the TMA
            ring's chunk in place) however few workers are busy. 0: not a limit.
        xmajor_dot_bandwidth: the same for x-major decode tiles (batch rows as the MMA's M:
            boxes of fewer than 128 weight rows), where mma.sync takes each weight chunk from
            shared memory into registers and x's hi and lo halves are two MMAs.
        xmajor_kernel_slowdown: what an x-major decode tile costs the whole step, as a
            fraction of it: its registers make the one megakernel spill, which slows every
            task, not only its own (:func:`mk.planner.search.search` adds it to plans that
            hold one).

    Cost-model constants (placeholders until calibrated; ``calibrated`` says which):
        task_overhead_s: fixed cost of one task in a persistent worker (fetch descriptor,
            bind pointers, epilogue bookkeeping).
        wait_overhead_s: one dependency hop, producer's release to consumer's acquire.
        launch_overhead_s: launch, ramp-up and tail of the one kernel per step.
        load_latency_s: how long a weight chunk takes to arrive while every worker streams:
            a TMA worker with B bytes in flight streams at most B / load_latency_s.
        chunk_overhead_s: the least time a TMA worker spends on one chunk of its ring (wait,
            operand loads, FMAs, the slot's release): chunks of C bytes stream at most at
            C / chunk_overhead_s.
        chunk_exposed_s: the part of a GEMV chunk's work the stream does not hide (its x
            chunk, the ring's bookkeeping): a task of c chunks takes c x chunk_exposed_s more.
        calibrated: True once the constants come from micro-benchmarks on this device.
    """

    name: str
    sm_count: int
    smem_per_block: int
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    l2_bytes: int
    dram_bandwidth: float
    bf16_flops: float
    compute_capability: tuple[int, int]
    max_threads_per_block: int = 1024
    reserved_smem_per_block: int = _RESERVED_SMEM_PER_BLOCK
    l1_reserve_per_sm: int = 0
    tma_worker_bandwidth: float = 0.0
    worker_bandwidth: float = 0.0
    dot_worker_bandwidth: float = 0.0
    xmajor_dot_bandwidth: float = 0.0
    xmajor_kernel_slowdown: float = 0.0
    # Measured in the 1B step on an H200: halving the GEMV
    # tile (twice the tasks) cost ~2.6 µs of worker time per extra task at one worker an
    # SM: the TMA ring fills again at every task. 1.5 µs with two workers an SM, which
    # hide part of it.
    task_overhead_s: float = 1.5e-6
    # One dependency phase (producers' signals seen, the consumers ramping up): 2 µs
    # between the ops of the 1B step's trace; the bare signal/wait hop is ~0.5-0.85 µs.
    wait_overhead_s: float = 2.0e-6
    # Placeholder: a CUDA-graph-replayed launch cost ~2 µs of ramp-up and tail on an H200.
    launch_overhead_s: float = 2.0e-6
    # A 128256 x 2048 GEMV over 264 workers on an H200: 8 x 256
    # boxes in a 4-deep ring (12 KiB in flight a worker) streamed at 0.81 of the copy
    # bandwidth, as Little's law gives with 0.9 µs; 24 KiB or more in flight reached 0.96-0.98.
    load_latency_s: float = 0.9e-6
    # The same GEMV with 8 x 256 boxes (4 KiB a chunk) in an 8-deep ring, 61 tiles a task:
    # 0.26 µs a chunk (0.29 with an RMSNorm prologue), whatever was in flight.
    chunk_overhead_s: float = 0.28e-6
    # The 1B LM head in the step (H200): runs of 32-row tiles (128 chunks a
    # task) took 115 µs a task, of 16-row tiles (248 chunks) 121 µs, the same bytes.
    chunk_exposed_s: float = 0.05e-6
    # Tensor parallelism: what one GPU sends to its peers a second over the GPU link (the
    # all-reduce's pushed words), and one hop of a sum over the ranks (a box of words
    # pushed, every peer's seen in this GPU's memory). Measured over NVLink 4 between H200s,
    # hops repeated inside one launch, boxes of 1 to 8 rows of 4096 and 8192 columns: a hop
    # takes 1.5-2.3 µs over two, 2.2-3.4 over four; eight rows of 8192 columns 2.1 µs over
    # two, 6.1 over four (about 400 GB/s of words). GPUs joined by PCIe alone are slower:
    # calibrate them (``torchrun --nproc-per-node N -m mk calibrate``).
    link_bandwidth: float = 400e9
    link_latency_s: float = 2.0e-6
    # What a hop costs more for each other hop in flight on the GPU and each peer it pushes
    # to. Pushed words cross the link once and are polled in local memory, so many hops at
    # once take no longer than one (one row of 8192 columns over four H200s: 3.4 µs in 8
    # tiles at once, 2.5 in 128); pulling, each meeting polled its peers' flags across the
    # link, and 256 meetings at once each took 7.8 µs against 3.6 alone. Calibration
    # measures it.
    link_crowd_s: float = 0.0
    calibrated: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"DeviceSpec.name must be a non-empty string, got {self.name!r}")
        for f in _INT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"DeviceSpec.{f} must be an int, got {type(v).__name__} {v!r}")
            if v < 0 or (v == 0 and f not in ("reserved_smem_per_block", "l1_reserve_per_sm")):
                raise ValueError(f"DeviceSpec.{f} must be positive, got {v}")
        for f in _RATE_FIELDS + _OVERHEAD_FIELDS + _WORKER_RATE_FIELDS + _FRACTION_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"DeviceSpec.{f} must be a number, got {type(v).__name__} {v!r}")
            if not math.isfinite(v) or v < 0 or (v == 0 and f in _RATE_FIELDS):
                raise ValueError(f"DeviceSpec.{f} must be finite and "
                                 f"{'positive' if f in _RATE_FIELDS else 'non-negative'}, got {v}")
        cc = self.compute_capability
        if (not isinstance(cc, tuple) or len(cc) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in cc)):
            raise TypeError(f"DeviceSpec.compute_capability must be a tuple of two ints, got {cc!r}")
        if not isinstance(self.calibrated, bool):
            raise TypeError(f"DeviceSpec.calibrated must be a bool, got {self.calibrated!r}")
        if self.l1_reserve_per_sm >= self.smem_per_sm:
            raise ValueError(f"DeviceSpec {self.name!r}: l1_reserve_per_sm {self.l1_reserve_per_sm} "
                             f"leaves no shared memory of the SM's {self.smem_per_sm}")
        if self.smem_per_block > self.smem_per_sm:
            raise ValueError(f"DeviceSpec {self.name!r}: smem_per_block {self.smem_per_block} "
                             f"exceeds smem_per_sm {self.smem_per_sm}")

    def worker_rate(self, tma: bool) -> float:
        """Bytes/s one worker streams at when DRAM is not the limit (TMA ring or registers):
        the calibrated figure, else an even share of ``dram_bandwidth`` over one worker an SM."""
        measured = self.tma_worker_bandwidth if tma else self.worker_bandwidth
        return measured or self.dram_bandwidth / self.sm_count

    def ring_seconds_per_byte(self, in_flight_bytes: int, chunk_bytes: int) -> float:
        """The least time a TMA ring spends per weight byte: its bytes in flight arrive once
        per :attr:`load_latency_s` (Little's law), and it takes one chunk per
        :attr:`chunk_overhead_s`."""
        return max(self.load_latency_s / in_flight_bytes, self.chunk_overhead_s / chunk_bytes)

    def hop_seconds(self, world: int, at_once: int) -> float:
        """One hop of a sum over ``world`` ranks while ``at_once`` hops (this one among them)
        run on each GPU: :attr:`link_latency_s`, plus :attr:`link_crowd_s` for each other
        hop and each peer."""
        return self.link_latency_s + self.link_crowd_s * (world - 1) * max(at_once - 1, 0)

    # ---- serialisation -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (compute_capability as a list); inverse of :meth:`from_dict`."""
        d = dataclasses.asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text; ``DeviceSpec.from_json(spec.to_json()) == spec``."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        """Build from :meth:`to_dict`'s output; unknown or missing keys are errors."""
        if not isinstance(d, Mapping):
            raise TypeError(f"DeviceSpec.from_dict needs a mapping, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"DeviceSpec.from_dict: unknown keys {unknown}")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(d))
        if missing:
            raise ValueError(f"DeviceSpec.from_dict: missing keys {missing}")
        kw = dict(d)
        cc = kw["compute_capability"]
        if isinstance(cc, (list, tuple)):
            kw["compute_capability"] = tuple(cc)
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> DeviceSpec:
        """Parse :meth:`to_json`'s output."""
        return cls.from_dict(json.loads(text))

    # ---- construction ----------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> DeviceSpec:
        """The named preset: ``"h100"``, ``"H200"``, ``"a100"``, ``"l40s"``, ``"l20"``, ``"rtx4090"``…

        Case, spaces, dashes and underscores are ignored; see :data:`PRESETS` and
        :data:`ALIASES` for the names.
        """
        if not isinstance(name, str):
            raise TypeError(f"preset name must be a string, got {type(name).__name__}")
        key = ALIASES.get(_norm(name))
        if key is None:
            raise ValueError(f"unknown device preset {name!r}; known: {', '.join(sorted(PRESETS))} "
                             f"(aliases: {', '.join(sorted(set(ALIASES) - set(PRESETS)))})")
        return PRESETS[key]

    @classmethod
    def interpreter(cls) -> DeviceSpec:
        """The Triton interpreter on a CPU, as the planner sees it: one worker (programs run
        one after another) and ~20 ms a task (measured: interpreting a tile costs far more
        than its bytes), so plans there use few, large tiles. Shared memory and tile rules
        are an H100's: the same tiles must stay valid GPU code."""
        return replace(cls.preset("h100"), name="Triton interpreter (CPU)", sm_count=1, task_overhead_s=0.02)

    @classmethod
    def from_gpu(cls, device: Any = None, *, load_calibration: bool = True) -> DeviceSpec:
        """The live CUDA device (default: the current one).

        Hardware facts come from ``torch.cuda.get_device_properties``; rates and
        constants from the preset closest by name, then from this device's calibration
        file (:func:`calibration_path`) when one exists and ``load_calibration`` is set.
        """
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("DeviceSpec.from_gpu needs a CUDA device and torch sees none "
                               "(torch.cuda.is_available() is False); to plan without a GPU "
                               "use DeviceSpec.preset(name), e.g. DeviceSpec.preset('h200')")
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None
                                                 else device)
        cc = (int(props.major), int(props.minor))
        base = closest_preset(props.name, cc, int(props.multi_processor_count))

        def prop(*names: str, default: int) -> int:
            # Attribute names differ across torch versions; the first one present wins.
            for n in names:
                v = getattr(props, n, None)
                if v:
                    return int(v)
            return default

        smem_per_sm = prop("shared_memory_per_multiprocessor", default=base.smem_per_sm)
        # What the device reports replaces the preset's hardware facts; every rate and
        # cost-model constant stays the preset's (a preset's own measured constants included).
        spec = replace(
            base,
            name=props.name,
            sm_count=int(props.multi_processor_count),
            # Without the opt-in figure, the default 48 KiB per block is a safe lower bound.
            smem_per_block=min(prop("shared_memory_per_block_optin", "shared_memory_per_block",
                                    default=base.smem_per_block), smem_per_sm),
            smem_per_sm=smem_per_sm,
            regs_per_sm=prop("regs_per_multiprocessor", "registers_per_multiprocessor",
                             default=base.regs_per_sm),
            max_threads_per_sm=prop("max_threads_per_multi_processor",
                                    "max_threads_per_multiprocessor",
                                    default=base.max_threads_per_sm),
            max_blocks_per_sm=_MAX_BLOCKS_PER_SM.get(cc, base.max_blocks_per_sm),
            l2_bytes=prop("L2_cache_size", "l2_cache_size", default=base.l2_bytes),
            compute_capability=cc,
        )
        if load_calibration:
            constants = load_calibration_file(spec.name)
            if constants is not None:
                spec = spec.with_calibration(constants)
        return spec

    # ---- derived copies ------------------------------------------------------------

    def with_calibration(self, constants: Mapping[str, Any]) -> DeviceSpec:
        """A copy with measured cost-model constants (any subset of :data:`CALIBRATED_FIELDS`
        and :data:`LINK_FIELDS`) and ``calibrated=True``. A ``"name"`` key, if present, must name this device."""
        if not isinstance(constants, Mapping):
            raise TypeError(f"with_calibration needs a mapping, got {type(constants).__name__}")
        kw = dict(constants)
        other = kw.pop("name", self.name)
        if _slug(other) != _slug(self.name):
            raise ValueError(f"calibration is for device {other!r}, not {self.name!r}")
        unknown = sorted(set(kw) - set(CALIBRATED_FIELDS) - set(LINK_FIELDS))
        if unknown:
            raise ValueError(f"with_calibration: unknown constants {unknown}; "
                             f"calibration sets {list(CALIBRATED_FIELDS + LINK_FIELDS)}")
        return dataclasses.replace(self, **kw, calibrated=True)

    def with_smem_budget(self, budget: int | str) -> DeviceSpec:
        """A copy whose per-block shared memory is at most ``budget`` (bytes or e.g. "99KiB").

        Planning an H100 with ``"99KiB"`` gives plans that also fit an Ada part. A budget
        above what a block of this device may use (:attr:`smem_per_block`) is refused,
        naming both: plans for it would not run here.
        """
        b = parse_bytes(budget)
        if b <= 0:
            raise ValueError(f"shared-memory budget must be positive, got {budget!r}")
        if b > self.smem_per_block:
            raise ValueError(f"shared-memory budget {budget!r} ({b} bytes) exceeds the {self.smem_per_block} bytes "
                             f"({self.smem_per_block / KiB:g} KiB) a block of {self.name} may use")
        return dataclasses.replace(self, smem_per_block=b)

    # ---- residency -------------------------------------------------------------------

    def max_resident_blocks(self, threads_per_block: int, smem_bytes: int = 0,
                            regs_per_thread: int = 0) -> int:
        """Blocks of one kernel that fit on an SM at once (0 if one block does not fit).

        The minimum over the limits from threads, shared memory (``smem_bytes`` per block
        plus the driver's reservation, in 128-byte units), registers (``regs_per_thread``,
        allocated per warp in units of 256) and the per-SM block limit. A persistent grid
        must not exceed ``sm_count * max_resident_blocks(...)`` or its spin-waits deadlock.
        ``regs_per_thread=0`` leaves registers out (unknown before compiling).
        """
        for arg, v in (("threads_per_block", threads_per_block), ("smem_bytes", smem_bytes),
                       ("regs_per_thread", regs_per_thread)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"max_resident_blocks: {arg} must be an int, got {v!r}")
            if v < 0:
                raise ValueError(f"max_resident_blocks: {arg} must be non-negative, got {v}")
        if threads_per_block == 0:
            raise ValueError("max_resident_blocks: threads_per_block must be positive")
        if regs_per_thread > _MAX_REGS_PER_THREAD:
            raise ValueError(f"max_resident_blocks: regs_per_thread {regs_per_thread} exceeds "
                             f"the hardware's {_MAX_REGS_PER_THREAD}")
        if threads_per_block > self.max_threads_per_block or smem_bytes > self.smem_per_block:
            return 0
        warps = -(-threads_per_block // 32)
        by_threads = self.max_threads_per_sm // (warps * 32)
        smem = -(-(smem_bytes + self.reserved_smem_per_block) // _SMEM_ALLOC_UNIT) * _SMEM_ALLOC_UNIT
        by_smem = self.smem_per_sm // smem if smem else self.max_blocks_per_sm
        if regs_per_thread:
            regs_per_warp = -(-regs_per_thread * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
            by_regs = (self.regs_per_sm // regs_per_warp) // warps
        else:
            by_regs = self.max_blocks_per_sm
        return max(0, min(by_threads, by_smem, by_regs, self.max_blocks_per_sm))

    def max_grid(self, threads_per_block: int, smem_bytes: int = 0, regs_per_thread: int = 0) -> int:
        """The largest persistent grid that is fully co-resident: SMs × resident blocks per SM."""
        return self.sm_count * self.max_resident_blocks(threads_per_block, smem_bytes,
                                                        regs_per_thread)

    @property
    def slug(self) -> str:
        """File-name form of the device name, e.g. ``"nvidia-h200"``."""
        return _slug(self.name)


# ---- presets ----------------------------------------------------------------------------

def _hopper(name: str, sm_count: int, l2_bytes: int, dram_bandwidth: float) -> DeviceSpec:
    # Decode tl.dot tiles in the H200's batch-8 steps: x-major
    # 64-row boxes took 10.3-14.4 GB/s a worker (RMSNorm prologue the slower), weight-major
    # 128-row boxes 15.7 GB/s with only 224 of 264 workers busy (the 8B gate_up: an even
    # share of DRAM would be 19 GB/s). The same SM on an H100.
    return DeviceSpec(name=name, sm_count=sm_count, smem_per_block=227 * KiB,
                      smem_per_sm=228 * KiB, regs_per_sm=65536, max_threads_per_sm=2048,
                      max_blocks_per_sm=32, l2_bytes=l2_bytes, dram_bandwidth=dram_bandwidth,
                      bf16_flops=989e12, compute_capability=(9, 0), dot_worker_bandwidth=16e9,
                      # 1B batch 8, all weight-major against o_proj and down x-major (255
                      # registers, 8 spills against 26): the
                      # step 1.5% faster on an H200, 1.7-2.4% on an H100.
                      xmajor_dot_bandwidth=11e9, xmajor_kernel_slowdown=0.02, l1_reserve_per_sm=64 * KiB)


def _ada(name: str, sm_count: int, l2_bytes: int, dram_bandwidth: float,
         bf16_flops: float) -> DeviceSpec:
    return DeviceSpec(name=name, sm_count=sm_count, smem_per_block=99 * KiB,
                      smem_per_sm=100 * KiB, regs_per_sm=65536, max_threads_per_sm=1536,
                      max_blocks_per_sm=24, l2_bytes=l2_bytes, dram_bandwidth=dram_bandwidth,
                      bf16_flops=bf16_flops, compute_capability=(8, 9))


# Where no copy bandwidth has been measured, dram_bandwidth is this fraction of the
# spec-sheet peak: what a copy kernel typically reaches on HBM and GDDR parts.
_COPY_FRACTION = 0.88

#: Spec-sheet presets by canonical key. bf16_flops are dense tensor-core rates from the
#: vendor spec sheets / architecture whitepapers (sparsity excluded); dram_bandwidth is a
#: measured copy figure (read + written) where this project has one, else 0.88 × peak.
PRESETS: dict[str, DeviceSpec] = {
    # Peak HBM3 3.35 TB/s; the copy kernel measured 3.01-3.03e12 in this project's H100
    # benchmark runs (copy_Bps in bench/results).
    # A weight chunk arrives later than on the H200 while every worker streams: the 1B down
    # projection's GEMV tasks (8 x 256 boxes, 12 KiB in flight a worker) streamed at 10.6 GB/s
    # a worker where 32 KiB in flight gave 12.5: Little's
    # law says 1.15 us.
    # Its x-major decode tiles (batch 8) streamed slower than the H200's: 8.4-9.7 GB/s a worker
    # in the 1B batch-8 trace (gate_up with its RMSNorm 8.4, the down partials 9.7),
    # where 11 GB/s priced them ahead of the 128-row weight-major gate_up that measured 2-3%
    # faster a step.
    "h100-sxm": replace(_hopper("NVIDIA H100 80GB HBM3", 132, 50 * MiB, 3.02e12), load_latency_s=1.15e-6,
                        xmajor_dot_bandwidth=9.0e9),
    # Peak HBM3e 4.8 TB/s; 4.29e12 is the copy kernel measured by the benchmarks
    # (copy_Bps in bench/results). L2: torch reports 60 MiB on this project's H200 (spec
    # sheets often say 50 MB, the H100's figure).
    # TMA worker rate from `python -m mk calibrate` on this project's H200; the
    # register-path rate was not measurable there (its chains are DRAM-limited), so it is
    # left unmeasured.
    # Weight-major decode tiles: 20.5 GB/s a worker (1B batch-8 down partials, 128 x 64
    # boxes, 256 KiB a task in 12.8 us, its ramp included).
    "h200": replace(_hopper("NVIDIA H200", 132, 60 * MiB, 4.29e12), tma_worker_bandwidth=31.9e9,
                    dot_worker_bandwidth=20e9),
    # Peak HBM2e 2.04 TB/s (80 GB SXM); not measured here.
    "a100-sxm": DeviceSpec(name="NVIDIA A100-SXM4-80GB", sm_count=108, smem_per_block=163 * KiB,
                           smem_per_sm=164 * KiB, regs_per_sm=65536, max_threads_per_sm=2048,
                           max_blocks_per_sm=32, l2_bytes=40 * MiB,
                           dram_bandwidth=_COPY_FRACTION * 2.04e12, bf16_flops=312e12,
                           compute_capability=(8, 0)),
    # Ada parts: 99 KiB of shared memory per block. Peak GDDR6 864 GB/s (L40S, L20),
    # GDDR6X 1008 GB/s (RTX 4090); none measured here.
    "l40s": _ada("NVIDIA L40S", 142, 96 * MiB, _COPY_FRACTION * 864e9, 362e12),
    "l20": _ada("NVIDIA L20", 92, 96 * MiB, _COPY_FRACTION * 864e9, 119.5e12),
    "rtx4090": _ada("NVIDIA GeForce RTX 4090", 128, 72 * MiB, _COPY_FRACTION * 1008e9, 165e12),
}


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower())


#: Normalised alias (lower case, no spaces/dashes/underscores) -> key in :data:`PRESETS`.
ALIASES: dict[str, str] = {
    **{_norm(k): k for k in PRESETS},
    **{_norm(spec.name): k for k, spec in PRESETS.items()},
    "h100": "h100-sxm", "h100sxm5": "h100-sxm", "nvidiah100": "h100-sxm",
    "h200sxm": "h200",
    "a100": "a100-sxm", "a10080gb": "a100-sxm", "a100sxm480gb": "a100-sxm",
    "nvidial40s": "l40s", "nvidial20": "l20",
    "4090": "rtx4090", "geforcertx4090": "rtx4090",
}


def closest_preset(name: str, compute_capability: tuple[int, int] | None = None,
                   sm_count: int | None = None) -> DeviceSpec:
    """The preset that best describes a device called ``name`` (e.g. torch's device name).

    Matches a preset's model token inside the name ("NVIDIA H100 80GB HBM3" → H100 SXM);
    failing that, the preset with the same compute capability and nearest SM count, with a
    warning that its rates are guesses until the device is calibrated.
    """
    n = _norm(name)
    # Longest token first, so "l40s" wins over a shorter token it contains.
    tokens = {"h100": "h100-sxm", "h200": "h200", "a100": "a100-sxm", "l40s": "l40s",
              "l20": "l20", "4090": "rtx4090"}
    for tok in sorted(tokens, key=len, reverse=True):
        if tok in n:
            return PRESETS[tokens[tok]]
    candidates = [p for p in PRESETS.values() if p.compute_capability == compute_capability]
    candidates = candidates or list(PRESETS.values())
    best = min(candidates, key=lambda p: (abs(p.sm_count - (sm_count or p.sm_count)), p.name))
    warnings.warn(f"no DeviceSpec preset for {name!r}; bandwidth and flop rates are taken from "
                  f"{best.name!r} until this device is calibrated (python -m mk calibrate)",
                  stacklevel=2)
    return best


# ---- calibration files --------------------------------------------------------------------

def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def calibration_path(name: str) -> Path:
    """Where the calibration for the device called ``name`` lives:
    ``<cache_dir>/calibration/<slug>.json`` (e.g. ``nvidia-h200.json``)."""
    slug = _slug(name)
    if not slug:
        raise ValueError(f"device name {name!r} has no letters or digits to name a file by")
    return cache_dir() / "calibration" / f"{slug}.json"


def load_calibration_file(name: str) -> dict[str, Any] | None:
    """The stored calibration constants for device ``name`` (as
    :meth:`DeviceSpec.with_calibration` takes them), or None if none are stored. Link
    constants measured by another method than :data:`LINK_METHOD` are left out, with a
    warning that says how to measure them again."""
    path = calibration_path(name)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path} must hold a JSON object")
    method = data.pop("link_method", None)
    if method != LINK_METHOD and any(f in data for f in LINK_FIELDS):
        warnings.warn(f"calibration file {path} holds GPU link constants measured for another all-reduce "
                      f"({method or 'flags and peer reads'}); the planner uses its preset's until "
                      f"`torchrun --nproc-per-node N -m mk calibrate` measures the link again", RuntimeWarning,
                      stacklevel=2)
        data = {k: v for k, v in data.items() if k not in LINK_FIELDS}
    return data


def save_calibration(spec: DeviceSpec, *, link: bool = False) -> Path:
    """Write ``spec``'s cost-model constants to :func:`calibration_path`; returns the path.
    ``link``: its GPU link's too (measured over several ranks); without it, link constants
    stored before are kept.

    ``DeviceSpec.from_gpu()`` loads them back on the same device.
    """
    path = calibration_path(spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    before = {} if link else {f: v for f, v in (load_calibration_file(spec.name) or {}).items() if f in LINK_FIELDS}
    data = {"name": spec.name, **{f: getattr(spec, f) for f in CALIBRATED_FIELDS + (LINK_FIELDS if link else ())},
            **before}
    if any(f in data for f in LINK_FIELDS):
        data["link_method"] = LINK_METHOD
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path


# ---- byte sizes ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: int | str) -> int:
    """A byte count from ``"101376"``, ``"99KiB"``, ``"0.5 MiB"``, ``"2G"`` (binary units) or an int.

    "KB"/"MB"/"GB" are refused as ambiguous (spec sheets use them for both 1000 and 1024);
    the result must be a whole, non-negative number of bytes.
    """
    if isinstance(text, bool):
        raise TypeError(f"parse_bytes needs a string or int, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte count must be non-negative, got {text}")
        return text
    if not isinstance(text, str):
        raise TypeError(f"parse_bytes needs a string or int, got {type(text).__name__}")
    m = _BYTES_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse {text!r} as a byte size; expected e.g. '101376', "
                         f"'99KiB', '0.5MiB'")
    number, unit = m.group(1), m.group(2).lower()
    if unit in ("kb", "mb", "gb"):
        raise ValueError(f"{text!r}: unit {m.group(2)!r} is ambiguous (1000 or 1024?); "
                         f"write {m.group(2)[0].upper()}iB")
    if unit not in _UNITS:
        raise ValueError(f"{text!r}: unknown unit {m.group(2)!r}; use B, KiB, MiB or GiB")
    value = float(number) * _UNITS[unit]
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes ({value})")
    return int(value)


__all__ = [
    "ALIASES",
    "CALIBRATED_FIELDS",
    "PRESETS",
    "DeviceSpec",
    "cache_dir",
    "calibration_path",
    "closest_preset",
    "load_calibration_file",
    "parse_bytes",
    "save_calibration",
]
