"""Weight lines pulled into L2 ahead of a tile's wait (:func:`linear_prefetch_tile`: inline
PTX, compiled code only), and programmatic dependent launch's entry for the launcher."""

from __future__ import annotations

import triton.language as tl

from .._device import jit


@jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs``; returns at once (nothing lands in registers)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@jit
def _bulk_prefetch_rows(base, stride_bytes, rows, nbytes):
    """Thread t < rows asks L2 for ``nbytes`` from ``base + t * stride_bytes`` with one TMA bulk
    prefetch (cp.async.bulk.prefetch.L2, sm_90+): one instruction per row, no duplicates.
    Addresses and sizes must be multiples of 16 bytes."""
    tl.inline_asm_elementwise(
        "{\n .reg .pred p;\n .reg .u32 t;\n .reg .u64 off, a;\n mov.u32 t, %tid.x;\n"
        " setp.lt.u32 p, t, $3;\n setp.ne.and.u32 p, $4, 0, p;\n mul.wide.u32 off, t, $2;\n add.u64 a, $1, off;\n"
        " @p cp.async.bulk.prefetch.L2.global [a], $4;\n mov.u32 $0, 0;\n}",
        "=r,l,r,r,r", [base, stride_bytes, rows, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@jit
def linear_prefetch_tile(w_ptr, pid_n, N, k_lo, k_hi, stride_wn,
                         PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BULK: tl.constexpr = False):
    """Start pulling the first PREFETCH_LINES cache lines (LINE elements each) from k_lo of each of
    the tile's weight rows into L2, without waiting for them.

    Weights never depend on the previous task, so a tile issues this *before* its dependency
    wait (``gdc_wait`` in a standalone launch, the event wait in the megakernel): DRAM starts
    streaming while the producer drains, and the tile's own loads then hit L2. Compiled GPU
    code only (inline PTX); launchers pass PREFETCH_LINES = 0 under the interpreter.
    BULK: one TMA bulk prefetch per row (needs 16-byte aligned rows and k_lo), else one
    ``prefetch.global.L2`` per line.
    """
    if (PREFETCH_LINES > 0) & BULK:
        ELEM_BYTES: tl.constexpr = 128 // LINE
        row0 = pid_n * BLOCK_N
        span = tl.minimum(PREFETCH_LINES * LINE, k_hi - k_lo)
        _bulk_prefetch_rows(w_ptr + row0 * stride_wn + k_lo, stride_wn * ELEM_BYTES, tl.minimum(N - row0, BLOCK_N),
                            (span * ELEM_BYTES) // 16 * 16)
    elif PREFETCH_LINES > 0:
        idx = tl.arange(0, BLOCK_N * PREFETCH_LINES)
        rows = tl.minimum(pid_n * BLOCK_N + idx // PREFETCH_LINES, N - 1)
        cols = tl.minimum(k_lo + (idx % PREFETCH_LINES) * LINE, k_hi - 1)
        _prefetch_l2(w_ptr + rows * stride_wn + cols)


@jit
def _pdl_enter(PDL: tl.constexpr):
    """Under programmatic dependent launch: let the next kernel launch now, then wait for the
    previous one to finish (its writes visible) before this program reads activations."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
