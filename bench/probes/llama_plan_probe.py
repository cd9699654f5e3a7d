"""GPU probe: one Llama decode step under several plans — measured vs predicted, and where
the time goes (per-op busy and wait time from a traced launch).

For each plan variant (the search's, and hand-made uniform tilings of the linears):
compile, time 50 launches, read residency (registers, spills, shared memory), then one
traced launch summarised per op. The search plan's trace is saved (JSON + PNG).
Env: PROBE_SHAPE (1b|8b), PROBE_BATCH, PROBE_VARIANTS (comma list, default all), PROBE_TRACE=0
(trace only the search's plan), PROBE_SAVE_TRACES (variants whose trace files are
kept, default search), PROBE_ALT_WARPS (e.g. 2,8: each variant's program also timed at
those warps a worker; a variant named base@w2n396 runs base's plan on 396 workers of 2
warps), PROBE_KNOBS
(comma list of BACKOFF_NS[:nodefer] runtime settings timed on each variant's program),
variant names with knobs (``ring4#g1``: :func:`parse_variant`),
PROBE_ATTN_BLOCK_N (decode attention's K/V block rows, for every variant: the default
config's, patched where the lowering and the shared-memory model read it), MK_PROXY_FENCES=1
(every variant compiled with Triton's proxy-fence pass).
Writes $OUT/llama_plan_probe.json.
"""
import functools, importlib, json, os, re, sys, time, traceback
from collections import defaultdict
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import back_to_back_ms  # noqa: E402
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import Llama, LlamaConfig  # noqa: E402
from mk.persistent import runtime  # noqa: E402
from mk.persistent.runtime import Megakernel  # noqa: E402
from mk.planner.cost import OpChoice, estimate_step  # noqa: E402
from mk.planner.search import search  # noqa: E402
from mk.planner.simulate import simulate_step  # noqa: E402
from mk.timing import copy_bandwidth  # noqa: E402

OUT = os.environ.get("OUT", ".")
# Since session 23 the megakernel compiles without Triton's proxy-fence pass
# (mk.persistent.codegen.proxy_fence_pass); MK_PROXY_FENCES=1 compiles every variant with it.
PROXY_FENCES = os.environ.get("MK_PROXY_FENCES", "0") not in ("", "0")
if os.environ.get("PROBE_ATTN_BLOCK_N"):
    import importlib

    _attn_config = importlib.import_module("mk.tasks.decode_attention").decode_attention_config

    def _attn_config_patched(*a, **k):
        return replace(_attn_config(*a, **k), block_n=int(os.environ["PROBE_ATTN_BLOCK_N"]))

    for _m in ("mk.tasks.decode_attention", "mk.persistent.taskops", "mk.planner.cost"):
        importlib.import_module(_m).decode_attention_config = _attn_config_patched
KEY, B = os.environ.get("PROBE_SHAPE", "1b"), int(os.environ.get("PROBE_BATCH", "1"))
T0 = time.time()


def mark(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def timed(fn, reps=50, warmup=5):
    return back_to_back_ms(fn, reps, warmup)


def uniform(linear_choice, workers=None, **per_op):
    """A plan transform: every linear gets ``linear_choice`` (its fusions kept); ``per_op``
    overrides by op-name suffix (e.g. down=OpChoice(...))."""
    def transform(plan, graph):
        choices = {}
        for name, c in plan.choices.items():
            if graph.node(name).kind == "linear":
                pick = per_op.get(name.split(".")[-1], linear_choice)
                choices[name] = replace(pick, fuse=c.fuse)
            else:
                choices[name] = c
        return replace(plan, choices=choices, workers=workers or plan.workers)
    return transform


REG = lambda bn, bk: OpChoice(block_n=bn, block_k=bk, num_warps=4)  # noqa: E731
TMA = lambda bn, ring=4: OpChoice(block_n=bn, block_k=256, num_warps=4, tma_stages=ring)  # noqa: E731
def ranked(i, **budget):
    """The search's i-th plan (0: best), optionally under a shared-memory budget."""
    def transform(plan, graph):
        spec = MODEL_SPEC[0]
        if budget:
            spec = spec.with_smem_budget(budget["smem"])
        return search(graph, spec, top_k=i + 1)[i]
    return transform


def on_linears(plan, graph, pick, **plan_fields):
    """The plan with each linear's choice replaced by ``pick(name, node, choice)``."""
    choices = {n: pick(n, graph.node(n), c) if graph.node(n).kind == "linear" else c for n, c in plan.choices.items()}
    return replace(plan, choices=choices, **plan_fields)


def skinny(bn, bk, ring, workers=None):
    """A plan transform for decode batches: every linear a TMA-fed tl.dot tile of bn x bk
    with a ring of ``ring`` chunks, split-K wherever that brings the tasks up to ~the workers
    (at most 8 splits, at least 2 chunks a split)."""
    def transform(plan, graph):
        n_workers = workers or plan.workers

        def pick(name, node, c):
            tiles, chunks = -(-node.dims["N"] // bn), -(-node.dims["K"] // bk)
            split = 1
            while tiles * split < n_workers and split < 8 and chunks // (2 * split) >= 2:
                split *= 2
            return OpChoice(block_n=bn, block_k=bk, num_warps=4, tma_stages=ring, split_k=split, fuse=c.fuse)
        return on_linears(plan, graph, pick, workers=n_workers)
    return transform


def unfused(kind):
    """The plan with every op of ``kind`` fused into a host run as its own tasks again:
    ``rope_kv`` (RoPE + KV append after each QKV linear, as before session 9), ``argmax``
    (its chunk partials and reduce after the LM head, as before session 26)."""
    def transform(plan, graph):
        choices = {}
        for name, c in plan.choices.items():
            mine = [f for f in c.fuse if graph.node(f).kind == kind]
            choices[name] = replace(c, fuse=tuple(f for f in c.fuse if f not in mine))
            choices.update({f: OpChoice() for f in mine})
        return replace(plan, choices=choices)
    return transform


def unfused_norm(*ops):
    """The plan with the RMSNorm of the named linears (op-name suffixes) as its own task again."""
    def transform(plan, graph):
        choices = dict(plan.choices)
        for name, c in plan.choices.items():
            if graph.node(name).kind == "linear" and name.split(".")[-1] in ops:
                norms = [f for f in c.fuse if graph.node(f).kind == "rmsnorm"]
                choices[name] = replace(c, fuse=tuple(f for f in c.fuse if f not in norms))
                choices.update({f: OpChoice() for f in norms})
        return replace(plan, choices=choices)
    return transform


def tuned(ops=None, **fields):
    """The plan with ``fields`` set on its linears (or on ``ops``, op-name suffixes)."""
    def transform(plan, graph):
        choices = {}
        for n, c in plan.choices.items():
            mine = graph.node(n).kind == "linear" and (not ops or n.split(".")[-1] in ops)
            choices[n] = replace(c, **fields) if mine else c
        return replace(plan, choices=choices)
    return transform


def kv_splits(splits):
    """The plan with every attention cut into ``splits`` KV splits."""
    def transform(plan, graph):
        return replace(plan, choices={n: replace(c, kv_splits=splits) if graph.node(n).kind == "attention" else c
                                      for n, c in plan.choices.items()})
    return transform


def tiles(runs: bool, **block_n):
    """Every linear a TMA tile of ``block_n[op suffix]`` rows (default: the plan's), ring 4, no
    split-K; with ``runs`` each op's tiles dealt as runs of adjacent tiles, one run a worker
    where the op has more tiles than workers (:attr:`OpChoice.tiles_per_task`)."""
    def transform(plan, graph):
        def pick(name, node, c):
            bn = block_n.get(name.split(".")[-1], c.block_n)
            tiles = -(-node.dims["N"] // bn)
            run = -(-tiles // plan.workers) if runs else 1
            return replace(c, block_n=bn, block_k=256, split_k=1, tma_stages=4, tiles_per_task=run)
        return on_linears(plan, graph, pick)
    return transform


#: The search's picks at session 10 (one tile a task), by op.
SESSION10 = {"1b": dict(qkv=16, o_proj=8, gate_up=32, down=8, lm_head=32),
             "8b": dict(qkv=32, o_proj=16, gate_up=16, down=16, lm_head=32)}

MODEL_SPEC = []  # the live DeviceSpec, set in main
VARIANTS = {
    "search": lambda p, g: p,
    "top2": ranked(1),
    "top3": ranked(2),
    "budget99": ranked(0, smem="99KiB"),
    # The search without the decode tl.dot tile rates (DeviceSpec.dot_worker_bandwidth,
    # xmajor_dot_bandwidth): the plans before session 16.
    "no_dot_rates": lambda p, g: search(g, replace(MODEL_SPEC[0], dot_worker_bandwidth=0.0,
                                                   xmajor_dot_bandwidth=0.0))[0],
    "reg8x2048": uniform(REG(8, 2048)),
    "reg8x2048_2perSM": uniform(REG(8, 2048), workers=264),
    "reg16x1024": uniform(REG(16, 1024)),
    "tma32r4": uniform(TMA(32)),
    "tma32r4_2perSM": uniform(TMA(32), workers=264),
    "tma32r4_1perSM": uniform(TMA(32), workers=132),
    "reg8x2048_1perSM": uniform(REG(8, 2048), workers=132),
    "tma16_split2": uniform(replace(TMA(16), split_k=2)),
    "tma16r4": uniform(TMA(16)),
    "tma64r2": uniform(TMA(64, 2)),
    "mixed": uniform(TMA(32), o_proj=REG(8, 2048), down=REG(8, 2048)),
    # Decode-batch tiles: wider weight boxes carry the float32 x chunk over more weight rows.
    "skinny32x256r3": skinny(32, 256, 3),
    "skinny64x128r4": skinny(64, 128, 4),
    "skinny128x128r3": skinny(128, 128, 3),
    "skinny128x128r4_1perSM": skinny(128, 128, 4, workers=132),
    "skinny128x64r6": skinny(128, 64, 6),
    "skinny256x64r4": skinny(256, 64, 4),
    # KV splits of attention other than the search's (session 10: each group's last split merges it).
    "kv1": kv_splits(1),
    "kv2": kv_splits(2),
    "kv4": kv_splits(4),
    "kv8": kv_splits(8),
    # RoPE + KV append as its own task again (fused into the QKV tiles since session 9).
    "unfused_rope": unfused("rope_kv"),
    # 8-row GEMV tiles for the 2048-row projections: 256 tasks instead of 128.
    "bn8_o_down": tuned(("o_proj", "down"), block_n=8),
    # Deeper rings for the 2048-row projections (128 tasks: more bytes in flight a worker).
    # (Session 9's l2wait* variants, weights asked into L2 just before each task's wait,
    # needed a plan field that was removed once measured: bench/NOTES.md.)
    "ring8_o_down": tuned(("o_proj", "down"), tma_stages=8),
    # Since session 12 a GEMV task's ring prologue is in flight while it waits for its
    # inputs: a deeper ring puts more of the task's weights in flight before the wait.
    "ring6_o_down": tuned(("o_proj", "down"), tma_stages=6),
    "ring8_qkv_o_down": tuned(("qkv", "o_proj", "down"), tma_stages=8),
    "ring8_qkv_o": tuned(("qkv", "o_proj"), tma_stages=8),
    "ring8_all": tuned(tma_stages=8),
    # One projection at a time (session 13): o_proj's whole task (1B: 8 chunks) in flight before its wait.
    "ring8_o": tuned(("o_proj",), tma_stages=8),
    "ring8_qkv": tuned(("qkv",), tma_stages=8),
    "ring6_all": tuned(tma_stages=6),
    # The down projection alone (session 14): 1B's 8-row boxes keep 16 KiB in flight a worker
    # and its tasks stream at ~0.7 of the copy; gate_up's at ~0.95.
    "ring6_down": tuned(("down",), tma_stages=6),
    "ring8_down": tuned(("down",), tma_stages=8),
    # Grouped streams with three and four groups in flight (session 28).
    "ring13_down": tuned(("down",), tma_stages=13),
    "ring17_down": tuned(("down",), tma_stages=17),
    "ring6_gate_up": tuned(("gate_up",), tma_stages=6),
    # Split-K as tile dataflow at batch 1: a partial waits only for the producers of its K
    # range (down: the gate_up tiles of its columns; o_proj: the attention of its KV groups),
    # so it starts during its producers' tail; the reduce adds a hop.
    "down_s2": tuned(("down",), split_k=2),
    "down_s4": tuned(("down",), split_k=4),
    "o_s2": tuned(("o_proj",), split_k=2),
    "o_s8": tuned(("o_proj",), split_k=8),
    "o_s16": tuned(("o_proj",), split_k=16),
    "down_s8": tuned(("down",), split_k=8),
    "down_s16": tuned(("down",), split_k=16),
    # Batch 8: the search's o_proj / down before split 16 was a candidate (session 24).
    "s8_o": tuned(("o_proj",), block_n=128, block_k=64, split_k=8, tma_stages=4),
    "s8_o_down": lambda p, g: tuned(("o_proj",), block_n=128, block_k=64, split_k=8, tma_stages=4)(
        tuned(("down",), split_k=8)(p, g), g),
    # QKV as 8-row tiles in runs of two (192 tasks as now) through a grouped ring of 4 KiB
    # chunks, as o_proj and down stream: 32 KiB in flight a worker (24 now) in 36 KiB of ring.
    "qkv8r2": tuned(("qkv",), block_n=8, tiles_per_task=2, tma_stages=9),
    "qkv8r2_ring5": tuned(("qkv",), block_n=8, tiles_per_task=2, tma_stages=5),
    # Batch 8 (session 15): a smaller LM head box (its 256 x 64 box, ring 3, sets the
    # megakernel's shared memory).
    "lm64": tuned(("lm_head",), block_n=64, block_k=128, tma_stages=3),
    # Batch 8: the LM head's 1002 tiles of 128 rows are 3.8 waves on 264 workers; 256-row
    # tiles are 1.9, split 2 of 128 rows 7.6 (session 24's next question).
    "lm256": tuned(("lm_head",), block_n=256, block_k=64, tma_stages=3),
    "lm128s2": tuned(("lm_head",), split_k=2),
    # Session 26: the argmax partials in the LM head's epilogue (the search's) or their own
    # tasks; batch 8's LM head as runs of four 128-row tiles (251 tasks: one wave).
    "unfused_argmax": unfused("argmax"),
    "lm128r4": tuned(("lm_head",), tiles_per_task=4),
    # Session 27: split-K reduce tiles as wide as the partials' (before: the search cuts each
    # partial tile into as many reduce tasks as one wave of workers takes), or 64 columns.
    "wide_reduce": tuned(reduce_block_n=0),
    "reduce64": tuned(reduce_block_n=64),
    "lm64_ring4": lambda p, g: tuned(tma_stages=4)(tuned(("lm_head",), block_n=64, block_k=128)(p, g), g),
    # Runs of tiles a task (session 11): the session-10 tiles one a task and as runs; uniform tiles as runs.
    "session10": tiles(False, **SESSION10[KEY]),
    "session10_runs": tiles(True, **SESSION10[KEY]),
    "runs8": tiles(True, qkv=8, o_proj=8, gate_up=8, down=8, lm_head=8),
    "runs16": tiles(True, qkv=16, o_proj=16, gate_up=16, down=16, lm_head=16),
    "runs32": tiles(True, qkv=32, o_proj=32, gate_up=32, down=32, lm_head=32),
    "session10_runs_ring8": lambda p, g: tuned(("o_proj", "down"), tma_stages=8)(tiles(True, **SESSION10[KEY])(p, g), g),
    "search_no_runs": tuned(tiles_per_task=1),
    "gu_run1": tuned(("gate_up",), tiles_per_task=1),
    # One-chunk register tiles for the K = hidden projections: their weights are loaded
    # into registers before the dependency wait (OpSpec.preload), a TMA ring's only after it.
    "reg_o": tuned(("o_proj",), block_n=8, block_k=2048, tma_stages=0, tiles_per_task=1),
    "reg_o_qkv": tuned(("o_proj", "qkv"), block_n=8, block_k=2048, tma_stages=0, tiles_per_task=1),
    # Split-K partials as runs of adjacent tiles (one split), so every worker streams about
    # the same weight bytes: the 8B gate_up's 224 tiles of 128 rows left 40 of 264 workers idle.
    "gu_s8": tuned(("gate_up",), split_k=8),
    "gu_s8r7": tuned(("gate_up",), split_k=8, tiles_per_task=7),
    "qkv_s16r3": tuned(("qkv",), split_k=16, tiles_per_task=3),
    "gu_s8r7_qkv_s16r3": lambda p, g: tuned(("qkv",), split_k=16, tiles_per_task=3)(
        tuned(("gate_up",), split_k=8, tiles_per_task=7)(p, g), g),
    # Weight-major (128-row, wgmma) tiles where the search picks 64-row x-major ones, split
    # so that the tasks still fill the workers.
    "gu128": tuned(("gate_up",), block_n=128, block_k=64, split_k=2, tma_stages=3),
    "down128": tuned(("down",), block_n=128, block_k=64, split_k=16, tma_stages=3),
    "gu128_down128": lambda p, g: tuned(("down",), block_n=128, block_k=64, split_k=16, tma_stages=3)(
        tuned(("gate_up",), block_n=128, block_k=64, split_k=2, tma_stages=3)(p, g), g),
    "down128s8": tuned(("down",), block_n=128, block_k=64, split_k=8, tma_stages=3),
    # Batch 8 (session 23): the 1B gate_up's 64 x 128 x-major tiles stream at ~0.63 of the
    # copy (35 us a layer for 22 us of bytes); deeper rings and wider weight-major boxes.
    "gu64r4": tuned(("gate_up",), tma_stages=4),
    "gu128r4": tuned(("gate_up",), block_n=128, block_k=64, split_k=2, tma_stages=4),
    "gu256s4": tuned(("gate_up",), block_n=256, block_k=64, split_k=4, tma_stages=3),
    "gu64x64r6": tuned(("gate_up",), block_n=64, block_k=64, tma_stages=6),
    "o128s8": tuned(("o_proj",), block_n=128, block_k=64, split_k=8, tma_stages=3),
    "o128s8_down128s8": lambda p, g: tuned(("o_proj",), block_n=128, block_k=64, split_k=8, tma_stages=3)(
        tuned(("down",), block_n=128, block_k=64, split_k=8, tma_stages=3)(p, g), g),
    "qkv128s4": tuned(("qkv",), split_k=4),
    # Batch 8: x-major (64 x 128) down / o_proj + down partials, as the search chose before
    # session 24's register term (DeviceSpec.xmajor_kernel_slowdown).
    "xm_down": tuned(("down",), block_n=64, block_k=128, split_k=8, tma_stages=3),
    "xm_o_down": lambda p, g: tuned(("o_proj",), block_n=64, block_k=128, split_k=8, tma_stages=2)(
        tuned(("down",), block_n=64, block_k=128, split_k=8, tma_stages=3)(p, g), g),
    # A split-K partial with a fused RMSNorm reads all of x first for rstd (_rows_rstd) before
    # its ring starts; with the norm its own task the partials skip that pass.
    "unfused_norm_qkv": unfused_norm("qkv"),
    "unfused_norm_qkv_gu": unfused_norm("qkv", "gate_up"),
    # What a batch-1 QKV task spends its ~0.6 us a chunk on (session 23's open question): run
    # these traced at 4 warps a worker (``unfused_norm_qkv@w4n264``: the rmsnorm op's own 8
    # warps would halve the workers) and compare the QKV tasks' time after their wait.
    "unfused_norm_rope_qkv": lambda p, g: unfused("rope_kv")(unfused_norm("qkv")(p, g), g),
    # Grouped GEMV streams (session 18, mk.tasks.linear.gemv_stream): rings of 9 stream two
    # groups of 4 chunks in flight; ring4 is the plans before them.
    "ring4": tuned(tma_stages=4),
    "qkv9": tuned(("qkv",), tma_stages=9),
    "o9": tuned(("o_proj",), tma_stages=9),
    "qkv9_o9": tuned(("qkv", "o_proj"), tma_stages=9),
    "o9_down9": tuned(("o_proj", "down"), tma_stages=9),
    "qkv4": tuned(("qkv",), tma_stages=4),
    "qkv4_o9": lambda p, g: tuned(("o_proj",), tma_stages=9)(tuned(("qkv",), tma_stages=4)(p, g), g),
    "down9": tuned(("down",), tma_stages=9),
    # Fewer, wider O projection tasks (session 20): the workers without one go on to their
    # gate_up task and put its ring's prologue in flight while attention runs.
    "o16r9": tuned(("o_proj",), block_n=16, tma_stages=9),
    "o16r4": tuned(("o_proj",), block_n=16, tma_stages=4),
    # Less in flight (session 20): DRAM queues as deep as the rings' bytes, so every L2 access
    # on the critical chain (x chunks, norms, attention, polls) waits behind them.
    "gu3": tuned(("gate_up",), tma_stages=3),
    "gu2": tuned(("gate_up",), tma_stages=2),
    "gu2_down4": lambda p, g: tuned(("down",), tma_stages=4)(tuned(("gate_up",), tma_stages=2)(p, g), g),
    "o2": tuned(("o_proj",), tma_stages=2),
    "gu3_again": tuned(("gate_up",), tma_stages=3),
    "qkv3": tuned(("qkv",), tma_stages=3),
    "gu3_qkv3": lambda p, g: tuned(("qkv",), tma_stages=3)(tuned(("gate_up",), tma_stages=3)(p, g), g),
    "gu3_down6": lambda p, g: tuned(("down",), tma_stages=6)(tuned(("gate_up",), tma_stages=3)(p, g), g),
    "search_again": lambda p, g: p,
    # More of each QKV task in flight without the grouped ring's 70 KiB (session 21).
    "qkv5": tuned(("qkv",), tma_stages=5),
    "qkv6": tuned(("qkv",), tma_stages=6),
    "o16r9_gu6": lambda p, g: tuned(("gate_up",), tma_stages=6)(tuned(("o_proj",), block_n=16, tma_stages=9)(p, g), g),
    # Back from the grouped choices one op at a time (session 18, the search pricing a
    # grouped stream's x chunks once a group).
    "gu32": tuned(("gate_up",), block_n=32, tiles_per_task=2, tma_stages=4),
    "gu32_qkv4": lambda p, g: tuned(("qkv",), tma_stages=4)(tuned(("gate_up",), block_n=32, tiles_per_task=2,
                                                                  tma_stages=4)(p, g), g),
    "gu32_qkv4_o4": lambda p, g: tuned(("qkv", "o_proj"), tma_stages=4)(
        tuned(("gate_up",), block_n=32, tiles_per_task=2, tma_stages=4)(p, g), g),
    "qkv32": tuned(("qkv",), block_n=32, tiles_per_task=1, tma_stages=4),
    "qkv32_o4": lambda p, g: tuned(("o_proj",), tma_stages=4)(
        tuned(("qkv",), block_n=32, tiles_per_task=1, tma_stages=4)(p, g), g),
    "qkv9_o9_down9": tuned(("qkv", "o_proj", "down"), tma_stages=9),
    # The search's plan under each queue schedule (mk.planner.simulate).
    "round_robin": lambda p, g: replace(p, schedule="round_robin"),
    "zigzag": lambda p, g: replace(p, schedule="zigzag"),
    "list": lambda p, g: replace(p, schedule="list"),
}


def parse_variant(name):
    """``base[@wW][nN][#knobs]``: the variant ``base`` with its megakernel at W warps a worker
    and/or its plan at N workers (e.g. ``search@w2n396``: 3 two-warp workers an SM); knobs
    set mk.tasks.linear's stream constants for the variant's ops: ``gG`` X_GROUP (1: no
    grouped streams), ``mM`` WAIT_IN_STREAM_MAX_CHUNKS, ``cC`` X_GROUP_MAX_CHUNK_BYTES (e.g.
    ``ring4#g1``)."""
    m = re.fullmatch(r"([^@#]+)(?:@(?:w(\d+))?(?:n(\d+))?)?(?:#(.*))?", name)
    knobs = {KNOBS[k]: int(v) for k, v in re.findall(r"([gmc])(\d+)", m.group(4) or "")}
    return m.group(1), int(m.group(2) or 0), int(m.group(3) or 0), knobs


KNOBS = {"g": "X_GROUP", "m": "WAIT_IN_STREAM_MAX_CHUNKS", "c": "X_GROUP_MAX_CHUNK_BYTES"}
_LINEAR = importlib.import_module("mk.tasks.linear")
LINEAR_DEFAULTS = {v: getattr(_LINEAR, v) for v in KNOBS.values()}


def alt_warps(dec, alt):
    """Time ``alt`` (the decoder's program at another warp count) and compare the logits of
    one step from the same state with the decoder's own kernel."""
    st = dec.state
    saved = {k: v.clone() for k, v in st.items()}
    logits = dec.step.graph.buffers[dec.step.logits]
    outs = []
    for kernel in (dec.kernel, alt):
        for k, v in saved.items():
            st[k].copy_(v)
        kernel.launch()
        kernel.check()
        outs.append(logits.float().clone())
    res = alt.residency()
    return {"ms": timed(alt.launch), "logits_max_abs_diff": (outs[0] - outs[1]).abs().max().item(),
            "n_regs": res.n_regs, "n_spills": res.n_spills, "smem": res.shared_bytes,
            "blocks_per_sm": res.blocks_per_sm}


def summarize(events):
    by_op = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        s = by_op[e["label"]]
        s[0] += 1
        s[1] += e["end_us"] - e["ready_us"]
        s[2] += e["ready_us"] - e["start_us"]
    span = max(e["end_us"] for e in events) - min(e["start_us"] for e in events)
    workers = 1 + max(e["worker"] for e in events)
    busy = sum(e["end_us"] - e["ready_us"] for e in events)
    wait = sum(e["ready_us"] - e["start_us"] for e in events)
    return {"span_us": span, "busy_frac": busy / (span * workers), "wait_frac": wait / (span * workers),
            "ops": {k: {"tasks": v[0], "busy_us_per_worker": v[1] / workers, "run_us_per_task": v[1] / v[0],
                        "wait_us_per_task": v[2] / v[0]} for k, v in sorted(by_op.items())}}


def main():
    cfg = LlamaConfig(**SHAPES[KEY])
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MK_COMMIT"),
           "shape": KEY, "batch": B, "copy_Bps": copy_bandwidth()["copy_Bps"], "variants": {},
           "proxy_fences": PROXY_FENCES}
    w = random_model(cfg)
    model = Llama(cfg, w, device="cuda", dtype=torch.bfloat16, max_batch_size=max(B, 1), max_seq_len=1024,
                  name=f"llama-{KEY}")
    del w
    res["floor_ms"] = model.shape.weight_bytes / res["copy_Bps"] * 1e3
    MODEL_SPEC.append(model.device_spec)
    res["device_spec"] = model.device_spec.to_dict()
    # Planned for the length the probe's requests reach (4 prompt + 8 new tokens), as
    # Llama.stream plans them (PROBE_KV_LEN: another planned length, e.g. the cache's).
    kv_len = int(os.environ.get("PROBE_KV_LEN", 0)) or model.plan_length(4 + 8)
    res["kv_len"] = kv_len
    base_plan, graph = model.plan(B, kv_len)
    res["search_explain"] = base_plan.explain()
    prompts = [[128000 + b, 791, 6864, 315] for b in range(B)]
    names = os.environ.get("PROBE_VARIANTS", ",".join(VARIANTS)).split(",")
    for name in names:
        r = res["variants"][name] = {}
        try:
            base, warps, workers, knobs = parse_variant(name)
            for k, v in {**LINEAR_DEFAULTS, **knobs}.items():
                setattr(_LINEAR, k, v)
            plan = VARIANTS[base](base_plan, graph)
            if workers:
                plan = replace(plan, workers=workers)
            runtime.Megakernel = functools.partial(Megakernel, num_warps=warps) if warps else Megakernel
            est = estimate_step(graph, plan.choices, model.device_spec, plan.workers)
            sim = simulate_step(graph, plan.choices, model.device_spec, plan.workers, plan.schedule)
            r["predicted_ms"] = sim.seconds * 1e3  # the simulated step under the plan's schedule
            r["phase_sum_ms"] = est.seconds * 1e3  # each phase spread evenly, summed
            r["model_smem"] = est.peak_smem_bytes
            r["plan"] = json.loads(plan.to_json())
            model.plan = lambda batch, kv_len=None, plan=plan: (plan, graph)
            model._decoders.clear()
            t = time.time()
            out = model.generate(prompts, max_new_tokens=8)
            r["build_s"] = time.time() - t
            r["tokens"] = [o[-8:] for o in out]
            dec = model.last_decoder
            res_ = dec.kernel.residency()
            r["residency"] = dict(n_regs=res_.n_regs, n_spills=res_.n_spills, smem=res_.shared_bytes,
                                  blocks_per_sm=res_.blocks_per_sm)
            r["workers"] = dec.kernel.program.num_workers
            r["tasks"] = len(dec.step.graph.tasks)
            r["variants"] = len(dec.kernel.program.variants)
            r["ms"] = timed(dec.kernel.launch)
            r["num_warps"] = dec.kernel.num_warps
            dec.kernel.check()
            # Runtime knobs on the same program: spin-wait backoff (ns) and deferred signals.
            for knob in filter(None, os.environ.get("PROBE_KNOBS", "").split(",")):
                backoff, defer = int(knob.split(":")[0]), knob.endswith(":nodefer")
                alt = Megakernel(dec.kernel.program, backoff_ns=backoff, defer_signals=not defer)
                r[f"ms_backoff{knob}"] = timed(alt.launch)
                alt.check()
                mark(name, "knob", knob, r[f"ms_backoff{knob}"])
                del alt
            # The same program at other warp counts a worker (Megakernel(num_warps=...)).
            for warps in filter(None, os.environ.get("PROBE_ALT_WARPS", "").split(",")):
                alt = Megakernel(dec.kernel.program, num_warps=int(warps))
                r[f"warps{warps}"] = alt_warps(dec, alt)
                mark(name, "warps", warps, r[f"warps{warps}"])
                del alt
            if name != "search" and os.environ.get("PROBE_TRACE", "1") == "0":
                mark(name, {k: v for k, v in r.items() if k not in ("tokens", "plan")})
                json.dump(res, open(os.path.join(OUT, "llama_plan_probe.json"), "w"), indent=1)
                continue
            traced = Megakernel(dec.kernel.program, trace=True)
            for _ in range(3):
                traced.launch()
            torch.cuda.synchronize()
            traced.check()
            events = traced.trace_events()
            tasks = dec.step.graph.tasks
            for e in events:
                t = tasks[e["task"]]
                out_buf = next((t.bind[k] for k in ("out", "o_part", "part_val", "ws", "q", "tokens") if k in t.bind), "")
                e["label"] = f"{t.op.name}:{out_buf.split('.', 1)[-1]}"
            r["trace"] = summarize(events)
            if name in os.environ.get("PROBE_SAVE_TRACES", "search").split(","):
                stem = f"trace_{KEY}_b{B}" + ("" if name == "search" else f"_{name}")
                traced.save_trace(os.path.join(OUT, stem + ".json"), os.path.join(OUT, stem + ".png"))
            del traced
            mark(name, {k: v for k, v in r.items() if k not in ("trace", "tokens", "plan")},
                 "span", round(r["trace"]["span_us"], 1), "busy", round(r["trace"]["busy_frac"], 2))
        except Exception:  # noqa: BLE001
            r["error"] = traceback.format_exc()[-2000:]
            mark(name, "failed", r["error"][-400:])
        json.dump(res, open(os.path.join(OUT, "llama_plan_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
