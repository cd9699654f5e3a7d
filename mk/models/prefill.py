"""Prefill shared by the model families: prompts packed into chunks, precision modes, the
workspace bound, and attention over the cache a chunk has filled.

A prefill runs the prompts' tokens through the layers a chunk at a time. The prompts of a
batch are packed one after another (no padding: a short prompt costs its own tokens only)
and the packed stream is cut into chunks of at most :attr:`PrefillBudget.chunk_tokens`
tokens. Each chunk holds, for every prompt it touches, one :class:`Segment`: a run of that
prompt's consecutive tokens, which attends to the prompt's tokens before it (already in
the KV cache) and causally to itself.

Two precisions (:data:`PREFILL_PRECISIONS`):

* ``"fast"`` (the default): the matmul operands are in the weights' dtype (bf16 on a
  GPU) with float32 accumulation, as every serving engine runs prefill; the residual
  stream stays float32. On a GPU the matmuls are cuBLAS's and attention is PyTorch's SDPA
  (flash / cuDNN kernels), with mk's Triton kernels for the fused RMSNorm (+ residual
  add), RoPE + KV append and SiLU·mul between them.
* ``"exact"``: every activation is float32, as in the decode step; mk's linear tiles meet
  16-bit weights with a float32 activation as two 16-bit halves, so only the weights and
  the cache are rounded. Logits closest to float32, at about half the tensor-core rate.

The workspace is the activations of one chunk; its bound is stated up front
(``footprint()["prefill_workspace"]``) and a request whose workspace the device cannot
hold is refused before any work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mk.tasks.prefill_attention import prefill_attention

#: The prefill precisions: see the module docstring.
PREFILL_PRECISIONS = ("fast", "exact")

#: Most tokens a chunk holds: past a few thousand tokens the matmuls are at the tensor
#: cores' rate and longer chunks only cost memory (vLLM's chunked prefill: 2k-8k).
MAX_CHUNK_TOKENS = 8192

#: Default workspace: this share of the GPU's memory, at most DEFAULT_WORKSPACE_MAX bytes,
#: so that a model filling up to 90% of the GPU with its weights and cache still prefills.
DEFAULT_WORKSPACE_SHARE = 0.05
DEFAULT_WORKSPACE_MAX = 2 * 2**30
#: Default workspace on the CPU (the interpreter): small chunks, as tests use.
DEFAULT_CPU_WORKSPACE = 256 * 2**20


def check_precision(precision) -> str:
    if precision not in PREFILL_PRECISIONS:
        raise ValueError(f"prefill_precision must be one of {PREFILL_PRECISIONS}, got {precision!r}")
    return precision


def default_workspace(device: torch.device) -> int:
    """The default prefill workspace on ``device`` (bytes)."""
    if device.type != "cuda":
        return DEFAULT_CPU_WORKSPACE
    total = torch.cuda.get_device_properties(device).total_memory
    return min(DEFAULT_WORKSPACE_MAX, int(DEFAULT_WORKSPACE_SHARE * total))


@dataclass(frozen=True)
class PrefillBudget:
    """How a prefill is cut: ``per_token`` bytes of activations live at once for each token
    of a chunk, so a workspace of ``workspace`` bytes holds chunks of ``chunk_tokens``."""

    per_token: int
    workspace: int
    chunk_tokens: int

    @classmethod
    def make(cls, per_token: int, workspace) -> "PrefillBudget":
        if isinstance(workspace, bool) or not isinstance(workspace, int) or workspace < 1:
            raise ValueError(f"prefill_workspace must be a number of bytes >= 1, got {workspace!r}")
        if workspace < per_token:
            raise ValueError(f"prefill_workspace of {workspace} bytes holds no token: this model's prefill "
                             f"needs {per_token} bytes a token")
        return cls(per_token, workspace, min(MAX_CHUNK_TOKENS, workspace // per_token))

    @property
    def bound(self) -> int:
        """The most workspace bytes a prefill uses (a full chunk's activations)."""
        return self.chunk_tokens * self.per_token

    def check_fits(self, device: torch.device, tokens: int, extra: int = 0) -> None:
        """Refuse, before any work, a prefill of ``tokens`` tokens (plus ``extra`` output
        bytes) that the device's free memory cannot hold."""
        need = min(tokens, self.chunk_tokens) * self.per_token + extra
        free = free_bytes(device, need)
        if free is not None and need > free:
            raise MemoryError(f"prefill needs {need / 2**20:.0f} MiB of workspace on {device} but only "
                              f"{free / 2**20:.0f} MiB are free: lower prefill_workspace (now "
                              f"{self.workspace / 2**20:.0f} MiB), the batch or the prompt lengths")


def free_bytes(device: torch.device, need: int = 0) -> int | None:
    """Bytes a new tensor on ``device`` can take: the GPU's free memory, and when that is
    under ``need`` the blocks PyTorch's allocator holds unused too (reading the allocator's
    statistics costs the host a millisecond); None on the CPU (no bound is enforced)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    if free >= need:
        return free
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, stop)`` of prompt ``row``, at rows ``[offset, offset + stop - start)``
    of their chunk."""

    row: int
    start: int
    stop: int
    offset: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start


def pack(lengths: list[int], chunk_tokens: int) -> list[list[Segment]]:
    """The prompts of ``lengths`` tokens, packed back to back, cut into chunks of at most
    ``chunk_tokens`` tokens: each chunk's segments, in order."""
    chunks: list[list[Segment]] = [[]]
    used = 0
    for row, n in enumerate(lengths):
        start = 0
        while start < n:
            if used == chunk_tokens:
                chunks.append([])
                used = 0
            take = min(n - start, chunk_tokens - used)
            chunks[-1].append(Segment(row, start, start + take, used))
            start, used = start + take, used + take
    return chunks


def chunk_indices(segments: list[Segment], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's position in its prompt ``[1, n]`` and its cache row ``[n]`` (int32),
    made on the device (no copy from the host: a CUDA graph can capture them)."""
    pos = [torch.arange(s.start, s.stop, dtype=torch.int32, device=device) for s in segments]
    rows = [torch.full((s.tokens,), s.row, dtype=torch.int32, device=device) for s in segments]
    return (pos[0] if len(pos) == 1 else torch.cat(pos))[None], rows[0] if len(rows) == 1 else torch.cat(rows)


#: Prompt tokens of a captured chunk are rounded up to a multiple of this (see
#: :func:`graph_tokens`); padded tokens write cache rows past the prompt, which decode
#: overwrites before it reads them.
GRAPH_TOKEN_STEP = 128
#: Captured prefill chunks a model keeps (their graphs share one memory pool; each keeps
#: its output rows, tokens x hidden x 4 bytes).
MAX_GRAPHS = 4


def graph_tokens(tokens: int, limit: int) -> int:
    """The token count a one-prompt chunk of ``tokens`` is captured at: rounded up to
    :data:`GRAPH_TOKEN_STEP`, or to ``limit`` (the cache or the chunk) where that would pass
    it, so that the lengths near the limit share one graph too."""
    padded = -(-tokens // GRAPH_TOKEN_STEP) * GRAPH_TOKEN_STEP
    return min(padded, max(limit, tokens))


def piece_shapes(chunk: int, max_seq: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, tokens) of one piece of each graph that prompts of up to two pieces of at most
    ``chunk`` tokens replay (keyed by its start and the length :func:`graph_tokens` pads it
    to): each padded length at starts 0 and ``chunk``, within ``max_seq`` positions and a
    prefill chunk of ``chunk_tokens``, at most :data:`MAX_GRAPHS` of them (the first pieces'
    first). A longer prompt's later pieces run eagerly."""
    shapes: dict[tuple[int, int], tuple[int, int]] = {}  # (start, padded) -> a piece of that key
    for start in (0, chunk):
        limit = min(max_seq - start, chunk_tokens)
        for n in range(GRAPH_TOKEN_STEP, chunk + GRAPH_TOKEN_STEP, GRAPH_TOKEN_STEP):
            n = min(n, chunk, limit)
            if n > 0:
                shapes.setdefault((start, graph_tokens(n, limit)), (start, n))
    return list(shapes.values())[:MAX_GRAPHS]


class ChunkGraph:
    """A prompt chunk's layers captured as CUDA graphs, cut at its sums over the ranks (one
    graph on one GPU). A NCCL collective stays out of the graphs: captured inside one, it
    leaves ``destroy_process_group`` hanging for as long as the graph lives
    (pytorch/pytorch#115388). :meth:`replay` runs the pieces in order and each sum between
    two, eagerly, in place on a staging buffer: a piece ends by copying its partial there,
    the next begins by copying the sum out. (The partials themselves are not kept: each
    would hold its memory in the graphs' pool for as long as the graphs live, 2 x layers of
    them; one staging buffer a shape is kept instead.)"""

    def __init__(self, device: torch.device, pool, stream: torch.cuda.Stream):
        self.device, self.pool, self.stream = device, pool, stream
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.sums: list[torch.Tensor] = []  # the staging buffer each sum runs on, in order
        self._staging: dict[tuple, torch.Tensor] = {}

    def capture(self, layers):
        """Capture ``layers()`` (the chunk's forward, whose sums over the ranks call
        :meth:`cut` while it runs here) on ``stream`` (one for every capture that shares the
        pool: the allocator reuses a freed block only on the stream it was allocated on);
        returns its result: the output tensor the replays refill."""
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._begin()
            try:
                out = layers()
            except BaseException:
                try:
                    self.graphs[-1].capture_end()
                except RuntimeError:
                    pass  # (the capture is broken already; the first error is the one to report)
                raise
            self.graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def cut(self, partial: torch.Tensor) -> torch.Tensor:
        """During :meth:`capture`: end the piece that computed ``partial`` with a copy of it
        into the staging buffer of its shape, which a replay then sums over the ranks; the
        next piece starts here, with a copy of the sum (returned)."""
        key = (tuple(partial.shape), partial.dtype)
        staging = self._staging.get(key)
        if staging is None:
            staging = self._staging[key] = torch.empty_like(partial, memory_format=torch.contiguous_format)
        staging.copy_(partial)
        self.graphs[-1].capture_end()
        self.sums.append(staging)
        self._begin()
        return staging.clone()

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers the graphs keep (none on one GPU)."""
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    def replay(self, all_reduce) -> None:
        """Every piece in order, ``all_reduce(staging)`` (in place) after each that ends in a
        sum."""
        with torch.cuda.device(self.device):
            for i, graph in enumerate(self.graphs):
                graph.replay()
                if i < len(self.sums):
                    all_reduce(self.sums[i])


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segments: list[Segment],
              precision: str, window: int | None = None) -> torch.Tensor:
    """Causal grouped-query attention of a chunk's queries over the cache.

    ``q``: the chunk's rotated queries ``[n, Hq, D]``; ``k_cache, v_cache``: one layer's
    cache ``[B, Hkv, S, D]`` holding every segment's keys up to its ``stop``. Each segment
    attends to its prompt's tokens ``[0, stop)``, causally. Returns ``[n, Hq * D]`` in q's
    dtype (float32 for a float32 q). ``window``: a sliding window (Mistral): the token at
    position t attends the tokens ``t - window < j <= t`` only (Hugging Face's rule).

    On a GPU in the fast precision with a cache of q's dtype: PyTorch's SDPA (its flash /
    cuDNN kernels; under a window, with an explicit mask a segment); else mk's
    :func:`~mk.tasks.prefill_attention.prefill_attention`.
    """
    n, hq, d = q.shape
    sdpa = precision == "fast" and q.is_cuda and q.dtype == k_cache.dtype and q.dtype != torch.float32
    # Several whole prompts (the usual ragged batch) in one varlen launch; its packed keys are
    # then the chunk's own (a segment past a prompt's start would gather its whole prefix).
    # A window goes the per-segment way: its mask is explicit there, so it is checked on
    # the CPU too, where varlen flash attention does not run.
    if (sdpa and window is None and len(segments) > 1 and all(s.start == 0 for s in segments)
            and _varlen_attn() is not None):
        return _varlen_attention(q, k_cache, v_cache, segments).reshape(n, hq * d)
    outs = []
    for s in segments:
        qs = q[s.offset:s.offset + s.tokens]
        if sdpa and window is not None:
            outs.append(_windowed_sdpa(qs, k_cache, v_cache, s, window))
            continue
        k, v = k_cache[s.row:s.row + 1, :, :s.stop], v_cache[s.row:s.row + 1, :, :s.stop]
        if sdpa:
            qt = qs[None].transpose(1, 2)  # [1, Hq, n, D]
            if s.start == 0:  # the square case: top-left and bottom-right causal agree
                o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, enable_gqa=True)
            else:
                from torch.nn.attention.bias import causal_lower_right

                o = F.scaled_dot_product_attention(qt, k, v, attn_mask=causal_lower_right(s.tokens, s.stop),
                                                   enable_gqa=True)
            outs.append(o[0].transpose(0, 1))  # [n, Hq, D]
        else:
            qf = qs if q.dtype == k_cache.dtype or q.dtype == torch.float32 else qs.float()
            o = prefill_attention(qf[None], k.transpose(1, 2), v.transpose(1, 2), check_values=False,
                                  q_start=s.start, window=window)
            outs.append(o[0].to(q.dtype))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(n, hq * d)


def window_mask(start: int, stop: int, key_start: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[stop - start, stop - key_start]`` mask (True: attend) of the tokens
    ``[start, stop)`` over the keys ``[key_start, stop)`` under a sliding window: token t
    sees key j when ``t - window < j <= t``."""
    t = torch.arange(start, stop, device=device)[:, None]
    j = torch.arange(key_start, stop, device=device)[None, :]
    return (j <= t) & (j > t - window)


def _windowed_sdpa(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: Segment,
                   window: int) -> torch.Tensor:
    """One segment's SDPA under a sliding window: only the keys some token of the segment
    sees (from ``start - window + 1``) are passed, with an explicit mask. ``[tokens, Hq, D]``."""
    lo = max(s.start - window + 1, 0)
    k, v = k_cache[s.row:s.row + 1, :, lo:s.stop], v_cache[s.row:s.row + 1, :, lo:s.stop]
    mask = window_mask(s.start, s.stop, lo, window, qs.device)
    o = F.scaled_dot_product_attention(qs[None].transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def _varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      segments: list[Segment]) -> torch.Tensor:
    """Several segments in one flash-attention launch (PyTorch's varlen kernel): each
    segment's keys are gathered from the cache into one packed ``[sum stop, Hkv, D]``;
    causal masking is aligned to each segment's end, as the cache holds its earlier tokens.
    One launch instead of a launch a segment: a ragged batch of short prompts is otherwise
    bound by the host's time per launch."""
    varlen_attn, gqa_flag = _varlen_attn()
    k = torch.cat([k_cache[s.row, :, :s.stop].transpose(0, 1) for s in segments])
    v = torch.cat([v_cache[s.row, :, :s.stop].transpose(0, 1) for s in segments])
    cu_q = torch.tensor([0] + [s.offset + s.tokens for s in segments], dtype=torch.int32)
    cu_k = torch.tensor([0] + [s.stop for s in segments], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    # Grouped heads: flash attention takes fewer K/V heads as they are; PyTorch releases
    # that have the flag want it said.
    extra = {"enable_gqa": q.shape[1] != k.shape[1]} if gqa_flag else {}
    return varlen_attn(q, k, v, cu_q.to(q.device, non_blocking=True), cu_k.to(q.device, non_blocking=True),
                       max(s.tokens for s in segments), max(s.stop for s in segments), window_size=(-1, 0), **extra)


_VARLEN: list = []


def _varlen_attn():
    """PyTorch's varlen flash attention and whether it takes ``enable_gqa``; None before
    PyTorch 2.10 (prefill then runs one SDPA call a prompt)."""
    if not _VARLEN:
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn
            _VARLEN.append((varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters))
        except (ImportError, AttributeError):
            _VARLEN.append(None)
    return _VARLEN[0]


def per_token_bytes(hidden: int, q_width: int, qkv_width: int, intermediate: int, act_bytes: int,
                    fast: bool) -> int:
    """Activation bytes live at once per token of a chunk, at the fullest point of a layer
    (the residual stream is float32; ``act_bytes`` is the matmul operands' size).

    Fast: the normalised input, QKV, the rotated q, attention's output (its segments and
    their concatenation, or the varlen launch's packed K/V), the projections' outputs,
    gate/up and SiLU·mul's output, each in ``act_bytes``; two residuals while the fused
    add + RMSNorm writes the new one.
    Exact: float32 throughout, with the norms and SiLU·mul fused into the linear tiles.
    """
    x, a = 4 * hidden, act_bytes
    if fast:
        kv_width = (qkv_width - q_width) // 2
        stages = (x + a * (hidden + qkv_width),            # QKV projection
                  x + a * (qkv_width + q_width),           # RoPE + KV append
                  x + a * (q_width + 2 * q_width + 2 * kv_width),  # attention (+ its packed K/V)
                  x + a * (q_width + hidden),              # O projection
                  2 * x + a * (2 * hidden),                # add + RMSNorm
                  x + a * (hidden + 2 * intermediate),     # gate/up projection
                  x + a * (3 * intermediate),              # SiLU·mul
                  x + a * (intermediate + hidden))         # down projection
    else:
        stages = (x + 4 * qkv_width, x + 4 * (qkv_width + q_width), x + 4 * 3 * q_width,
                  2 * x + 4 * q_width, x + 4 * intermediate, 2 * x + 4 * intermediate)
    return max(stages) + math.ceil(x / 8)  # + the small per-chunk index and gather tensors
