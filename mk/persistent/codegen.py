"""Generate the megakernel's source from a program's op variants.

Only the dispatch loop is generated: per worker, walk its queue; per task, bind operand
pointers from its descriptor, wait on its events, run the op (an ordinary device
function from mk.tasks), signal. The loop is software-pipelined: the next task's
descriptor is loaded and its weight prefetch issued before the current task waits. The source is written
to a cache folder (so Triton, tracebacks and people can read it) and imported once per
source hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import textwrap

import torch

from mk.tasks._cache import cache_dir
from mk.tasks._spec import TL_DTYPES, OpSpec

from .graph import HEADER_WORDS, Program

KERNEL_NAME = "megakernel"


def _indent(src: str, level: int) -> str:
    return textwrap.indent(textwrap.dedent(src).strip("\n"), "    " * level)


def _words(prefix: str, n: int) -> str:
    return ", ".join(f"{prefix}{j}" for j in range(n))


def _bind(spec: OpSpec, dtypes: tuple[torch.dtype, ...], program: Program, w: str, gpu: bool) -> list[str]:
    """Lines binding the op's operand pointers, args and constexprs from descriptor words ``w*``;
    ``GPU`` says whether the code is compiled for a GPU (inline PTX and hints) or interpreted."""
    lines = [f"GPU: tl.constexpr = {bool(gpu)!r}"]
    ptr_base, arg_base = program.slot_base, program.slot_base + 2 * program.max_slots
    for j, (role, dt) in enumerate(zip(spec.operands, dtypes)):
        lo, hi = f"{w}{ptr_base + 2 * j}", f"{w}{ptr_base + 2 * j + 1}"
        # TaskGraph.buffer admits only 16-byte aligned buffers; saying so lets Triton vectorise
        # loads and pipeline them (a pointer rebuilt from words is otherwise 1-byte aligned).
        lines.append(f"{role} = tl.multiple_of(((({hi}).to(tl.int64) << 32) | (({lo}).to(tl.int64) & 0xFFFFFFFF))"
                     f".to(tl.pointer_type({TL_DTYPES[dt]})), 16)")
    for j, arg in enumerate(spec.args):
        lines.append(f"{arg} = {w}{arg_base + j}")
    for name, value in sorted(spec.constexprs.items()):
        lines.append(f"{name}: tl.constexpr = {value!r}")
    return lines


def _variant_function(opcode: int, spec: OpSpec, dtypes: tuple[torch.dtype, ...], program: Program,
                      gpu: bool) -> str:
    """One jit function per variant, so each op's local names and types stay its own: bind
    operands, run the op's preload, wait on the task's events, run the body."""
    n = device_words(program)
    lines = _bind(spec, dtypes, program, "w", gpu)
    if spec.preload:
        lines.append("# loads that do not depend on other tasks, issued before waiting for them")
        lines.append(textwrap.dedent(spec.preload).strip("\n"))
    if spec.waits_in_body:
        # The body calls task_wait itself, after issuing what does not depend on its inputs.
        lines.append(f"task_wait_args = ({', '.join(_wait_words(program))}, counters_ptr, error_ptr, epoch, worker, "
                     f"timeout)")
        # (t_ready: when the task's inputs were ready; the body's task_wait replaces it, and a
        # body that needs no input skips the wait and keeps it.)
        lines.append("t_ready = now_ns(USE_TIMER & TRACE)")
        lines.append("task_wait_state = (ok, last_ev, last_need, t_ready)")
        lines.append("TASK_WAIT_FLAGS: tl.constexpr = (USE_TIMER, BACKOFF_NS, TRACE)")
        lines.append(textwrap.dedent(spec.body).strip("\n"))
    else:
        lines.append(_waits(program))
        lines.append("t_ready = now_ns(USE_TIMER & TRACE)")
        lines.append("if ok != 0:")
        lines.append(_indent(spec.body, 1))
    dt_names = [str(d).replace("torch.", "") for d in dtypes]
    return (f"@jit\ndef op_{opcode}({_words('w', n)}, counters_ptr, error_ptr, epoch, worker, timeout, ok, "
            f"last_ev, last_need, USE_TIMER: tl.constexpr, BACKOFF_NS: tl.constexpr, "
            f"TRACE: tl.constexpr):\n"
            f"    \"\"\"{spec.key} on {dt_names}\"\"\"\n" + _indent("\n".join(lines), 1) +
            "\n    return ok, last_ev, last_need, t_ready\n")


def _waits(program: Program) -> str:
    """A task's dependency waits (descriptor words w*), the same code in every op."""
    lines = []
    for k in range(program.max_waits):
        ev, cnt = HEADER_WORDS + 2 * k, HEADER_WORDS + 2 * k + 1
        lines.append("if ok != 0:")
        lines.append(f"    ok, last_ev, last_need = wait_event(w{ev}, w{cnt}, w2 > {k}, counters_ptr, error_ptr, "
                     f"epoch, worker, w3, timeout, last_ev, last_need, USE_TIMER=USE_TIMER, "
                     f"BACKOFF_NS=BACKOFF_NS)")
    return "\n".join(lines)


def _wait_words(program: Program) -> list[str]:
    """Descriptor words a task's waits read: the number of waits, the task index, the (event,
    count) pairs."""
    return ["w2", "w3"] + [f"w{HEADER_WORDS + j}" for j in range(2 * program.max_waits)]


def _task_wait_function(program: Program) -> str:
    """``task_wait``: a task's dependency waits as a function, for bodies that wait themselves
    (:attr:`OpSpec.waits_in_body`); the same waits as every other op's."""
    lines = [f"{', '.join(_wait_words(program))}, counters_ptr, error_ptr, epoch, worker, timeout = args",
             "ok, last_ev, last_need, t_ready = state",
             "USE_TIMER: tl.constexpr = FLAGS[0]", "BACKOFF_NS: tl.constexpr = FLAGS[1]",
             "TRACE: tl.constexpr = FLAGS[2]", _waits(program), "t_ready = now_ns(USE_TIMER & TRACE)",
             "return ok, last_ev, last_need, t_ready"]
    return ("@jit\ndef task_wait(args, state, FLAGS: tl.constexpr):\n"
            "    \"\"\"The task's dependency waits; state (ok, last_ev, last_need, t_ready) in and out.\"\"\"\n"
            + _indent("\n".join(lines), 1) + "\n")


def _prefetch_function(opcode: int, spec: OpSpec, dtypes: tuple[torch.dtype, ...], program: Program,
                       gpu: bool) -> str:
    """The op's weight prefetch (loads that do not depend on other tasks), on its own."""
    n = device_words(program)
    lines = _bind(spec, dtypes, program, "w", gpu) + [textwrap.dedent(spec.prefetch).strip("\n")]
    return (f"@jit\ndef prefetch_{opcode}({_words('w', n)}):\n"
            f"    \"\"\"weights of {spec.key}, before its wait\"\"\"\n" + _indent("\n".join(lines), 1) + "\n")


def device_words(program: Program) -> int:
    """Words of a descriptor as the megakernel reads it: operand slots become 64-bit pointers."""
    return program.slot_base + 2 * program.max_slots + program.max_args


def _load_row(prefix: str, ptr: str, n: int, mask: str) -> str:
    return "\n".join(f"{prefix}{j} = tl.load({ptr} + {j}, mask={mask}, other=-1)" for j in range(n))


def _dispatch(program: Program, fn: str, words: str, tail: str, assign: str, only=None) -> str:
    branches = [i for i, (spec, _) in enumerate(program.variants) if only is None or only(spec)]
    out = []
    for k, i in enumerate(branches):
        out.append(f"{'if' if k == 0 else 'elif'} {words}0 == {i}:\n    {assign}{fn}_{i}({_words(words, device_words(program))}{tail})")
    return "\n".join(out) if out else "pass"


def program_on_gpu(program: Program) -> bool:
    """Whether ``program``'s buffers live on a CUDA GPU (its kernel is compiled), rather than
    on the CPU (interpreted)."""
    return any(program.graph.buffers[n].is_cuda for n in program.buffer_names)


def generate_source(program: Program, gpu: bool | None = None) -> str:
    """The full Python source of the megakernel module for ``program``, compiled for a GPU or
    interpreted (``gpu``; default: where the program's buffers are)."""
    gpu = program_on_gpu(program) if gpu is None else gpu
    n = device_words(program)
    imports = sorted({imp for spec, _ in program.variants for imp in spec.imports})
    functions = "\n\n".join(_variant_function(i, spec, dtypes, program, gpu)
                              for i, (spec, dtypes) in enumerate(program.variants))
    if any(spec.waits_in_body for spec, _ in program.variants):
        functions = _task_wait_function(program) + "\n\n" + functions
    prefetches = "\n\n".join(_prefetch_function(i, spec, dtypes, program, gpu)
                              for i, (spec, dtypes) in enumerate(program.variants) if spec.prefetch)
    has_prefetch = lambda spec: bool(spec.prefetch)  # noqa: E731
    run = _dispatch(program, "op", "w", ", counters_ptr, error_ptr, epoch, worker, timeout, ok, last_ev, last_need, "
                    "USE_TIMER=USE_TIMER, BACKOFF_NS=BACKOFF_NS, TRACE=TRACE",
                    "ok, last_ev, last_need, t_ready = ")
    prefetch_first = _dispatch(program, "prefetch", "w", "", "", has_prefetch)
    prefetch_next = _dispatch(program, "prefetch", "n", "", "", has_prefetch)
    carried = "\n".join(f"w{j} = n{j}" for j in range(n))
    # Per task: start (before its waits), ready (waits done), end (signalled), the worker's SM.
    trace = ("if TRACE:\n    tl.store(trace_ptr + qi * 4, t_start)\n    tl.store(trace_ptr + qi * 4 + 1, t_ready)\n"
             "    tl.store(trace_ptr + qi * 4 + 2, now_ns(USE_TIMER))\n"
             "    tl.store(trace_ptr + qi * 4 + 3, sm_id(USE_TIMER).to(tl.int64))")
    loop = f'''    # Software-pipelined over the queue: task i+1's descriptor is loaded, and its weights
    # prefetched, while task i waits and runs, so no descriptor load and no weight
    # latency sits between two tasks.
    d = desc_ptr + q_begin.to(tl.int64) * DESC_WORDS
{_indent(_load_row("w", "d", n, "q_begin < q_end"), 1)}
    if q_begin < q_end:
{_indent(prefetch_first, 2)}
    ok = 1
    last_ev = tl.full([], -1, tl.int32)
    last_need = tl.zeros([], dtype=tl.int32)
    pending = tl.zeros([], dtype=tl.int32)
    for qi in range(q_begin, q_end):
        d = d + DESC_WORDS
        has_next = qi + 1 < q_end
{_indent(_load_row("n", "d", n, "has_next"), 2)}
        if ok != 0:
            t_start = now_ns(USE_TIMER & TRACE)  # the timer is read only for traces
            if has_next:
{_indent(prefetch_next, 4)}
            t_ready = t_start
{_indent(run, 3)}
            if ok != 0:
                # A run of consecutive tasks with the same signal event signals once, at its
                # end: one fence and one atomic instead of one per task. Safe: every consumer
                # needs all of the event's producers anyway, and no task of the run can wait
                # on anything that needs the run's signal (that would be a cycle).
                if DEFER_SIGNALS:
                    if has_next & (n1 == w1) & (w1 >= 0):
                        pending += 1
                    else:
                        signal_event(w1, counters_ptr, pending + 1)
                        pending = 0
                else:
                    signal_event(w1, counters_ptr)
{_indent(trace, 3)}
{_indent(carried, 2)}'''
    return f'''# Generated by mk.persistent.codegen: the dispatch loop of one megakernel.
# Variants (opcode: op): {", ".join(f"{i}: {s.key}" for i, (s, _) in enumerate(program.variants))}
# Descriptor words (w0..w{n - 1}): opcode, signal event, number of waits, task index,
# (event, count) x {program.max_waits}, operand pointers (lo, hi) x {program.max_slots}, args x {program.max_args}.
import triton
import triton.language as tl

from mk.persistent.sync import now_ns, signal_event, sm_id, wait_event
from mk.tasks._device import jit
{chr(10).join(imports)}


{functions}

{prefetches}

@jit
def {KERNEL_NAME}(desc_ptr, queue_ptr, counters_ptr, state_ptr, error_ptr, trace_ptr, num_workers, timeout,
               DESC_WORDS: tl.constexpr, TRACE: tl.constexpr, USE_TIMER: tl.constexpr,
               BACKOFF_NS: tl.constexpr, DEFER_SIGNALS: tl.constexpr):
    worker = tl.program_id(0)
    # state: [launches completed, workers finished (cumulative)]; thresholds grow with it,
    # so counters never need a host reset between launches.
    epoch = tl.load(state_ptr)
    q_begin = tl.load(queue_ptr + worker)
    q_end = tl.load(queue_ptr + worker + 1)
{loop}
    # The last worker of this launch to finish bumps the launch count. Every worker read
    # the count before arriving here, so none of this launch sees the new value.
    finished = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == (epoch + 1) * num_workers - 1:
        tl.atomic_add(state_ptr, 1, sem="release", scope="gpu")
'''


#: The generated kernel's runtime arguments (Triton signature types), then its constexprs.
KERNEL_ARGS = {"desc_ptr": "*i32", "queue_ptr": "*i32", "counters_ptr": "*i32", "state_ptr": "*i32",
               "error_ptr": "*i32", "trace_ptr": "*i64", "num_workers": "i32", "timeout": "i64"}


def kernel_constexprs(program: Program, *, trace: bool = False, use_timer: bool = True, backoff_ns: int = 0,
                      defer_signals: bool = True) -> dict:
    """The constexpr arguments of the generated kernel (what a launch passes by keyword)."""
    return dict(DESC_WORDS=device_words(program), TRACE=trace, USE_TIMER=use_timer, BACKOFF_NS=backoff_ns,
                DEFER_SIGNALS=defer_signals)


def compile_for_target(program: Program, *, arch: int = 90, num_warps: int = 4, **constexprs):
    """Compile ``program``'s megakernel for ``sm_<arch>`` without launching it (no GPU needed
    when Triton's NVIDIA backend is installed): type, layout and inline-PTX errors show here.
    Compiled as :class:`mk.persistent.runtime.Megakernel` compiles it."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel, _ = load_kernel(generate_source(program, gpu=True))
    cx = kernel_constexprs(program, **constexprs)
    src = triton.compiler.ASTSource(fn=kernel, signature={**KERNEL_ARGS, **{k: "constexpr" for k in cx}},
                                    constexprs=cx)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def load_kernel(source: str):
    """Write ``source`` under the cache folder (named by its hash) and import its kernel."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    module_name = f"mk_megakernel_{digest}"
    if module_name in sys.modules:
        return getattr(sys.modules[module_name], KERNEL_NAME), digest
    path = cache_dir("kernels") / f"{module_name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(source)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, KERNEL_NAME), digest
