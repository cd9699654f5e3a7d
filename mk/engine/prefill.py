"""Prefill: prompts through every layer into the KV cache, packed without padding, a chunk
at a time (:mod:`mk.models.prefill`: precision modes, the workspace bound, chunk graphs).

A :class:`Prefiller` runs a model's prompts: whole batches for ``generate`` (:meth:`run`),
or one prompt's piece into a given cache row (:meth:`piece`), as a scheduler that admits a
request between decode blocks does.
"""

from __future__ import annotations

import warnings

import torch

from mk.models import prefill as _prefill
from mk.models.blocks import weight_key
from mk.tasks.embedding import embedding
from mk.tasks.linear import linear, tma_gemm_serves
from mk.tasks.rmsnorm import rmsnorm
from mk.tasks.rope import rope_kv
from mk.tasks.silu_mul import silu_mul

from .matmul import mm as _mm


class Prefiller:
    """A model's prefill (``model``: a :class:`~mk.models.decoder.DecoderModel`, whose
    weights, cache and ranks it reads): its precision, its workspace, and the CUDA graphs of
    the chunks it captured."""

    def __init__(self, model, precision: str, workspace: int):
        self.model = model
        # Captured one-prompt prefill chunks by (cache row, start, tokens): (graph, ids, output).
        self.graphs: dict[tuple[int, int, int], tuple] = {}
        self.graph_pool, self.graphs_failed = None, False
        self.capturing: _prefill.ChunkGraph | None = None  # the chunk whose graphs are being captured
        self.capture_stream = None  # every capture's (they share one pool)
        self._precision = _prefill.check_precision(precision)
        self.workspace = workspace

    @property
    def precision(self) -> str:
        """``"fast"`` or ``"exact"``: see :mod:`mk.models.prefill`."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        old, self._precision = self._precision, _prefill.check_precision(value)
        try:
            self.budget  # a token of the other precision may not fit the workspace
        except ValueError:
            self._precision = old
            raise
        self.graphs = {}

    @property
    def workspace(self) -> int:
        """Bytes of activations a prefill chunk may hold (chunks are cut to fit)."""
        return self._workspace

    @workspace.setter
    def workspace(self, value: int) -> None:
        self.budget_for(value)  # refuses a workspace that holds no token
        self._workspace = value
        self.graphs = {}

    @property
    def budget(self) -> _prefill.PrefillBudget:
        """Bytes a prefill token holds, the workspace, and the chunk length they give."""
        return self.budget_for(self._workspace)

    def budget_for(self, workspace: int) -> _prefill.PrefillBudget:
        return _prefill.PrefillBudget.make(per_token(self.model.config, self.model.dtype, self._precision), workspace)

    def graph_bytes(self) -> int:
        """Bytes the captured chunks' outputs (and staging buffers) keep."""
        return sum(out.numel() * out.element_size() + chunk.staging_bytes for chunk, _, out in self.graphs.values())

    def piece(self, row: int, ids: torch.Tensor, start: int, all_logits: bool = False) -> torch.Tensor:
        """Tokens ``ids`` (``[n]``, on the model's device) of one prompt at positions
        ``[start, start + n)``, into cache row ``row`` (its positions before ``start`` are
        there already); float32 logits of the last token ``[V]``, or of every token
        ``[n, V]``. ``n`` must fit one chunk (:attr:`budget`). A piece that continues a
        prompt runs as CUDA graphs too, captured for its row, start and length (a server's
        pieces come in a few starts and lengths, and an eager piece is bound by the host)."""
        n = ids.numel()
        self.budget.check_fits(self.model.device, n, n * self.model.config.vocab_size * 4 if all_logits else 0)
        x = self.chunk(ids, [_prefill.Segment(row, start, start + n, 0)], continued=True)
        return self.lm_head(x) if all_logits else self.lm_head(x[n - 1:n])[0]

    def piece_shapes(self, chunk: int) -> list[tuple[int, int]]:
        """(start, tokens) of one piece of each shape a server cutting prompts into pieces of
        at most ``chunk`` tokens replays as a CUDA graph (:func:`mk.models.prefill.piece_shapes`:
        prompts of up to two pieces); none off a GPU or in the exact precision, which run
        eagerly."""
        m = self.model
        if m.device.type != "cuda" or self.precision != "fast":
            return []
        return _prefill.piece_shapes(chunk, m.max_seq_len, self.budget.chunk_tokens)

    def warm_piece(self, row: int, start: int, tokens: int) -> None:
        """Capture now the graph of a piece of ``tokens`` at ``start`` (a shape of
        :meth:`piece_shapes`) into cache row ``row``, so that the first request of its shape
        replays rather than paying an eager run and the capture. Graphs of other rows are
        dropped first (a server prefills into this row only: they would hold the cache's
        room). It writes row ``row``'s cache, which must be free (a prompt's prefill writes
        each position of its row before decode reads it)."""
        self.graphs = {k: v for k, v in self.graphs.items() if k[0] == row}
        self.piece(row, torch.zeros(tokens, dtype=torch.int32, device=self.model.device), start)

    def run(self, ids: torch.Tensor, lengths: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run the prompts (``ids`` right-padded ``[B, T]``, ``lengths``) through every layer,
        filling the cache, packed a chunk at a time; float32 logits of each prompt's last
        token ``[B, V]`` (or of every token ``[B, T, V]``, zeros past a prompt's end)."""
        m = self.model
        B, T = ids.shape
        V = m.config.vocab_size
        budget = self.budget
        budget.check_fits(m.device, sum(lengths), B * T * V * 4 if all_logits else 0)
        if all_logits:
            logits = torch.zeros(B, T, V, dtype=torch.float32, device=m.device)
            # LM-head rows at a time within the workspace: its float32 logits too.
            head_rows = max(1, budget.bound // (4 * V + 4 * m.config.hidden_size))
        else:
            last = torch.empty(B, m.config.hidden_size, dtype=torch.float32, device=m.device)
        for segments in _prefill.pack(lengths, budget.chunk_tokens):
            x = self.chunk(torch.cat([ids[s.row, s.start:s.stop] for s in segments]), segments)
            for s in segments:
                if all_logits:
                    for r in range(0, s.tokens, head_rows):
                        n = min(head_rows, s.tokens - r)
                        logits[s.row, s.start + r:s.start + r + n] = self.lm_head(x[s.offset + r:s.offset + r + n])
                elif s.stop == lengths[s.row]:  # the chunk that holds the prompt's last token
                    last[s.row] = x[s.offset + s.tokens - 1]
        return logits if all_logits else self.lm_head(last)

    def chunk(self, ids: torch.Tensor, segments: list, continued: bool = False) -> torch.Tensor:
        """:meth:`layers` of one chunk; a chunk that is one whole prompt (the usual request;
        with ``continued``, any one prompt's piece) runs as CUDA graphs captured for its row,
        start and length (one graph, or under tensor
        parallelism one between each two sums over the ranks: :class:`~mk.models.prefill.ChunkGraph`), rounded up to
        :data:`~mk.models.prefill.GRAPH_TOKEN_STEP` tokens: launched one kernel at a time,
        a small model's prefill is bound by the host's time per launch, not by the GPU
        (1B, 2048 tokens: ~150 launches, 8-14 ms of host time for 7.6 ms of kernels).
        A replayed chunk's result is a view of the graphs' shared output memory: valid until
        the next chunk runs (the caller reads it at once)."""
        m = self.model
        seg = segments[0]
        if (m.device.type != "cuda" or self.precision != "fast" or len(segments) != 1
                or (seg.start != 0 and not continued) or self.graphs_failed
                or torch.cuda.is_current_stream_capturing()):
            return self.layers(ids, segments)
        n = seg.tokens
        padded = _prefill.graph_tokens(n, min(m.max_seq_len - seg.start, self.budget.chunk_tokens))
        key = (seg.row, seg.start, padded)
        entry = self.graphs.pop(key, None)
        if entry is None and seg.start and len(self.graphs) >= _prefill.MAX_GRAPHS:
            # A piece that continues a prompt is captured only into room the cache has: a
            # prompt of more pieces than it holds would otherwise evict its own pieces in
            # turn, and pay an eager run and a capture for each, every time.
            return self.layers(ids, segments)
        if entry is None:
            # Run once eagerly (cuBLAS and cuDNN set themselves up outside a capture; this
            # call's result), then capture the same chunk for the next request of its length.
            static_ids = torch.zeros(padded, dtype=ids.dtype, device=m.device)
            static_ids[:n] = ids
            whole = [_prefill.Segment(seg.row, seg.start, seg.start + padded, 0)]
            x = self.layers(static_ids, whole)
            if not self.graphs:  # a pool no live graph uses cannot take a capture again
                with torch.cuda.device(m.device):
                    self.graph_pool = torch.cuda.graph_pool_handle()
            if self.capture_stream is None:
                self.capture_stream = torch.cuda.Stream(m.device)
            chunk = _prefill.ChunkGraph(m.device, self.graph_pool, self.capture_stream)
            self.capturing, failed = chunk, None
            try:
                out = chunk.capture(lambda: self.layers(static_ids, whole))
            except Exception as e:  # the chunk still ran eagerly: keep its result, capture no more
                failed = f"{type(e).__name__}: {e}"  # (any error: every rank must reach the agreement below)
            finally:
                self.capturing = None
            if m.tp > 1 and not m.ranks.all(failed is None):
                failed = failed or "another rank's capture failed"  # (all replay or none: their sums pair up)
            if failed is not None:
                warnings.warn(f"mk: prefill chunks run eagerly from now on; capturing one as a CUDA graph "
                              f"failed: {failed}", RuntimeWarning, stacklevel=2)
                self.graphs_failed = True
                return x[:n]
            self.graphs[key] = (chunk, static_ids, out)
            while len(self.graphs) > _prefill.MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            return x[:n]
        chunk, static_ids, out = entry
        static_ids[:n] = ids
        static_ids[n:] = 0
        try:
            chunk.replay(m.ranks.sum)
        except RuntimeError as e:
            if m.tp > 1:
                # Its peers may wait in a sum of the replay this rank left: any later collective
                # of this rank would pair with theirs, silently wrong.
                m.ranks.out_of_step = f"replaying a captured prefill chunk failed on rank {m.rank}: {e}"
                raise
            warnings.warn(f"mk: prefill chunks run eagerly from now on; replaying a captured one failed: {e}",
                          RuntimeWarning, stacklevel=2)
            self.graphs_failed, self.graphs = True, {}
            return self.layers(ids, segments)
        self.graphs[key] = entry  # most recently used last
        return out[:n]

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of float32 final residuals ``[n, H]`` (all of the vocabulary: under
        tensor parallelism every rank's share, gathered)."""
        m = self.model
        w, eps = m.weights, m.config.rms_norm_eps
        head, scale = w[weight_key("lm_head")], w.get(weight_key("lm_head", "scale"))
        if self.precision == "fast":
            logits = _mm(rmsnorm(x, w[weight_key("final_norm")], eps, out_dtype=m.dtype), head, torch.float32,
                         scale)
        else:
            logits = linear(rmsnorm(x, w[weight_key("final_norm")], eps), head, weight_scale=scale).float()
        if m.tp == 1:
            return logits
        import torch.distributed as dist

        shares = [torch.empty_like(logits) for _ in range(m.tp)]
        dist.all_gather(shares, logits.contiguous())
        return torch.cat(shares, dim=-1)

    def tp_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Prefill under tensor parallelism: every rank's partial sum of a split projection
        added up in place (NCCL); itself for one rank. While a chunk is being captured, the
        sum ends a piece of its graphs instead, and runs between two pieces at each replay."""
        m = self.model
        if m.tp == 1:
            return partial
        if self.capturing is not None:
            return self.capturing.cut(partial)
        return m.ranks.sum(partial)

    def layers(self, ids: torch.Tensor, segments: list) -> torch.Tensor:
        """One chunk's tokens (``ids`` ``[n]``, the :class:`~mk.models.prefill.Segment` s of
        their prompts) through every layer, their K/V appended to the cache (each prompt's
        earlier tokens are there already); the final residual, float32 ``[n, H]``."""
        m = self.model
        c, w = m.config, m.weights

        def W(name):
            return w[weight_key(name)]

        def S(name):  # a projection's scales (its format's), or None
            return w.get(weight_key(name, "scale"))

        n = ids.numel()
        hq, hkv, d = m.shape.heads, m.shape.kv_heads, c.head_dim  # (this rank's heads)
        eps, f32, fast = c.rms_norm_eps, torch.float32, self.precision == "fast"
        part = f32 if m.tp > 1 else None  # partial sums over ranks are added in float32
        positions, rows = _prefill.chunk_indices(segments, m.device)
        # The residual stream is float32 in both precisions; ids were checked with the prompts.
        # (Under tensor parallelism this rank's vocabulary share: its tokens' rows, zeros for
        # the others', summed over the ranks.)
        share = dict(vocab_start=m.rank * W("embed").shape[0]) if m.tp > 1 else {}
        x = self.tp_sum(embedding(ids, W("embed"), check_values=False, **share).float())
        delta = None  # fast: the last projection's output, added into x by the next norm
        for L in range(c.num_hidden_layers):
            kc, vc = m.k_cache[L], m.v_cache[L]
            l = f"l{L}."
            bias = W(l + "qkv.bias") if c.QKV_BIAS else None
            if fast:
                h, x = self.add_norm(x, delta, W(l + "attn_norm"))
                delta = None  # added in: its memory goes back before the next projection
                qkv = (_mm(h, W(l + "qkv"), None, S(l + "qkv")) if bias is None else
                       torch.addmm(bias, h, W(l + "qkv").t()) if S(l + "qkv") is None else
                       _mm(h, W(l + "qkv"), None, S(l + "qkv")) + bias)
                del h
            else:
                qkv = linear(x, W(l + "qkv"), norm_weight=W(l + "attn_norm"), norm_eps=eps, bias=bias, out_dtype=f32,
                             weight_scale=S(l + "qkv"))
            q, k, v = qkv.view(1, n, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=2)
            norms = (dict(q_norm_weight=W(l + "q_norm"), k_norm_weight=W(l + "k_norm"), norm_eps=eps)
                     if c.QK_NORM else {})
            # Positions and rows were built here from checked lengths: no checks, no read-back.
            q = rope_kv(q, k, v, positions, w["inv_freq"], kc, vc, interleaved=True, cache_rows=rows, validate=False,
                        **norms)
            del qkv, k, v
            attn = _prefill.attention(q[0], kc, vc, segments, self.precision, window=c.window)
            del q
            if fast:
                delta = self.tp_sum(_mm(attn, W(l + "o_proj"), part, S(l + "o_proj")))
                del attn
                h, x = self.add_norm(x, delta, W(l + "mlp_norm"))
                delta = None
                if S(l + "gate_up") is None and tma_gemm_serves(h, W(l + "gate_up"), silu_mul=True):
                    # mk's TMA GEMM with SiLU·mul in its epilogue: the [n, 2I] product is
                    # never stored (1B / 8B, 2048-8192 tokens: 4-15% under cuBLAS + SiLU·mul).
                    act = linear(h, W(l + "gate_up"), silu_mul=True)
                else:
                    gu = _mm(h, W(l + "gate_up"), None, S(l + "gate_up"))  # gate and up rows interleaved
                    act = silu_mul(gu[:, 0::2], gu[:, 1::2], validate=False)
                    del gu
                del h
                delta = self.tp_sum(_mm(act, W(l + "down"), part, S(l + "down")))
                del act
            else:
                o_s, gu_s, d_s = S(l + "o_proj"), S(l + "gate_up"), S(l + "down")
                x = (linear(attn, W(l + "o_proj"), residual=x, out_dtype=f32, weight_scale=o_s) if m.tp == 1 else
                     x + self.tp_sum(linear(attn, W(l + "o_proj"), out_dtype=f32, weight_scale=o_s)))
                del attn
                act = linear(x, W(l + "gate_up"), norm_weight=W(l + "mlp_norm"), norm_eps=eps, silu_mul=True,
                             out_dtype=f32, weight_scale=gu_s)
                x = (linear(act, W(l + "down"), residual=x, out_dtype=f32, weight_scale=d_s) if m.tp == 1 else
                     x + self.tp_sum(linear(act, W(l + "down"), out_dtype=f32, weight_scale=d_s)))
                del act
        if delta is not None:
            x += delta
        return x

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """Fast precision: ``x += delta`` (float32) and RMSNorm of the sum, in the weights'
        dtype, in one pass. Returns (normalised, new x)."""
        m = self.model
        if delta is None:
            return rmsnorm(x, weight, m.config.rms_norm_eps, out_dtype=m.dtype, validate=False), x
        return rmsnorm(delta, weight, m.config.rms_norm_eps, residual=x, out_dtype=m.dtype, validate=False)


def per_token(c, dtype: torch.dtype, precision: str) -> int:
    """Prefill activation bytes a token of a chunk holds (:func:`mk.models.prefill.per_token_bytes`)."""
    q = c.num_attention_heads * c.head_dim
    fast = precision == "fast"
    return _prefill.per_token_bytes(c.hidden_size, q, q + 2 * c.num_key_value_heads * c.head_dim,
                                    c.intermediate_size, dtype.itemsize if fast else 4, fast)
