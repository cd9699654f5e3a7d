"""The megakernel ops of mk's tasks (linear, split-K, silu_mul, rmsnorm) on the CPU.

Random DAGs of those ops, with sizes that are not multiples of the tiles, run through
the megakernel (interpreter, one worker, launched twice) and through the VM (many
workers, random interleavings) must equal the torch references op by op; regions must
be exact tiles, clipped at the edges, so the dependencies the graph derives are exact.
"""

import random

import pytest
import torch

from mk.persistent.graph import SCHEDULES, TaskGraph, lower
from mk.persistent.runtime import Megakernel
from mk.persistent.vm import Deadlock, EarlyRead, run_vm
from mk.tasks import OpSpec, default_device, make_op
from mk.tasks.linear import (
    LinearConfig,
    interleave_gate_up,
    linear_k_splits,
    linear_ref,
    linear_tiles,
    prefetch_lines,
)
from mk.tasks.rmsnorm import rmsnorm_ref
from mk.tasks.silu_mul import silu_mul_ref
from tests.conftest import assert_close
from tests.persistent._helpers import region_coverage

F32 = torch.float32
#: Widths of activations: none is a multiple of every tile, 37 of none.
WIDTHS = (37, 64, 200, 24)
EPS = 1e-5


class RandomDag:
    """Builds a random DAG of ops over fresh [M, width] buffers, and its op-by-op reference.

    Every node reads one or two earlier buffers (so chains and diamonds both occur) and
    writes new ones, filled with NaN so that an element no tile writes is caught.
    """

    def __init__(self, rng: random.Random, M: int):
        self.rng, self.M = rng, M
        self.g = TaskGraph()
        self.dev = default_device()
        self.expected: dict[str, torch.Tensor] = {}
        self.width: dict[str, int] = {}
        self.outputs: list[str] = []
        self.kinds: list[str] = []
        self._n = 0

    def _name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}{self._n}"

    def tensor(self, stem: str, t: torch.Tensor) -> str:
        return self.g.buffer(self._name(stem), t.to(self.dev).contiguous())

    def activation(self, width: int, value: torch.Tensor | None = None) -> str:
        """A new [M, width] activation; an input when ``value`` is given, else an output."""
        if value is None:
            name = self.tensor("a", torch.full((self.M, width), float("nan")))
            self.outputs.append(name)
        else:
            name = self.tensor("in", value)
            self.expected[name] = self.g.buffers[name].float()
        self.width[name] = width
        return name

    def weight(self, n: int, k: int) -> str:
        return self.tensor("w", torch.randn(n, k) / k**0.5)

    def norm_weight(self, k: int) -> str:
        return self.tensor("nw", 1 + 0.1 * torch.randn(k))

    def pick(self, width: int | None = None) -> str | None:
        names = [n for n in self.width if width is None or self.width[n] == width]
        return self.rng.choice(names) if names else None

    def tiles(self) -> dict:
        """Random explicit tiles half the time (else the defaults of linear_config)."""
        kw = {}
        if self.M > 1 and self.rng.random() < 0.5:
            kw["block_m"] = 1  # the GEMV body over several row tiles
        if self.rng.random() < 0.5:
            kw["block_n"] = self.rng.choice([16, 32])
        return kw

    # -- nodes -------------------------------------------------------------------------
    def add_rmsnorm(self):
        src = self.pick()
        n = self.width[src]
        w = self.norm_weight(n)
        res = self.pick(n) if self.rng.random() < 0.5 else None
        out = self.activation(n)
        if res is None:
            op = make_op("rmsnorm", n=n, eps=EPS)
            for r in range(self.M):
                self.g.add(op, x=src, w=w, out=out, row=r)
            self.expected[out] = rmsnorm_ref(self.expected[src], self.g.buffers[w], EPS)
            self.kinds.append("rmsnorm")
        else:
            h = self.activation(n)
            op = make_op("rmsnorm", n=n, eps=EPS, residual=True)
            for r in range(self.M):
                self.g.add(op, x=src, res=res, w=w, out=out, res_out=h, row=r)
            self.expected[out], self.expected[h] = rmsnorm_ref(self.expected[src], self.g.buffers[w], EPS,
                                                               residual=self.expected[res])
            self.kinds.append("rmsnorm+res")

    def add_linear(self, variant: str, split_k: int | None = None):
        """variant: plain, residual, norm or silu_mul; split-K (partial + reduce) at random if not given."""
        src = self.pick()
        K, M = self.width[src], self.M
        res = self.pick() if variant == "residual" else None
        n_out = self.width[res] if res else self.rng.choice(WIDTHS)
        if variant == "silu_mul":
            n_out //= 2 if n_out > 24 else 1  # keep N = 2 * n_out small for the interpreter
            w = self.tensor("wgu", interleave_gate_up(torch.randn(n_out, K) / K**0.5,
                                                      torch.randn(n_out, K) / K**0.5))
            N = 2 * n_out
        else:
            N = n_out
            w = self.weight(N, K)
        norm_w = self.norm_weight(K) if variant == "norm" else None
        out = self.activation(n_out)
        flags = {"residual": res is not None, "silu_mul": variant == "silu_mul"}
        tiles = self.tiles()
        # A task of one tile, or a run of adjacent tiles streamed as one (the last run shorter).
        run = {"tiles_per_task": self.rng.choice([1, 2, 3])}
        operands = dict(x=src, w=w, **({"norm_w": norm_w} if norm_w else {}))
        # linear_config's tl.dot tiles keep block_k >= 16, so K must hold split_k such chunks.
        if split_k is None:
            split_k = self.rng.choice([s for s in (1, 1, 2, 3) if s <= -(-K // 16)])
        if split_k == 1:
            op = make_op("linear", M=M, N=N, K=K, norm=norm_w is not None, eps=EPS, dtype=F32, **flags, **tiles,
                         **run)
            for a in linear_tiles(op):
                self.g.add(op, out=out, **operands, **({"res": res} if res else {}), **a)
        else:
            ws = self.tensor("ws", torch.full((split_k, M, N), float("nan")))
            part = make_op("linear_partial", M=M, N=N, K=K, split_k=split_k, norm=norm_w is not None, eps=EPS,
                           dtype=F32, **tiles, **run)
            red = make_op("linear_reduce", M=M, N=N, K=K, split_k=split_k, dtype=F32, **flags, **tiles)
            for a in linear_tiles(part):
                self.g.add(part, ws=ws, **operands, **a)
            for a in linear_tiles(red):
                self.g.add(red, ws=ws, out=out, **({"res": res} if res else {}), **a)
        b = self.g.buffers
        self.expected[out] = linear_ref(self.expected[src], b[w], residual=self.expected[res] if res else None,
                                        norm_weight=b[norm_w] if norm_w else None, norm_eps=EPS,
                                        silu_mul=variant == "silu_mul")
        self.kinds.append(f"linear/{variant}/split{split_k}/run{run['tiles_per_task']}")

    def add_silu_mul(self):
        gate = self.pick()
        i = self.width[gate]
        up = self.pick(i)  # may be gate itself
        block_i = self.rng.choice([None, 16])  # 16: several column blocks, the last one clipped
        op = make_op("silu_mul", i=i, block_i=block_i)
        out = self.activation(i)
        for r in range(self.M):
            for cb in range(-(-i // op.constexprs["BLOCK_I"])):
                self.g.add(op, gate=gate, up=up, out=out, row=r, col_block=cb)
        self.expected[out] = silu_mul_ref(self.expected[gate], self.expected[up])
        self.kinds.append("silu_mul")

    def build(self, nodes: int) -> "RandomDag":
        k = self.rng.choice(WIDTHS)
        self.activation(k, torch.randn(self.M, k))
        # Every kind of node at least once when there is room, then at random.
        plan = ["linear/plain", "linear/residual", "linear/norm", "linear/silu_mul", "silu_mul", "rmsnorm"]
        self.rng.shuffle(plan)
        plan = (plan + [self.rng.choice(plan) for _ in range(nodes)])[:nodes]
        for kind in plan:
            if kind.startswith("linear/"):
                self.add_linear(kind.split("/")[1])
            elif kind == "silu_mul":
                self.add_silu_mul()
            else:
                self.add_rmsnorm()
        # Both linear forms at least once: full-K tiles and split-K partials + reduce.
        if not any("/split1/" not in k for k in self.kinds if k.startswith("linear")):
            self.add_linear(self.rng.choice(["plain", "residual", "silu_mul"]), split_k=2)
        if not any("/split1/" in k for k in self.kinds if k.startswith("linear")):
            self.add_linear(self.rng.choice(["plain", "residual", "norm", "silu_mul"]), split_k=1)
        return self

    def clear_outputs(self):
        for name in self.outputs:
            self.g.buffers[name].fill_(float("nan"))
        for name, buf in self.g.buffers.items():
            if name.startswith("ws"):
                buf.fill_(float("nan"))

    def check(self, what: str):
        for name, ref in self.expected.items():
            assert_close(self.g.buffers[name], ref, F32, f"{what}: {name} ({self.kinds})")


@pytest.fixture
def rng(_seed):
    # DAG shapes come from the run's seed too: fresh each run, repeatable with MK_TEST_SEED.
    return random.Random(_seed)


# --- the megakernel ----------------------------------------------------------------------


@pytest.mark.parametrize("M", [1, 3])
def test_megakernel_equals_op_by_op_on_random_dags(M, rng):
    dag = RandomDag(rng, M).build(nodes=7)
    kernel = Megakernel(lower(dag.g, num_workers=1))
    for launch in range(2):  # counters are never reset: the second launch must work too
        dag.clear_outputs()
        kernel.run()
        dag.check(f"launch {launch}")
    assert int(kernel.state[0]) == 2
    assert {"linear", "linear_partial", "linear_reduce", "silu_mul", "rmsnorm"} <= {t.op.name for t in dag.g.tasks}


# --- the VM: many workers ----------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2, 7, 64])
def test_vm_random_dags_many_workers(workers, rng):
    dag = RandomDag(rng, rng.choice([1, 2, 3])).build(nodes=8)
    for seed in range(3):
        program = lower(dag.g, num_workers=workers, schedule=SCHEDULES[seed])
        dag.clear_outputs()
        report = run_vm(program, interleave="random", seed=rng.randrange(2**31))
        assert sorted(report.order) == list(range(len(dag.g.tasks)))
        dag.check(f"{workers} workers, {SCHEDULES[seed]}")


def test_vm_reports_a_consumer_that_runs_before_its_producer():
    # Drop one consumer's waits and put it first on its own worker: the VM must refuse
    # the read, naming the task and the producer's region it read (so the regions the
    # linear tiles declare are what the VM checks).
    M, N, K = 1, 37, 24
    g = TaskGraph()
    g.buffer("x", torch.randn(M, K)), g.buffer("w", torch.randn(N, K)), g.buffer("w2", torch.randn(N, N))
    g.buffer("y", torch.full((M, N), float("nan"))), g.buffer("z", torch.full((M, N), float("nan")))
    prod = make_op("linear", M=M, N=N, K=K, block_n=16, dtype=F32)
    cons = make_op("linear", M=M, N=N, K=N, block_n=16, dtype=F32)
    for a in linear_tiles(prod):
        g.add(prod, x="x", w="w", out="y", **a)
    last = g.add(cons, x="y", w="w2", out="z", pid_m=0, pid_n=2)
    program = lower(g, num_workers=2)
    assert len(program.task_waits[last]) == 1  # all three producer tiles, one event
    program.task_waits[last] = []
    program.queues = [[last], list(range(last))]
    with pytest.raises(EarlyRead, match=rf"task {last} \(linear#{last}\) on worker 0 reads Region\(buffer=.y."):
        run_vm(program, interleave="round_robin")


def test_vm_names_the_task_whose_producer_is_missing(rng):
    dag = RandomDag(rng, 2).build(nodes=3)
    program = lower(dag.g, num_workers=3)
    deps = dag.g.dependencies()
    victim = rng.choice(sorted({d for ds in deps for d in ds}))  # a task something waits for
    consumers = [j for j, d in enumerate(deps) if victim in d]
    for q in program.queues:
        if victim in q:
            q.remove(victim)
    with pytest.raises(Deadlock) as info:
        run_vm(program)
    msg = str(info.value)
    assert f"task {victim} ({dag.g.tasks[victim].name}) is in no queue" in msg
    assert any(f"task {j} ({dag.g.tasks[j].name}) waits" in msg for j in consumers)


# --- regions and dependencies --------------------------------------------------------------


_coverage = region_coverage


@pytest.mark.parametrize("M, tiles", [(1, {}), (3, {}), (3, {"block_m": 1, "block_n": 16})])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_linear_writes_partition_the_output_and_edge_tiles_are_clipped(M, tiles, silu_mul):
    N, K, split_k = 74, 37, 3  # 74 = 2 * 37: ragged in every tile size
    g = TaskGraph()
    for name, shape in (("x", (M, K)), ("w", (N, K)), ("nw", (K,)), ("out", (M, N // 2 if silu_mul else N)),
                        ("ws", (split_k, M, N)), ("out2", (M, N // 2 if silu_mul else N))):
        g.buffer(name, torch.zeros(shape))
    full = make_op("linear", M=M, N=N, K=K, norm=True, silu_mul=silu_mul, dtype=F32, **tiles)
    part = make_op("linear_partial", M=M, N=N, K=K, split_k=split_k, dtype=F32, **tiles)
    red = make_op("linear_reduce", M=M, N=N, K=K, split_k=split_k, silu_mul=silu_mul, dtype=F32, **tiles)
    first = len(g.tasks)
    for a in linear_tiles(full):
        g.add(full, x="x", w="w", norm_w="nw", out="out", **a)
    full_tasks = g.tasks[first:]
    first = len(g.tasks)
    for a in linear_tiles(part):
        g.add(part, x="x", w="w", ws="ws", **a)
    part_tasks = g.tasks[first:]
    first = len(g.tasks)
    for a in linear_tiles(red):
        g.add(red, ws="ws", out="out2", **a)
    red_tasks = g.tasks[first:]
    for tasks, out in ((full_tasks, "out"), (part_tasks, "ws"), (red_tasks, "out2")):
        assert (_coverage(g, out, tasks, "writes") == 1).all(), out  # each element by exactly one tile
    # Every full-K tile reads whole x rows and its weight rows; together, all of W once per row tile.
    n_row_tiles = -(-M // full.constexprs["BLOCK_M"])
    assert (_coverage(g, "w", full_tasks, "reads") == n_row_tiles).all()
    assert (_coverage(g, "nw", full_tasks, "reads") == len(full_tasks)).all()
    assert (_coverage(g, "x", full_tasks, "reads") == -(-N // full.constexprs["BLOCK_N"])).all()
    # The partials' K ranges tile K: each (x row, column) is read by exactly one split per column tile.
    n_col_tiles = -(-N // part.constexprs["BLOCK_N"])
    assert (_coverage(g, "x", part_tasks, "reads") == n_col_tiles).all()
    assert (_coverage(g, "w", part_tasks, "reads") == -(-M // part.constexprs["BLOCK_M"])).all()
    # The reduce reads every partial exactly once.
    assert (_coverage(g, "ws", red_tasks, "reads") == 1).all()


def test_split_k_partials_wait_only_for_the_producers_of_their_k_range():
    # Producer: y = x @ W1.T in column tiles of 16; consumer: split-K over y's 64 columns
    # in 4 splits of 16. Split s needs exactly producer tile s; the reduce of the
    # consumer's tile needs exactly its 4 partials.
    M, K1, N1, N2, split_k = 1, 24, 64, 37, 4
    g = TaskGraph()
    for name, shape in (("x", (M, K1)), ("w1", (N1, K1)), ("y", (M, N1)), ("w2", (N2, N1)),
                        ("ws", (split_k, M, N2)), ("z", (M, N2))):
        g.buffer(name, torch.randn(shape))
    prod = make_op("linear", M=M, N=N1, K=K1, block_n=16, dtype=F32)
    part = make_op("linear_partial", M=M, N=N2, K=N1, split_k=split_k, block_n=32, block_k=16, dtype=F32)
    red = make_op("linear_reduce", M=M, N=N2, K=N1, split_k=split_k, block_n=32, block_k=16, dtype=F32)
    assert linear_k_splits(N1, 16, split_k) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    prod_ids = [g.add(prod, x="x", w="w1", out="y", **a) for a in linear_tiles(prod)]
    part_ids = {(a["pid_n"], a["split"]): g.add(part, x="y", w="w2", ws="ws", **a) for a in linear_tiles(part)}
    red_ids = {a["pid_n"]: g.add(red, ws="ws", out="z", **a) for a in linear_tiles(red)}
    deps = g.dependencies()
    assert len(prod_ids) == 4 and len(red_ids) == 2
    for (pn, s), i in part_ids.items():
        assert deps[i] == [prod_ids[s]], (pn, s)
    for pn, i in red_ids.items():
        assert deps[i] == sorted(part_ids[(pn, s)] for s in range(split_k))
    # A second split-K linear reusing the workspace must wait for the first's reduce of
    # the same tile (write after read), and for nothing else of it.
    part2_ids = {(a["pid_n"], a["split"]): g.add(part, x="y", w="w2", ws="ws", **a) for a in linear_tiles(part)}
    deps = g.dependencies()
    for (pn, s), i in part2_ids.items():
        assert deps[i] == sorted([prod_ids[s], part_ids[(pn, s)], red_ids[pn]]), (pn, s)


def test_shared_workspace_is_safe_with_many_workers():
    # Two split-K linears share one workspace (write-after-read on it) in a chain;
    # any interleaving of 64 workers must still give the op-by-op result.
    M, N, split_k = 2, 37, 3
    g = TaskGraph()
    g.buffer("x", torch.randn(M, N)), g.buffer("w1", torch.randn(N, N) / N**0.5)
    g.buffer("w2", torch.randn(N, N) / N**0.5), g.buffer("ws", torch.zeros(split_k, M, N))
    g.buffer("y", torch.zeros(M, N)), g.buffer("z", torch.zeros(M, N))
    part = make_op("linear_partial", M=M, N=N, K=N, split_k=split_k, block_m=1, block_n=16, block_k=8, dtype=F32)
    red = make_op("linear_reduce", M=M, N=N, K=N, split_k=split_k, block_m=1, block_n=16, block_k=8,
                  residual=True, dtype=F32)
    for src, w, dst in (("x", "w1", "y"), ("y", "w2", "z")):
        for a in linear_tiles(part):
            g.add(part, x=src, w=w, ws="ws", **a)
        for a in linear_tiles(red):
            g.add(red, ws="ws", res=src, out=dst, **a)
    y = linear_ref(g.buffers["x"], g.buffers["w1"], residual=g.buffers["x"])
    z = linear_ref(y, g.buffers["w2"], residual=y)
    for seed in range(4):
        g.buffers["y"].fill_(float("nan")), g.buffers["z"].fill_(float("nan"))
        run_vm(lower(g, num_workers=64, schedule="list"), interleave="random", seed=seed)
        assert_close(g.buffers["z"], z, F32)


def test_bad_tile_indices_are_named():
    g = TaskGraph()
    g.buffer("x", torch.zeros(1, 8)), g.buffer("w", torch.zeros(10, 8)), g.buffer("y", torch.zeros(1, 10))
    op = make_op("linear", M=1, N=10, K=8, block_n=4, dtype=F32)
    assert len(linear_tiles(op)) == 3
    g.add(op, x="x", w="w", out="y", pid_m=0, pid_n=3)
    with pytest.raises(ValueError, match="pid_n=3"):
        g.dependencies()
    with pytest.raises(ValueError, match="even N"):
        make_op("linear", M=1, N=37, K=8, silu_mul=True)
    with pytest.raises(ValueError, match="split_k"):
        make_op("linear_partial", M=1, N=8, K=8, split_k=3, block_k=8)


# --- generated code ------------------------------------------------------------------------


def test_prefetch_is_issued_before_the_wait_and_off_under_the_interpreter(tmp_path):
    op = make_op("linear", M=1, N=64, K=200, prefetch_k=256, dtype=F32)
    g, dev = TaskGraph(), default_device()
    g.buffer("x", torch.randn(1, 200, device=dev)), g.buffer("w", torch.randn(64, 200, device=dev) / 200**0.5)
    g.buffer("y", torch.full((1, 64), float("nan"), device=dev))
    for a in linear_tiles(op):
        g.add(op, x="x", w="w", out="y", **a)
    kernel = Megakernel(lower(g, 1))
    text = kernel.source
    # The op's prefetch is its own function; the loop issues it for the next task (n*) before
    # the current task (w*) waits and runs, and for a worker's first task before the loop.
    assert text.index("def prefetch_0(") < text.index("linear_prefetch_tile(w, pid_n, N, 0, K, K") \
        < text.index("def megakernel(")
    loop = text[text.index("def megakernel("):]
    assert loop.index("prefetch_0(w0") < loop.index("for qi in") < loop.index("prefetch_0(n0") \
        < loop.index("op_0(w0")
    # Inside the op: the first weight chunk is loaded into registers, then the waits, then the body.
    op_src = text[text.index("def op_0("):text.index("def prefetch_0(")]
    assert op_src.index("w_first = linear_weights_first(") < op_src.index("wait_event(") \
        < op_src.index("linear_tile(x, w") < op_src.index("w_first=w_first")
    # The lines come from the task's rule (200 columns: 8); only compiled code prefetches them
    # (the interpreter has no inline PTX).
    assert op.constexprs["PREFETCH_LINES"] == 8
    assert "PREFETCH_LINES=PREFETCH_LINES * GPU" in text
    assert ("GPU: tl.constexpr = True" in text) == (dev.type == "cuda")
    kernel.run()
    assert_close(g.buffers["y"], linear_ref(g.buffers["x"], g.buffers["w"]), F32)
    # The K range caps them.
    on_gpu = make_op("linear", M=1, N=64, K=200, prefetch_k=256, dtype=F32)
    cfg = LinearConfig(on_gpu.constexprs["BLOCK_M"], on_gpu.constexprs["BLOCK_N"], on_gpu.constexprs["BLOCK_K"],
                       prefetch_k=256)
    assert on_gpu.constexprs["PREFETCH_LINES"] == prefetch_lines(cfg, 200, 4)[0] == 8
    assert make_op("linear", M=1, N=64, K=200, dtype=F32).constexprs["PREFETCH_LINES"] == 0
    part = make_op("linear_partial", M=1, N=64, K=200, split_k=4, prefetch_k=256, dtype=F32)
    assert part.constexprs["PREFETCH_LINES"] == 2  # 50 columns of each split: 2 lines of 32


def test_ops_differing_only_in_eps_get_their_own_branch():
    g, dev = TaskGraph(), default_device()
    g.buffer("x", torch.full((1, 8), 1e-3, device=dev)), g.buffer("w", torch.ones(8, device=dev))
    g.buffer("a", torch.empty(1, 8, device=dev)), g.buffer("b", torch.empty(1, 8, device=dev))
    g.add(make_op("rmsnorm", n=8, eps=1e-6), x="x", w="w", out="a", row=0)
    g.add(make_op("rmsnorm", n=8, eps=1e-2), x="x", w="w", out="b", row=0)
    program = lower(g, 1)
    assert len(program.variants) == 2
    Megakernel(program).run()
    assert_close(g.buffers["a"], rmsnorm_ref(g.buffers["x"], g.buffers["w"], 1e-6), F32)
    assert_close(g.buffers["b"], rmsnorm_ref(g.buffers["x"], g.buffers["w"], 1e-2), F32)
    # An op whose code differs outside its constexprs cannot hide behind another's key.
    op = make_op("rmsnorm", n=8)
    fake = OpSpec(**{**{f: getattr(op, f) for f in op.__dataclass_fields__}, "body": op.body.replace("EPS", "0.5")})
    g.add(fake, x="x", w="w", out="b", row=0)
    g.add(op, x="x", w="w", out="a", row=0)
    with pytest.raises(ValueError, match="same key"):
        lower(g, 1)


@pytest.mark.parametrize("preload,tma,norm,run", [(False, 0, False, 1), (True, 0, False, 1), (False, 3, False, 1),
                                                   (False, 0, True, 1), (False, 3, True, 1), (False, 3, True, 2),
                                                   (False, 0, False, 2)])
def test_gemv_tile_variants_of_the_weight_stream(preload, tma, norm, run):
    """Weights preloaded before the wait and TMA-streamed weights
    (descriptor loads, zero-filled past N) give the same product,
    including a ragged last chunk (K=200 over 64-wide chunks) and a clipped last tile;
    with an RMSNorm prologue the TMA body gathers the statistics inside its loop; a run of
    tiles a task (the last run one clipped tile) streams them as one."""
    dev = default_device()
    g = TaskGraph()
    g.buffer("x", torch.randn(1, 200, device=dev) * 3), g.buffer("w", torch.randn(40, 200, device=dev))
    g.buffer("g", torch.rand(200, device=dev) + 0.5)
    g.buffer("y", torch.full((1, 40), float("nan"), device=dev))
    op = make_op("linear", M=1, N=40, K=200, block_n=16, block_k=64, preload_weights=preload,
                 tma_stages=tma, norm=norm, eps=EPS, dtype=F32, tiles_per_task=run)
    assert bool(op.preload) == preload and op.constexprs["TMA_STAGES"] == tma
    assert len(linear_tiles(op)) == -(-3 // run)  # 40 rows: three tiles of 16
    for a in linear_tiles(op):
        g.add(op, x="x", w="w", out="y", **({"norm_w": "g"} if norm else {}), **a)
    Megakernel(lower(g, 1)).run()
    norm_kw = dict(norm_weight=g.buffers["g"], norm_eps=EPS) if norm else {}
    assert_close(g.buffers["y"], linear_ref(g.buffers["x"], g.buffers["w"], **norm_kw), F32)


def test_tma_gemv_split_with_norm_takes_statistics_over_the_whole_row():
    """A K split of a TMA GEMV with an RMSNorm prologue sees only its own chunks, so it must
    not take its rstd from them: the reduced splits equal the whole normalised product."""
    dev = default_device()
    g = TaskGraph()
    g.buffer("x", torch.randn(1, 256, device=dev) * 3), g.buffer("w", torch.randn(32, 256, device=dev))
    g.buffer("g", torch.rand(256, device=dev) + 0.5)
    g.buffer("ws", torch.zeros(4, 1, 32, device=dev)), g.buffer("y", torch.full((1, 32), float("nan"), device=dev))
    part = make_op("linear_partial", M=1, N=32, K=256, split_k=4, block_n=16, block_k=64, tma_stages=3,
                   norm=True, eps=EPS, dtype=F32)
    red = make_op("linear_reduce", M=1, N=32, K=256, split_k=4, block_n=16, block_k=64, dtype=F32)
    assert part.constexprs["TMA_STAGES"] == 3
    for a in linear_tiles(part):
        g.add(part, x="x", w="w", norm_w="g", ws="ws", **a)
    for a in linear_tiles(red):
        g.add(red, ws="ws", out="y", **a)
    Megakernel(lower(g, 1)).run()
    assert_close(g.buffers["y"], linear_ref(g.buffers["x"], g.buffers["w"], norm_weight=g.buffers["g"], norm_eps=EPS),
                 F32)


def test_short_tma_gemv_streams_wait_for_their_input_inside_the_stream():
    """A TMA GEMV task of at most WAIT_IN_STREAM_MAX_CHUNKS chunks waits for x from its weight
    loop (the generated task_wait, called by linear_run once the ring's prologue is issued):
    a chain whose second layer reads the first's output still equals the torch product. A
    longer stream waits before its body, as every other op does."""
    from mk.persistent.codegen import generate_source
    from mk.tasks.linear import WAIT_IN_STREAM_MAX_CHUNKS

    dev = default_device()
    g = TaskGraph()
    g.buffer("x", torch.randn(1, 192, device=dev)), g.buffer("w1", torch.randn(48, 192, device=dev))
    g.buffer("w2", torch.randn(40, 48, device=dev)), g.buffer("h", torch.full((1, 48), float("nan"), device=dev))
    g.buffer("y", torch.full((1, 40), float("nan"), device=dev))
    first = make_op("linear", M=1, N=48, K=192, block_n=16, block_k=64, tma_stages=3, dtype=F32)
    second = make_op("linear", M=1, N=40, K=48, block_n=8, block_k=16, tma_stages=2, tiles_per_task=2, dtype=F32)
    assert first.waits_in_body and second.waits_in_body and "WAIT=task_wait" in first.body
    for a in linear_tiles(first):
        g.add(first, x="x", w="w1", out="h", **a)
    for a in linear_tiles(second):
        g.add(second, x="h", w="w2", out="y", **a)
    program = lower(g, 1)
    assert "def task_wait(" in generate_source(program)
    Megakernel(program).run()
    h = linear_ref(g.buffers["x"], g.buffers["w1"])
    assert_close(g.buffers["h"], h, F32)
    assert_close(g.buffers["y"], linear_ref(h, g.buffers["w2"]), F32)
    long_k = 16 * (WAIT_IN_STREAM_MAX_CHUNKS + 1)
    long = make_op("linear", M=1, N=16, K=long_k, block_n=16, block_k=16, tma_stages=3, dtype=F32)
    assert not long.waits_in_body and "task_wait" not in long.body


def test_grouped_gemv_streams_wait_inside_and_equal_torch():
    """GEMV tasks on a ring of 1 + 2 * X_GROUP stream X_GROUP chunks an iteration and wait
    for x inside their stream (mk.tasks.linear.gemv_stream): a normed run of tiles, a
    split-K partial reading that run's output, and a residual tile reading the reduce's
    output all equal the torch chain, and the partial's edge tile (rows past N) stays exact."""
    from mk.tasks.linear import X_GROUP

    dev, ring = default_device(), 1 + 2 * X_GROUP
    g = TaskGraph()
    K1, N1, N2, N3 = 16 * X_GROUP, 64, 48, 24
    for name, t in (("x", torch.randn(1, K1)), ("g", 1 + 0.1 * torch.randn(K1)), ("w1", torch.randn(N1, K1)),
                    ("h", torch.full((1, N1), float("nan"))), ("w2", torch.randn(N2, N1)),
                    ("ws", torch.zeros(2, 1, N2)), ("z", torch.full((1, N2), float("nan"))),
                    ("w3", torch.randn(N3, N2)), ("r", torch.randn(1, N3)), ("y", torch.full((1, N3), float("nan")))):
        g.buffer(name, t.to(dev))
    normed = make_op("linear", M=1, N=N1, K=K1, block_n=16, block_k=4, tma_stages=ring, tiles_per_task=3,
                     norm=True, eps=EPS, dtype=F32)
    part = make_op("linear_partial", M=1, N=N2, K=N1, split_k=2, block_n=32, block_k=8, tma_stages=ring, dtype=F32)
    red = make_op("linear_reduce", M=1, N=N2, K=N1, split_k=2, block_n=32, block_k=8, dtype=F32)
    res = make_op("linear", M=1, N=N3, K=N2, block_n=8, block_k=4, tma_stages=ring, residual=True, dtype=F32)
    for op in (normed, part, res):
        assert op.waits_in_body and op.constexprs["X_GROUP"] == X_GROUP and op.constexprs["X_STAGES"] == 3
    for a in linear_tiles(normed):
        g.add(normed, x="x", w="w1", norm_w="g", out="h", **a)
    for a in linear_tiles(part):
        g.add(part, x="h", w="w2", ws="ws", **a)
    for a in linear_tiles(red):
        g.add(red, ws="ws", out="z", **a)
    for a in linear_tiles(res):
        g.add(res, x="z", w="w3", res="r", out="y", **a)
    Megakernel(lower(g, 1)).run()
    b = g.buffers
    h = linear_ref(b["x"], b["w1"], norm_weight=b["g"], norm_eps=EPS)
    z = linear_ref(h, b["w2"])
    assert_close(b["h"], h, F32)
    assert_close(b["z"], z, F32)
    assert_close(b["y"], linear_ref(z, b["w3"]) + b["r"], F32)


def test_vm_checks_buffers_that_are_the_same_memory():
    # "y" and "y_again" are one tensor under two names: the dependencies (derived from
    # names) order nothing between y's reader and y_again's writer, so running the writer
    # first clobbers data the reader still needs, and the VM must say so.
    M, N, K = 1, 32, 24
    g = TaskGraph()
    y = torch.full((M, N), float("nan"))
    g.buffer("x", torch.randn(M, K)), g.buffer("w", torch.randn(N, K)), g.buffer("w2", torch.randn(N, N))
    g.buffer("y", y), g.buffer("y_again", y), g.buffer("z", torch.full((M, N), float("nan")))
    op = make_op("linear", M=M, N=N, K=K, block_n=32, dtype=F32)
    square = make_op("linear", M=M, N=N, K=N, block_n=32, dtype=F32)
    g.add(op, x="x", w="w", out="y", pid_m=0, pid_n=0)
    reader = g.add(square, x="y", w="w2", out="z", pid_m=0, pid_n=0)
    writer = g.add(op, x="x", w="w", out="y_again", pid_m=0, pid_n=0)
    program = lower(g, num_workers=2)
    assert program.task_waits[writer] == []  # nothing orders it after the reader
    program.queues = [[writer], [0, reader]]
    with pytest.raises(EarlyRead, match=rf"task {writer} .* writes Region\(buffer='y_again'.*before every earlier"):
        run_vm(program, interleave="round_robin")
    program.queues = [[0, reader, writer], []]  # in order, the same memory is fine
    run_vm(program, interleave="round_robin")


@pytest.mark.parametrize("M,tma,run,block_n", [(1, 3, 2, 16), (1, 0, 1, 16), (3, 2, 1, 16), (3, 0, 1, 32),
                                                (3, 2, 2, 16)])
def test_lm_head_tiles_fold_the_argmax_and_the_append_takes_it(M, tma, run, block_n):
    """An LM head with ``argmax=True`` stores its logits and folds each row's best (value,
    index) into best[row] by atomic max; the token append with ``from_best`` takes it as the
    row's next token (torch.argmax of the stored logits: the lowest of equal maxima), appends
    it and leaves best at zero for the next step. Small integers make the products exact, so
    the planted ties (two equal best rows in one tile, one in another; across the clipped
    last tile) are real ties. GEMV runs through the TMA ring, register GEMV tiles, decode
    tl.dot tiles and their runs; the LM head's tasks are a team (no task waits for another).
    The VM runs the ops' torch semantics against the same regions in random orders."""
    N, K, S = 45, 64, 6
    gen = torch.Generator().manual_seed(M * 100 + tma * 10 + run + block_n)
    x = torch.randint(-2, 3, (M, K), generator=gen).float()
    w = torch.randint(-2, 3, (N, K), generator=gen).float()
    w[[9, 12, 40]] = 3 * x[0].sign()  # row 0's best: 9 and 12 in one tile, 40 in the last
    w[[20, 33]] = 3 * x[-1].sign()  # the last row's best (row 0's too when M = 1)
    op = make_op("linear", M=M, N=N, K=K, block_n=block_n, block_k=32, tma_stages=tma, tiles_per_task=run,
                 argmax=True, dtype=F32)
    append = make_op("append_token", batch=M, max_seq=S, from_best=True)
    assert op.operands[-1] == "best" and op.sync_operands == append.sync_operands == ("best",)
    want = linear_ref(x, w)
    for engine in ("megakernel", "vm"):
        g = TaskGraph()
        g.buffer("x", x.clone()), g.buffer("w", w.clone()), g.buffer("y", torch.full((M, N), float("nan")))
        g.buffer("best", torch.zeros(M, dtype=torch.int64)), g.buffer("ids", torch.full((M,), -1, dtype=torch.int32))
        g.buffer("pos", torch.tensor([1, 4, S - 1][:M], dtype=torch.int32))
        g.buffer("tokens", torch.zeros(M, S, dtype=torch.int32))
        lm = [g.add(op, x="x", w="w", out="y", best="best", **a) for a in linear_tiles(op)]
        for b in range(M):
            g.add(append, next_ids="ids", pos="pos", tokens="tokens", best="best", b=b)
        program = lower(g, num_workers=1 if engine == "megakernel" else 5)
        assert all(program.task_waits[t] == [] for t in lm)  # a team: no LM head task waits for another
        if engine == "megakernel":
            Megakernel(program).run()
        else:
            run_vm(program, interleave="random", seed=M + run)
        b = g.buffers
        assert torch.equal(b["y"], want), engine
        best = want.argmax(dim=1)
        assert b["ids"].tolist() == best.tolist(), engine
        assert b["best"].tolist() == [0] * M, engine
        for r, p in enumerate([1, 4, S - 1][:M]):  # the last position has no room: nothing appended
            assert b["pos"][r] == min(p + 1, S - 1) and b["tokens"][r].tolist() == [
                int(best[r]) if (c == p + 1) else 0 for c in range(S)], engine
    # The planted ties decided the answers (with M = 1 all five rows tie).
    assert want[0].argmax() == 9 and want[-1].argmax() == (20 if M > 1 else 9)


def test_argmax_folds_only_into_an_lm_head_epilogue():
    with pytest.raises(ValueError, match="no residual or silu_mul"):
        make_op("linear", M=1, N=32, K=16, residual=True, argmax=True, dtype=F32)
