"""Launch a lowered program as one persistent megakernel; errors, residency and traces.

``Megakernel(program)`` generates and compiles the kernel for the program's op
variants, uploads the descriptors (with the buffers' addresses) and queues, and launches
one program per worker. Counters are never reset between launches (thresholds grow with
the launch count kept on the device), so launches can be enqueued back to back, or
captured in a CUDA graph, with no host work in between.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mk.tasks import enable_device_descriptors

from .codegen import device_words, generate_source, kernel_constexprs, load_kernel
from .graph import Program
from .sync import ERROR_WORDS


class MegakernelError(RuntimeError):
    """The megakernel cannot be launched as planned."""


class MegakernelTimeout(MegakernelError):
    """A dependency wait exceeded its bound; the kernel exited instead of hanging."""

    def __init__(self, worker: int, task: int, task_name: str, event: int, seen: int, expected: int):
        self.worker, self.task, self.task_name = worker, task, task_name
        self.event, self.seen, self.expected = event, seen, expected
        # (Event -2 - q: a task waiting on the other ranks of a tensor-parallel step waited for rank q.)
        waited = f"event {event}" if event >= -1 else f"rank {-2 - event} of the tensor-parallel step"
        super().__init__(f"megakernel wait timed out: worker {worker}, task {task} ({task_name}) waited on "
                         f"{waited}, saw {seen} of {expected}")


@dataclass(frozen=True)
class Residency:
    """How many programs of the compiled kernel fit on the GPU at once, and why."""

    n_regs: int
    n_spills: int
    shared_bytes: int
    num_warps: int
    blocks_per_sm: int
    sm_count: int

    @property
    def max_workers(self) -> int:
        return self.blocks_per_sm * self.sm_count


def blocks_per_sm(n_regs: int, shared_bytes: int, num_warps: int, props) -> int:
    """Resident blocks per SM allowed by registers, shared memory and threads.

    Each block's shared memory is its own plus what the driver reserves a block (the SM's
    shared memory less the opt-in most a block may use: 1 KiB on Ampere and Hopper), in
    128-byte units: three 76 KiB workers do not fit an H200 SM's 228 KiB."""
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    reserved = smem_per_sm - optin if 0 < optin < smem_per_sm else 1024
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    regs_per_warp = math.ceil(max(n_regs, 1) * 32 / 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = smem_per_sm // (-(-(shared_bytes + reserved) // 128) * 128) if shared_bytes else 32
    by_threads = threads_per_sm // (32 * num_warps)
    return max(0, min(by_regs, by_smem, by_threads, 32))


def device_descriptors(program: Program) -> torch.Tensor:
    """The program's descriptors as the kernel reads them: each operand's buffer slot
    replaced by the buffer's 64-bit address (two int32 words, low then high), so a task
    binds its pointers straight from its own row (see codegen.device_words)."""
    buffers = [program.graph.buffers[n] for n in program.buffer_names]
    addr = torch.tensor([b.data_ptr() for b in buffers] or [0], dtype=torch.int64)
    desc = program.desc.to(torch.int64)
    slots = desc[:, program.slot_base:program.arg_base]
    ptrs = addr[slots]
    # Unused slots (past an op's operands) hold slot 0: a valid address, never read.
    lo = ptrs & 0xFFFFFFFF
    lo = torch.where(lo >= 2**31, lo - 2**32, lo)
    hi = ptrs >> 32
    pairs = torch.stack((lo, hi), dim=2).reshape(desc.shape[0], -1)
    out = torch.cat((desc[:, :program.slot_base], pairs, desc[:, program.arg_base:]), dim=1)
    assert out.shape[1] == device_words(program)
    return out.to(torch.int32)


class Megakernel:
    """One compiled persistent kernel running a :class:`Program`.

    Args:
        program: the lowered graph (its buffers must live on mk's device).
        timeout_s: bound of every dependency wait on the GPU.
        trace: record each task's start/end time (GPU global timer).
        interpret_polls: bound of a wait under the interpreter, in polls.
        backoff_ns: sleep between polls (GPU only).
        defer_signals: a worker's run of same-event tasks signals once, at its end (the
            VM's ``defer_signals`` models it).
        num_warps: warps a worker; default the most any task asks for. Task bodies compile
            for any count (Triton picks their layouts), so fewer warps trade each worker's
            threads for more resident workers.
    """

    def __init__(self, program: Program, *, timeout_s: float = 0.5, trace: bool = False,
                 interpret_polls: int = 2000, backoff_ns: int = 0, defer_signals: bool = True,
                 num_warps: int | None = None):
        self.program = program
        buffers = [program.graph.buffers[n] for n in program.buffer_names]
        devices = {b.device for b in buffers}
        if len(devices) > 1:
            raise MegakernelError(f"buffers are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        #: True when the kernel runs through the Triton interpreter (CPU buffers).
        self.interpret = self.device.type != "cuda"
        if self.interpret and program.num_workers != 1:
            raise MegakernelError("under the Triton interpreter programs run one after another: "
                                  "lower the graph for num_workers=1 (use the VM for more workers)")
        #: Whether its TMA bodies make descriptors on the device (scratch from Triton's allocator).
        self.descriptors = any(spec.constexprs.get("TMA_STAGES", 0) for spec, _ in program.variants)
        if self.descriptors:
            enable_device_descriptors()
        self.source = generate_source(program, gpu=not self.interpret)
        self.backoff_ns, self.defer_signals = int(backoff_ns), bool(defer_signals)
        self.kernel, self.digest = load_kernel(self.source)
        dev = self.device
        self.desc = device_descriptors(program).to(dev)
        self.queue_starts = program.queue_starts.to(dev)
        self.counters = torch.zeros(max(program.num_events, 1), dtype=torch.int32, device=dev)
        self.state = torch.zeros(2, dtype=torch.int32, device=dev)
        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev)
        self.trace_enabled = trace
        self.trace_buf = torch.zeros(max(self.desc.shape[0] * 4, 4), dtype=torch.int64, device=dev)
        if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
            raise MegakernelError(f"num_warps must be a power of two from 1 to 16, got {num_warps}")
        self.num_warps = num_warps or (max(spec.num_warps for spec, _ in program.variants) if program.variants else 4)
        self.timeout = interpret_polls if self.interpret else int(timeout_s * 1e9)
        self._residency: Residency | None = None

    # -- launching -------------------------------------------------------------------
    def _args(self):
        p = self.program
        return ((self.desc, self.queue_starts, self.counters, self.state, self.error, self.trace_buf,
                 p.num_workers, self.timeout),
                dict(kernel_constexprs(p, trace=self.trace_enabled, use_timer=not self.interpret,
                                       backoff_ns=self.backoff_ns, defer_signals=self.defer_signals),
                     num_warps=self.num_warps))

    def residency(self) -> Residency:
        """Compile (once) and read registers and shared memory off the compiled kernel."""
        if self._residency is None:
            if self.interpret:
                self._residency = Residency(0, 0, 0, self.num_warps, 1, 1)
            else:
                args, kw = self._args()
                compiled = self.kernel.warmup(*args, grid=(self.program.num_workers,), **kw)
                if hasattr(compiled, "_init_handles"):
                    compiled._init_handles()
                props = torch.cuda.get_device_properties(self.device)
                shared = int(getattr(compiled.metadata, "shared", 0))
                n_regs = int(getattr(compiled, "n_regs", 0))
                self._residency = Residency(n_regs, int(getattr(compiled, "n_spills", 0)), shared, self.num_warps,
                                            blocks_per_sm(n_regs, shared, self.num_warps, props),
                                            props.multi_processor_count)
        return self._residency

    def launch(self) -> None:
        """Enqueue one launch (no host sync). Raises before launching if workers can't all be resident."""
        res = self.residency()
        if not self.interpret and self.program.num_workers > res.max_workers:
            raise MegakernelError(
                f"{self.program.num_workers} workers cannot all be resident: the kernel uses {res.n_regs} registers "
                f"and {res.shared_bytes} B of shared memory with {res.num_warps} warps, so at most "
                f"{res.blocks_per_sm} per SM × {res.sm_count} SMs = {res.max_workers}")
        if self.descriptors:
            enable_device_descriptors()  # (per thread: a scheduler's thread launches too)
        args, kw = self._args()
        self.kernel[(self.program.num_workers,)](*args, **kw)

    def check(self, error_words: torch.Tensor | None = None) -> None:
        """Raise :class:`MegakernelTimeout` if a wait timed out (then reset). Reads the error
        words from the device (a sync), or takes ``error_words``: a host copy of
        :attr:`error` the caller read back with its own results, so the check costs no
        sync of its own."""
        err = (self.error if error_words is None else error_words).tolist()
        if err[0]:
            worker, task, event, seen, expected = err[1:6]
            self.reset()
            name = self.program.graph.tasks[task].name if 0 <= task < len(self.program.graph.tasks) else "?"
            raise MegakernelTimeout(worker, task, name, event, seen, expected)

    def run(self) -> None:
        """Launch once and check for errors."""
        self.launch()
        self.check()

    def reset(self) -> None:
        """Zero counters, launch count and error, and the ops' own counters
        (:attr:`OpSpec.sync_operands`): needed only after a failed launch."""
        self.counters.zero_()
        self.state.zero_()
        self.error.zero_()
        graph = self.program.graph
        for name in sorted({t.bind[role] for t in graph.tasks for role in t.op.sync_operands}):
            graph.buffers[name].zero_()

    # -- inspection -------------------------------------------------------------------
    def dump_source(self, path: str | Path) -> Path:
        """Write the generated kernel source to ``path``."""
        path = Path(path)
        path.write_text(self.source)
        return path

    def trace_events(self) -> list[dict]:
        """Per task of the last traced launch: worker, task name, op, its start, ready (waits
        done) and end times in µs from the first start, and the SM its worker ran on."""
        if not self.trace_enabled:
            raise MegakernelError("tracing is off: build the Megakernel with trace=True")
        times = self.trace_buf.view(-1, 4)[: self.desc.shape[0]].tolist()
        t0 = min((row[0] for row in times), default=0)
        events = []
        for w, queue in enumerate(self.program.queues):
            base = int(self.program.queue_starts[w])
            for j, task in enumerate(queue):
                start, ready, end, sm = times[base + j]
                events.append({"worker": w, "task": task, "name": self.program.graph.tasks[task].name,
                               "op": self.program.graph.tasks[task].op.name, "start_us": (start - t0) / 1e3,
                               "ready_us": (ready - t0) / 1e3, "end_us": (end - t0) / 1e3, "sm": sm})
        return events

    def save_trace(self, json_path: str | Path, png_path: str | Path | None = None) -> None:
        """Chrome-trace JSON (opens in Perfetto) and, if matplotlib is there, a PNG Gantt chart."""
        from .trace import gantt_png, to_chrome_trace

        events = self.trace_events()
        Path(json_path).write_text(json.dumps(to_chrome_trace(events)))
        if png_path is not None:
            gantt_png(events, png_path, num_workers=self.program.num_workers)
