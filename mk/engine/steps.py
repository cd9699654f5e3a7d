"""The decode steps of a model: one lowered, compiled megakernel per batch size and way of
choosing the next token (:class:`Steps`), over state that every step shares (:class:`Slots`):
the rows of a batch are slots a sequence holds from its prefill to its last token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mk.models.blocks import TP_PEERS, cache_keys
from mk.planner.steps import StepCache

#: measure mode: decode steps per timed burst, and bursts (after one warm-up) per plan.
MEASURE_BURST, MEASURE_REPS = 20, 3


class Slots:
    """The decode state of ``rows`` sequences, which every step's first ``batch`` rows are:
    ``ids`` (each row's last token), ``pos`` (its position), ``tokens`` (its history, prompt
    included, ``[rows, max_seq_len]``), and the sampling draw's ``temperature`` and ``seed``."""

    def __init__(self, model, rows: int):
        self.model = model
        i32 = dict(dtype=torch.int32, device=model.device)
        self.state = {"ids": torch.zeros(rows, **i32), "pos": torch.zeros(rows, **i32),
                      "tokens": torch.zeros(rows, model.max_seq_len, **i32),
                      "temperature": torch.ones(1, dtype=torch.float32, device=model.device),
                      "seed": torch.zeros(1, dtype=torch.int64, device=model.device)}

    def view(self, batch: int) -> dict[str, torch.Tensor]:
        """The state of rows ``[0, batch)`` (views: what a step writes, the slots hold)."""
        return {k: (t[:batch] if k in ("ids", "pos", "tokens") else t) for k, t in self.state.items()}

    def start(self, row: int, ids: torch.Tensor, lengths: list[int], first: torch.Tensor) -> None:
        """Rows ``row``, ``row + 1``, ... begin sequences: their prompts (``ids``
        ``[k, T]`` right-padded, on the device; ``lengths``) and the tokens chosen after
        them (``first`` ``[k]``), at positions ``lengths``."""
        st, k = self.state, ids.shape[0]
        rows = slice(row, row + k)
        pos = torch.tensor(lengths, dtype=torch.int32, device=ids.device)
        st["tokens"][rows].zero_()
        st["tokens"][rows, :ids.shape[1]] = ids
        st["tokens"][torch.arange(row, row + k, device=ids.device), pos.long()] = first
        st["ids"][rows] = first
        st["pos"][rows] = pos

    def move(self, src: int, dst: int, length: int) -> None:
        """Row ``src``'s sequence (``length`` positions of cache) into row ``dst``: its state
        and its KV cache rows in every layer (``src`` is left as it was)."""
        m, st = self.model, self.state
        for k in ("ids", "pos", "tokens"):
            st[k][dst] = st[k][src]
        m.k_cache[:, dst, :, :length] = m.k_cache[:, src, :, :length]
        m.v_cache[:, dst, :, :length] = m.v_cache[:, src, :, :length]


@dataclass
class Decoder:
    """One batch size's lowered decode step, its megakernel and its state buffers."""

    step: object  # mk.planner.lower.DecodeStep
    kernel: object  # mk.persistent.runtime.Megakernel
    state: dict
    #: Pinned host buffers the history is read back into (CUDA only; see mk.engine.stream.HistoryReader).
    host: list = field(default_factory=list)
    #: Seconds its build took (plan_s, lower_s, compile_s), until a request reports them.
    build: dict = field(default_factory=dict)
    #: The buffers it shares with the other ranks (tensor parallelism; :meth:`Steps.tp_buffers`).
    shared: dict = field(default_factory=dict)

    def unreported_build(self) -> dict:
        """The build's seconds the first time a request asks, zeros after."""
        keys = ("plan_s", "lower_s", "compile_s") + (("share_s",) if "share_s" in self.build else ())
        out = {k: self.build.get(k, 0.0) for k in keys}
        self.build = {k: 0.0 for k in keys if k != "plan_s"}
        return out


class Steps:
    """A model's decode steps: the one built (:meth:`get`) per batch size, way of choosing the
    next token and planned length, over the model's :attr:`slots`; the lowered steps they
    were bound from (:attr:`lowered`: host memory only, so a step dropped here and asked
    for again is bound to new tensors, not lowered again)."""

    def __init__(self, model):
        self.model = model
        self.slots = Slots(model, model.max_batch_size)
        self.built: dict[tuple[int, str, int], Decoder] = {}
        self.lowered = StepCache()

    def get(self, batch: int, next_token: str, kv_len: int | None = None, progress: bool = False) -> Decoder:
        """The lowered, compiled step for ``batch`` ending in ``next_token`` (see
        :func:`mk.planner.lower.lower_decode_step`), planned for ``kv_len`` (default
        ``max_seq_len``), built once."""
        m = self.model
        key = (batch, next_token, m.max_seq_len if kv_len is None else kv_len)
        if key not in self.built:
            # One step per batch and way of choosing the next token is kept: steps planned
            # for other lengths go (each holds its own activations and queues, and generation
            # stays within weights + KV cache + 64 MiB); a length planned again is bound to new
            # tensors from the lowered steps (lowered), the plan and kernel caches: nothing is
            # lowered again.
            self.drop([k for k in self.built if k[:2] == key[:2]])
            t0 = time.perf_counter()
            plan, graph = m.plan(batch, key[2], progress=progress)
            plan_s = time.perf_counter() - t0
            dec = self.built[key] = self.build_agreed(plan, graph, batch, next_token)
            dec.build["plan_s"] = plan_s
        return self.built[key]

    def drop(self, keys: list) -> None:
        """Forget the steps of ``keys``. Under tensor parallelism their symmetric workspaces
        go with them, once every rank is past their launches: every rank drops the same steps
        at the same call, as it builds the same ones."""
        m = self.model
        dropped = [self.built.pop(k) for k in keys]
        if dropped and m.tp > 1 and m.device.type == "cuda":
            import torch.distributed as dist

            torch.cuda.synchronize(m.device)
            dist.barrier()
        del dropped  # (the workspaces go here, after every rank's barrier)

    def build(self, plan, graph, batch: int, next_token: str, own_state: bool = True) -> Decoder:
        """Lower ``plan`` to a megakernel over this model's weights and cache. Its state is the
        first ``batch`` rows of the model's :attr:`slots` (every step shares them: a slot's
        sequence moves from one batch size's step to another's with nothing copied), or with
        ``own_state=False`` rows of its own (a step built only to be timed, which must not
        touch live slots). The lowered step (tasks, dependencies, queues, descriptors) comes
        from :attr:`lowered` when this plan, batch and length were lowered before."""
        m = self.model
        from mk.persistent.runtime import Megakernel

        t0 = time.perf_counter()
        # First the collective part (every rank, before anything that may fail on one rank
        # alone: see build_agreed).
        shared = self.tp_buffers(graph)
        share_s = time.perf_counter() - t0
        state = self.slots.view(batch) if own_state else Slots(m, batch).view(batch)
        bufs = dict(m.weights, **state)
        for L in range(m.config.num_hidden_layers):
            kn, vn = cache_keys(L)
            bufs[kn], bufs[vn] = m.k_cache[L, :batch], m.v_cache[L, :batch]
        bufs.update(shared)

        def compile_for(workers):  # the queues of the plan's schedule, as the planner simulated them
            lowered = self.lowered.get(plan, graph, bufs, eps=m.config.rms_norm_eps, next_token=next_token,
                                      device=m.device_spec, workers=workers, rank=m.rank)
            step, program = lowered.bind(bufs, m.device)
            return step, Megakernel(program)

        step, kernel = compile_for(1 if m.device.type != "cuda" else plan.workers)
        t1 = time.perf_counter()
        if m.device.type == "cuda" and kernel.residency().max_workers < plan.workers:  # (compiles)
            step, kernel = compile_for(kernel.residency().max_workers)
            kernel.residency()
        t2 = time.perf_counter()
        build = dict(lower_s=t1 - t0 - share_s, compile_s=t2 - t1) | ({"share_s": share_s} if m.tp > 1 else {})
        return Decoder(step, kernel, state, build=build, shared=shared)

    def build_agreed(self, plan, graph, batch: int, next_token: str, own_state: bool = True) -> Decoder:
        """:meth:`build` on every rank, which then check together that each built
        it, and built the same schedule (a collective under tensor parallelism: every rank
        reaches it, its own build failed or not). The ranks' projection tiles wait on one
        another's words, so their queues must hold those tiles in one order, or two workers
        can each wait on a tile queued behind the other's (a mixed pair of GPUs, with other
        SM counts, would deal other queues); such ranks are refused, naming them, before any
        launch."""
        m = self.model
        import torch.distributed as dist

        if not m.ranks.joined:
            return self.build(plan, graph, batch, next_token, own_state)
        dec, failed = None, None
        try:
            dec = self.build(plan, graph, batch, next_token, own_state)
        except Exception as e:
            failed = e
        mine = None if failed else (dec.kernel.program.schedule_digest(skip_args=("rank",)),
                                    dec.kernel.program.num_workers)
        everyone = [None] * m.tp
        dist.all_gather_object(everyone, mine)
        if failed is not None:
            raise failed
        if None in everyone:
            failed_on = [r for r, m in enumerate(everyone) if m is None]
            raise RuntimeError(f"building the decode step failed on rank(s) {failed_on}; their errors name the cause")
        odd = [r for r, m in enumerate(everyone) if m[0] != everyone[0][0]]
        if odd:
            raise RuntimeError(f"rank(s) {odd} built another schedule of the decode step than rank 0 (workers by "
                               f"rank: {[m[1] for m in everyone]}): the ranks of a tensor-parallel model must run "
                               f"one schedule; use GPUs of one kind, with one calibration")
        return dec

    def tp_buffers(self, graph) -> dict[str, torch.Tensor]:
        """The buffers a tensor-parallel step of ``graph`` shares with the other ranks
        (partial sums, the two buffers every rank pushes its partials' words into, the next
        token's candidates and their flags, and ``tp.peers``: every rank's workspace base),
        zeroed: on CUDA cut from one symmetric-memory workspace
        (:func:`mk.persistent.symmetric.symmetric_workspace`, a collective call: every rank
        makes it together); on the CPU plain tensors, for the VM's simulated ranks
        (:func:`mk.persistent.vm.run_vm_ranks`). Empty for one rank."""
        m = self.model
        from mk.planner.lower import meta_buffers

        if m.tp == 1:
            return {}
        meta = {n: t for n, t in meta_buffers(graph, m.max_seq_len).items() if n.startswith("tp.")}
        if m.device.type == "cuda":
            from mk.persistent.symmetric import symmetric_workspace

            return symmetric_workspace(meta, m.device, peers=TP_PEERS)
        return {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in meta.items()}

    def time_plan(self, plan, graph, batch: int) -> float:
        """Seconds one greedy decode step of ``plan`` takes here (median of a few bursts).

        The timing steps run at the end of the planned length (the graph's ``kv_len``: their
        positions start at ``kv_len - 1 - burst``) and write only cache rows there, which a
        request reaches only later and then overwrites before reading: plans are measured
        before the prompt is prefilled.
        Resetting the positions is one tiny copy per burst, timed with it.

        Under tensor parallelism every rank times the plan at once (their steps meet), and
        each returns the slowest rank's time; where timing failed on any rank, every rank
        raises.
        """
        m = self.model
        import torch.distributed as dist

        if m.tp == 1:  # (over several ranks, plan() has made sure torch.distributed is set up)
            return self.time_decoder(self.build(plan, graph, batch, "argmax", False), graph)
        # Each rank compiles the plan on its own, for as long as that takes: a step launched
        # before its peers could join it would wait past the watchdog's bound.
        dec = self.build_agreed(plan, graph, batch, "argmax", False)
        failed = None
        try:
            seconds = self.time_decoder(dec, graph)
        except Exception as e:
            seconds, failed = 0.0, e
        both = torch.tensor([seconds, float(failed is not None)], dtype=torch.float64, device=m.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if failed is not None:
            raise failed
        if both[1].item():
            raise RuntimeError("plan_mode='measure': timing a plan failed on another rank; its error names the cause")
        return both[0].item()

    def time_decoder(self, dec: "Decoder", graph) -> float:
        """:meth:`time_plan`'s timing of one built step on this rank."""
        m = self.model
        top = graph.kv_len  # (plan() keeps it within max_seq_len)
        if m.device.type != "cuda":  # the interpreter: one step is slow enough to time
            dec.state["pos"].fill_(max(top - 2, 0))
            t0 = time.perf_counter()
            dec.kernel.launch()
            seconds = time.perf_counter() - t0
            dec.kernel.check()
            return seconds
        from mk.timing import event_time_us

        burst = max(1, min(MEASURE_BURST, top - 1))
        start = max(top - 1 - burst, 0)

        def steps():
            dec.state["pos"].fill_(start)
            for _ in range(burst):
                dec.kernel.launch()

        seconds = event_time_us(steps, reps=MEASURE_REPS, warmup=1) * 1e-6 / burst
        dec.kernel.check()
        return seconds

    # ------------------------------------------------------------------ prefill

