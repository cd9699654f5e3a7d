"""The decode step's megakernel ops on the CPU: embedding, rope_kv, split-KV attention (in two
phases, and in one whose last split of a KV group merges it), argmax.

Each op alone, over sizes that are not multiples of its tiles, runs through the megakernel
(interpreter, one worker) and through the VM (several workers, random interleaving) and
must match the task's torch reference; the VM's torch semantics must match the device's.
Then a decoder-layer-shaped DAG (embedding -> rmsnorm -> QKV -> rope_kv -> attention ->
O-proj + residual -> rmsnorm -> gate/up + SiLU·mul -> down + residual -> rmsnorm -> LM
head -> argmax) must match an op-by-op reference built from mk.tasks, on the megakernel for
two launches in a row (positions advanced on the device buffer, new token ids) and on the
VM with 1, 3 and 16 workers. Regions must be exact tiles (the cache conservatively whole
per sequence), so the derived dependencies are the intended ones.
"""

import math
from pathlib import Path

import pytest
import torch

from mk.persistent.graph import HEADER_WORDS, SCHEDULES, TaskGraph, lower
from mk.persistent.runtime import Megakernel
from mk.persistent.vm import run_vm
from mk.tasks import default_device, make_op, op_tiles
from mk.tasks.argmax import argmax_ref
from mk.tasks.decode_attention import decode_attention_partials, decode_attention_ref
from mk.tasks.embedding import embedding_ref
from mk.tasks.linear import interleave_gate_up, linear_ref
from mk.tasks.rmsnorm import rmsnorm_ref
from mk.tasks.rope import interleave_rotary, rope_inv_freq, rope_kv_ref
from tests.conftest import assert_close
from tests.persistent._helpers import can_compile_for_cuda, compile_script_ok, region_coverage

F32 = torch.float32
DEV = default_device()
ROOT = Path(__file__).resolve().parents[2]
EPS = 1e-5


def nan(*shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEV)


def add_all(g: TaskGraph, op, **bind) -> list[int]:
    return [g.add(op, **bind, **a) for a in op_tiles(op)]


def assert_same_inf(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal where infinite (an empty split's -inf lse), close elsewhere."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(got[torch.isinf(got)],
                                                                          ref[torch.isinf(ref)]), what
    assert_close(got[torch.isfinite(ref)], ref[torch.isfinite(ref)], F32, what)


def run_kernel_and_vm(g: TaskGraph, outputs: dict[str, torch.Tensor], check, seed: int) -> None:
    """Run ``g`` on the megakernel, then (outputs reset) on the VM with 3 workers at random;
    ``check(what)`` both times, and the VM's buffers must equal the megakernel's."""
    def reset():
        for name, init in outputs.items():
            g.buffers[name].copy_(init)

    reset()
    Megakernel(lower(g, num_workers=1)).run()
    check("megakernel")
    device_out = {name: g.buffers[name].clone() for name in outputs}
    reset()
    run_vm(lower(g, num_workers=3, schedule="list"), interleave="random", seed=seed)
    check("vm")
    for name, t in device_out.items():
        if t.dtype.is_floating_point:
            assert_same_inf(g.buffers[name], t, f"vm vs megakernel: {name}")
        else:
            assert torch.equal(g.buffers[name], t), name


# --- each op alone ------------------------------------------------------------------------


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_h", [None, 64])  # one block a row / four, the last clipped
def test_embedding_op(ids_dtype, block_h, _seed):
    rows, vocab, hidden = 3, 1000, 200
    g = TaskGraph()
    ids = torch.tensor([vocab - 1, 0, 517], dtype=ids_dtype, device=DEV)  # both ends of the table
    g.buffer("ids", ids), g.buffer("table", torch.randn(vocab, hidden, device=DEV))
    g.buffer("out", nan(rows, hidden))
    op = make_op("embedding", rows=rows, vocab=vocab, hidden=hidden, block_h=block_h)
    assert len(op_tiles(op)) == rows * (4 if block_h else 1)
    add_all(g, op, ids="ids", table="table", out="out")
    ref = embedding_ref(ids, g.buffers["table"])

    def check(what):
        assert torch.equal(g.buffers["out"], ref), what  # a copy: exact

    run_kernel_and_vm(g, {"out": nan(rows, hidden)}, check, _seed)


def rope_graph(batch, hq, hkv, d, max_seq, pos, write_seqlens=True):
    g = TaskGraph()
    g.buffer("qkv", torch.randn(batch, (hq + 2 * hkv) * d, device=DEV))
    g.buffer("pos", pos)
    g.buffer("inv_freq", rope_inv_freq(d, 10000.0).to(DEV))
    g.buffer("q", nan(batch, hq * d))
    g.buffer("kc", torch.randn(batch, hkv, max_seq, d, device=DEV))
    g.buffer("vc", torch.randn(batch, hkv, max_seq, d, device=DEV))
    op = make_op("rope_kv", batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=max_seq,
                 write_seqlens=write_seqlens)
    seq = {}
    if write_seqlens:
        g.buffer("seqlens", torch.full((batch,), -7, dtype=torch.int32, device=DEV))
        seq = {"seqlens": "seqlens"}
    add_all(g, op, qkv="qkv", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc", **seq)
    return g, op


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)], ids=["g1", "g4"])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_kv_op(hq, hkv, pos_dtype, _seed):
    batch, d, max_seq = 3, 12, 40  # D/2 = 6: a padded half-head block
    pos = torch.tensor([max_seq - 1, 0, 17], dtype=pos_dtype, device=DEV)
    g, _ = rope_graph(batch, hq, hkv, d, max_seq, pos)
    kc0, vc0 = g.buffers["kc"].clone(), g.buffers["vc"].clone()
    qkv = g.buffers["qkv"].view(batch, 1, hq + 2 * hkv, d)
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)
    q_rot, k_ref, v_ref = rope_kv_ref(q, k, v, pos.view(batch, 1), g.buffers["inv_freq"], kc0, vc0)
    written = torch.zeros(batch, hkv, max_seq, dtype=torch.bool)
    for b in range(batch):
        written[b, :, int(pos[b])] = True

    def check(what):
        assert_close(g.buffers["q"], q_rot.reshape(batch, hq * d), F32, f"{what}: q")
        for name, ref, before in (("kc", k_ref, kc0), ("vc", v_ref, vc0)):
            got = g.buffers[name]
            assert_close(got[written], ref[written], F32, f"{what}: {name}")
            assert torch.equal(got[~written], before[~written]), f"{what}: {name} rows off the positions changed"
        assert g.buffers["seqlens"].tolist() == [p + 1 for p in pos.tolist()], what

    run_kernel_and_vm(g, {"q": nan(batch, hq * d), "kc": kc0, "vc": vc0,
                          "seqlens": torch.full((batch,), -7, dtype=torch.int32)}, check, _seed)


@pytest.mark.parametrize("block_n,reduce_n", [(32, 32), (128, 128), (128, 32), (32, 16)],
                         ids=["x-major", "weight-major", "weight-major-4-reduces-a-tile", "x-major-2-reduces-a-tile"])
def test_batch_split_k_partials_leave_the_rmsnorm_to_their_reduce(block_n, reduce_n, _seed):
    # Decode-batch tl.dot partials through the TMA ring with an RMSNorm prologue (NORM_SQ)
    # read only their K range of x and store its sums of squares beside their tile; the
    # reduces (residual add, and QKV + RoPE + KV append) scale by the whole rows' rstd, as
    # tiles of the partials' width or narrower (each reading its partial tile's squares).
    batch, hq, hkv, d, K, max_seq, split_k = 5, 2, 1, 64, 96, 16, 3
    N = (hq + 2 * hkv) * d
    tiles = dict(block_n=block_n, block_k=16, dtype=F32)
    part = make_op("linear_partial", M=batch, N=N, K=K, split_k=split_k, norm=True, eps=EPS, tma_stages=3, **tiles)
    assert part.constexprs["NORM_SQ"] == 1 and part.constexprs["WS_N"] == N + N // block_n
    red_tiles = dict(tiles, block_n=reduce_n, part_block_n=block_n)
    red = make_op("linear_reduce", M=batch, N=N, K=K, split_k=split_k, residual=True, norm_sq=True, eps=EPS,
                  **red_tiles)
    rope_red = make_op("qkv_rope_kv_reduce", batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, K=K,
                       max_seq=max_seq, split_k=split_k, norm_sq=True, eps=EPS, **red_tiles)
    assert red.constexprs["WS_N"] == rope_red.constexprs["WS_N"] == part.constexprs["WS_N"]
    assert len(op_tiles(red)) == -(-batch // red.constexprs["BLOCK_M"]) * N // reduce_n
    w_hf = torch.randn(N, K, device=DEV) * 0.2
    wq, wk, wv = w_hf.split([hq * d, hkv * d, hkv * d])
    g = TaskGraph()
    g.buffer("x", torch.randn(batch, K, device=DEV) * 3), g.buffer("norm_w", 1 + 0.1 * torch.randn(K, device=DEV))
    g.buffer("w", w_hf), g.buffer("w_rot", torch.cat([interleave_rotary(wq, d), interleave_rotary(wk, d), wv]))
    g.buffer("res", torch.randn(batch, N, device=DEV)), g.buffer("y", nan(batch, N))
    g.buffer("ws", nan(split_k, batch, part.constexprs["WS_N"])), g.buffer("ws2", nan(split_k, batch, part.constexprs["WS_N"]))
    pos = torch.tensor([3, 0, 7, 15, 9], dtype=torch.int32, device=DEV)
    g.buffer("pos", pos), g.buffer("inv_freq", rope_inv_freq(d, 10000.0).to(DEV)), g.buffer("q", nan(batch, hq * d))
    kc0, vc0 = torch.randn(batch, hkv, max_seq, d, device=DEV), torch.randn(batch, hkv, max_seq, d, device=DEV)
    g.buffer("kc", kc0.clone()), g.buffer("vc", vc0.clone())
    add_all(g, part, x="x", w="w", norm_w="norm_w", ws="ws")
    add_all(g, part, x="x", w="w_rot", norm_w="norm_w", ws="ws2")
    add_all(g, red, ws="ws", res="res", out="y")
    add_all(g, rope_red, ws="ws2", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc")
    qkv = linear_ref(g.buffers["x"], w_hf, norm_weight=g.buffers["norm_w"], norm_eps=EPS)
    q, k, v = qkv.view(batch, 1, -1, d).split([hq, hkv, hkv], dim=2)
    q_rot, k_ref, v_ref = rope_kv_ref(q, k, v, pos.view(batch, 1), g.buffers["inv_freq"], kc0, vc0)

    def check(what):
        assert_close(g.buffers["y"], qkv + g.buffers["res"], F32, f"{what}: y")
        assert_close(g.buffers["q"], q_rot.reshape(batch, hq * d), F32, f"{what}: q")
        assert_close(g.buffers["kc"], k_ref, F32, f"{what}: k cache")
        assert_close(g.buffers["vc"], v_ref, F32, f"{what}: v cache")

    run_kernel_and_vm(g, {"y": nan(batch, N), "q": nan(batch, hq * d), "kc": kc0, "vc": vc0,
                          "ws": nan(split_k, batch, part.constexprs["WS_N"]),
                          "ws2": nan(split_k, batch, part.constexprs["WS_N"])}, check, _seed)
    # Split 1 reads x's columns of its K range only (its rstd is the reduce's).
    k_lo, k_hi = part.constexprs["BLOCK_K"] * 2, part.constexprs["BLOCK_K"] * 4
    reads = part.reads(dict(pid_m=0, pid_n=0, split=1), {"x": "x", "w": "w", "norm_w": "norm_w", "ws": "ws"})
    assert [(r.c0, r.c1) for r in reads if r.buffer == "x"] == [(k_lo, k_hi)]


@pytest.mark.parametrize("block_n,block_m,run", [(4, 1, 1), (32, 1, 1), (16, 16, 1), (4, 1, 3), (16, 16, 2)],
                         ids=["quarter-head", "two-heads", "dot", "run-of-3-quarter-heads", "dot-run-of-2"])
def test_qkv_rope_kv_op(block_n, block_m, run, _seed):
    # The fused QKV + RoPE + append on half-split weights made interleaved: equal to the
    # linear then rope_kv references, every other cache row untouched, each position out of
    # range writing no row; tiles of a fraction of a head, of two heads, and tl.dot tiles,
    # one a task or a run of adjacent tiles a task (the last run shorter).
    batch, hq, hkv, d, K, max_seq = 3, 4, 2, 16, 40, 9
    w_hf = torch.randn((hq + 2 * hkv) * d, K, device=DEV) * 0.2
    wq, wk, wv = w_hf.split([hq * d, hkv * d, hkv * d])
    g = TaskGraph()
    g.buffer("x", torch.randn(batch, K, device=DEV))
    g.buffer("w", torch.cat([interleave_rotary(wq, d), interleave_rotary(wk, d), wv]).contiguous())
    g.buffer("norm_w", 1 + 0.1 * torch.randn(K, device=DEV))
    pos = torch.tensor([max_seq - 1, max_seq, 3], dtype=torch.int32, device=DEV)
    g.buffer("pos", pos), g.buffer("inv_freq", rope_inv_freq(d, 10000.0).to(DEV))
    g.buffer("q", nan(batch, hq * d))
    kc0, vc0 = torch.randn(batch, hkv, max_seq, d, device=DEV), torch.randn(batch, hkv, max_seq, d, device=DEV)
    g.buffer("kc", kc0.clone()), g.buffer("vc", vc0.clone())
    g.buffer("seqlens", torch.zeros(batch, dtype=torch.int32, device=DEV))
    op = make_op("qkv_rope_kv", batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, K=K, max_seq=max_seq,
                 block_m=block_m, block_n=block_n, block_k=16, norm=True, eps=EPS, write_seqlens=True,
                 tiles_per_task=run)
    add_all(g, op, x="x", w="w", norm_w="norm_w", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc",
            v_cache="vc", seqlens="seqlens")
    qkv = linear_ref(g.buffers["x"], w_hf, norm_weight=g.buffers["norm_w"], norm_eps=EPS).view(batch, 1, -1, d)
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)
    # The reference clips nothing: give it a copy of the caches one row longer.
    pad = lambda c: torch.cat([c, torch.zeros(batch, hkv, 1, d, device=DEV)], dim=2)  # noqa: E731
    q_rot, k_ref, v_ref = rope_kv_ref(q, k, v, pos.view(batch, 1), g.buffers["inv_freq"], pad(kc0), pad(vc0))
    written = torch.zeros(batch, hkv, max_seq, dtype=torch.bool)
    written[0, :, max_seq - 1] = written[2, :, 3] = True

    def check(what):
        assert_close(g.buffers["q"], q_rot.reshape(batch, hq * d), F32, f"{what}: q")
        for name, ref, before in (("kc", k_ref, kc0), ("vc", v_ref, vc0)):
            got = g.buffers[name]
            assert_close(got[written], ref[:, :, :max_seq][written], F32, f"{what}: {name}")
            assert torch.equal(got[~written], before[~written]), f"{what}: {name} rows off the positions changed"
        assert g.buffers["seqlens"].tolist() == [max_seq, max_seq, 4], what

    run_kernel_and_vm(g, {"q": nan(batch, hq * d), "kc": kc0, "vc": vc0,
                          "seqlens": torch.zeros(batch, dtype=torch.int32)}, check, _seed)


@pytest.mark.parametrize("run", [1, 3])
@pytest.mark.parametrize("bias,qk_norm", [(False, False), (True, False), (False, True)])
def test_qkv_rope_run_epilogue_args_hold_no_none(run, bias, qk_norm):
    # Triton 3.6 (the GPUs') does not compile a tuple holding None, which the CPU's newer
    # Triton accepts: the run epilogue's args mark what is off by a flag, not by None.
    op = make_op("qkv_rope_kv", batch=1, num_q_heads=4, num_kv_heads=2, head_dim=16, K=64, max_seq=9, block_n=32,
                 block_k=16, tma_stages=2, tiles_per_task=run, bias=bias, qk_norm=qk_norm,
                 dtype=torch.bfloat16)
    call = op.body[op.body.index("epilogue_args=("):]
    args = call[:call.index("), ") + 1]
    assert "qkv_rope_kv_run_epilogue" in op.body and "None" not in args, args


def test_rope_kv_position_past_the_cache_writes_no_row(_seed):
    # The guard of a fused kernel: a bad position rotates q, writes no cache row, and the
    # lengths it publishes are clipped to the cache (so attention cannot read past it).
    batch, hq, hkv, d, max_seq = 2, 2, 1, 8, 5
    pos = torch.tensor([max_seq, 2], dtype=torch.int32, device=DEV)
    g, _ = rope_graph(batch, hq, hkv, d, max_seq, pos)
    kc0, vc0 = g.buffers["kc"].clone(), g.buffers["vc"].clone()

    def check(what):
        assert torch.equal(g.buffers["kc"][0], kc0[0]) and torch.equal(g.buffers["vc"][0], vc0[0]), what
        assert not torch.equal(g.buffers["kc"][1, :, 2], kc0[1, :, 2]), what
        assert g.buffers["seqlens"].tolist() == [max_seq, 3], what
        assert torch.isfinite(g.buffers["q"]).all(), what

    run_kernel_and_vm(g, {"q": nan(batch, hq * d), "kc": kc0, "vc": vc0,
                          "seqlens": torch.zeros(batch, dtype=torch.int32)}, check, _seed)


@pytest.mark.parametrize("one_phase", [True, False, "from_positions"],
                         ids=["last_split_merges", "merge_tasks", "last_split_merges_from_positions"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)], ids=["g1", "g4"])
@pytest.mark.parametrize("num_splits,block_n", [(3, None), (3, 16), (1, 16)])
def test_decode_attention_ops(hq, hkv, num_splits, block_n, one_phase, _seed):
    """Split-KV attention ops against the reference. ``from_positions``: the one-phase op
    reads each length as the step's position + 1 (before its wait), never seqlens."""
    from_positions = one_phase == "from_positions"
    batch, d, max_seq = 3, 12, 40
    seqlens = [37, 1, 20]  # a partial block, one key, and (block 16, 3 splits) an empty last split
    g = TaskGraph()
    g.buffer("q", torch.randn(batch, hq * d, device=DEV))
    kc, vc = torch.randn(batch, hkv, max_seq, d, device=DEV), torch.randn(batch, hkv, max_seq, d, device=DEV)
    for b, n in enumerate(seqlens):  # never read: NaN would poison the output
        kc[b, :, n:], vc[b, :, n:] = float("nan"), float("nan")
    g.buffer("kc", kc), g.buffer("vc", vc)
    g.buffer("seqlens", torch.tensor(seqlens, dtype=torch.int64, device=DEV))
    g.buffer("o_part", nan(batch, hq, num_splits * d)), g.buffer("lse", nan(batch, hq, num_splits))
    g.buffer("out", nan(batch, hq * d))
    sizes = dict(batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=max_seq, num_splits=num_splits,
                 block_n=block_n)
    ws = dict(q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part", lse="lse")
    if from_positions:  # seqlens holds nonsense: only the positions may be read
        g.buffer("pos", torch.tensor(seqlens, dtype=torch.int32, device=DEV) - 1)
        g.buffer("arrivals", torch.zeros(batch * hkv, dtype=torch.int32, device=DEV))
        ws = {**{k: v for k, v in ws.items() if k != "seqlens"}, "pos": "pos"}
        add_all(g, make_op("decode_attention", **sizes, from_positions=True), **ws, arrivals="arrivals", out="out")
    elif one_phase:  # the last split of each KV group merges it; the counts must end at 0
        g.buffer("arrivals", torch.zeros(batch * hkv, dtype=torch.int32, device=DEV))
        add_all(g, make_op("decode_attention", **sizes), **ws, arrivals="arrivals", out="out")
    else:
        add_all(g, make_op("decode_attention_partial", **sizes), **ws)
        add_all(g, make_op("decode_attention_merge", batch=batch, num_q_heads=hq, head_dim=d, num_splits=num_splits),
                o_part="o_part", lse="lse", out="out")
    q3 = g.buffers["q"].view(batch, hq, d)
    ref = decode_attention_ref(q3, kc, vc, g.buffers["seqlens"]).reshape(batch, hq * d)
    ws_ref = None
    if block_n is None:  # the op's default tiles are the launcher's: same workspace
        ws_ref = decode_attention_partials(q3, kc, vc, g.buffers["seqlens"], num_splits=num_splits)
    if from_positions:
        g.buffers["seqlens"].copy_(torch.tensor([max_seq, 0, 7]))

    bn = make_op("decode_attention_partial", **sizes).constexprs["BLOCK_N"]
    slice_len = [math.ceil(math.ceil(n / num_splits) / bn) * bn for n in seqlens]
    live = [math.ceil(n / s) for n, s in zip(seqlens, slice_len)]  # splits holding a key
    if block_n == 16 and num_splits == 3:
        assert live == [3, 1, 2]  # 37 keys: 3 slices of 16; 1 key: split 0 alone; 20 keys: 2 of 3 slices

    def check(what):
        assert_close(g.buffers["out"], ref, F32, f"{what}: out")
        if one_phase:  # left at 0 for the next launch (the VM runs after the megakernel on them)
            assert not g.buffers["arrivals"].any(), what
            # Only the live splits of a sequence with more than one write the workspace (a
            # lone live split writes out itself), and the merge reads no other entry: the
            # rest is still NaN here.
            o_part, lse = g.buffers["o_part"].view(batch, hq, num_splits, d), g.buffers["lse"]
            for b, n_live in enumerate(live):
                used = n_live if n_live > 1 else 0
                assert torch.isnan(o_part[b, :, used:]).all() and torch.isnan(lse[b, :, used:]).all(), what
                assert torch.isfinite(lse[b, :, :used]).all(), what
                if ws_ref is not None:
                    assert_close(o_part[b, :, :used], ws_ref[0][b, :, :used], F32, f"{what}: o_part")
                    assert_same_inf(lse[b, :, :used], ws_ref[1][b, :, :used], f"{what}: lse")
        elif ws_ref is not None:
            assert_close(g.buffers["o_part"], ws_ref[0].reshape(batch, hq, -1), F32, f"{what}: o_part")
            assert_same_inf(g.buffers["lse"], ws_ref[1], f"{what}: lse")
        if block_n == 16 and num_splits == 3 and not one_phase:
            # Sequence 2 (20 keys): slices [0, 16), [16, 20), and an empty one.
            assert torch.isinf(g.buffers["lse"][2, :, 2]).all() and torch.isfinite(g.buffers["lse"][2, :, :2]).all()

    run_kernel_and_vm(g, {"o_part": nan(batch, hq, num_splits * d), "lse": nan(batch, hq, num_splits),
                          "out": nan(batch, hq * d)}, check, _seed)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (3, 3)], ids=["g4", "g1"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "rope-only"])
def test_decode_attention_with_rope_folded_in(qk_norm, hq, hkv, _seed):
    """RoPE (with Qwen3's q/k norm) folded into the attention splits: each live split rotates
    its group's q from the QKV row, the split holding the new key appends k and v at the
    position, split 0 of KV head 0 writes seqlens; against rope_kv_ref then the attention
    reference. Sequences of 1, 20 and 37 keys over 3 splits of 16: one, two and three live."""
    from mk.tasks.rope import head_rmsnorm_ref, rope_kv_attention_prologue

    batch, d, max_seq, splits = 3, 12, 40, 3
    seqlens = [37, 1, 20]
    pos = torch.tensor(seqlens, dtype=torch.int32, device=DEV) - 1
    g = TaskGraph()
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, device=DEV)
    g.buffer("qkv", qkv), g.buffer("pos", pos)
    g.buffer("inv_freq", rope_inv_freq(d, 10000.0).to(DEV))
    kc0, vc0 = torch.randn(batch, hkv, max_seq, d, device=DEV), torch.randn(batch, hkv, max_seq, d, device=DEV)
    for b, n in enumerate(seqlens):  # the new key's row on: read only once the split wrote it
        kc0[b, :, n - 1:], vc0[b, :, n - 1:] = float("nan"), float("nan")
    g.buffer("kc", kc0.clone()), g.buffer("vc", vc0.clone())
    norms = {}
    if qk_norm:
        norms = {"q_norm": 1 + 0.1 * torch.randn(d, device=DEV), "k_norm": 1 + 0.1 * torch.randn(d, device=DEV)}
        for name, w in norms.items():  # in the interleaved layout of the QKV row's q and k
            g.buffer(name, interleave_rotary(w, d))
    g.buffer("q", nan(batch, hq * d)), g.buffer("seqlens", torch.full((batch,), -7, dtype=torch.int32, device=DEV))
    g.buffer("o_part", nan(batch, hq, splits * d)), g.buffer("lse", nan(batch, hq, splits))
    g.buffer("out", nan(batch, hq * d)), g.buffer("arrivals", torch.zeros(batch * hkv, dtype=torch.int32, device=DEV))
    prologue = rope_kv_attention_prologue(batch, hq, hkv, d, max_seq, write_seqlens=True, qk_norm=qk_norm,
                                          qk_eps=EPS)
    op = make_op("decode_attention", batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=max_seq,
                 num_splits=splits, block_n=16, from_positions=True, prologue=prologue)
    add_all(g, op, q="q", k_cache="kc", v_cache="vc", pos="pos", o_part="o_part", lse="lse", arrivals="arrivals",
            out="out", qkv="qkv", inv_freq="inv_freq", seqlens="seqlens", **{n: n for n in norms})

    rows = qkv.view(batch, 1, hq + 2 * hkv, d)
    q, k = (interleave_free(t, d) for t in rows.split([hq, hkv, hkv], dim=2)[:2])  # v rows are as they are
    v = rows[:, :, hq + hkv:]
    q_in, k_in = (head_rmsnorm_ref(t, norms.get(n), EPS) for t, n in ((q, "q_norm"), (k, "k_norm")))
    q_rot, k_ref, v_ref = rope_kv_ref(q_in, k_in, v, pos.view(batch, 1), g.buffers["inv_freq"], kc0, vc0)
    ref = decode_attention_ref(q_rot.view(batch, hq, d), k_ref, v_ref, torch.tensor(seqlens, device=DEV))

    def check(what):
        assert_close(g.buffers["q"], q_rot.reshape(batch, hq * d), F32, f"{what}: q")
        for b, p in enumerate(pos.tolist()):
            assert_close(g.buffers["kc"][b, :, p], k_ref[b, :, p], F32, f"{what}: k appended")
            assert_close(g.buffers["vc"][b, :, p], v_ref[b, :, p], F32, f"{what}: v appended")
            assert torch.equal(g.buffers["kc"][b, :, :p], kc0[b, :, :p]), f"{what}: cached keys changed"
            assert torch.equal(g.buffers["vc"][b, :, :p], vc0[b, :, :p]), f"{what}: cached values changed"
        assert g.buffers["seqlens"].tolist() == seqlens, what
        assert_close(g.buffers["out"], ref.reshape(batch, hq * d), F32, f"{what}: out")

    run_kernel_and_vm(g, {"q": nan(batch, hq * d), "kc": kc0, "vc": vc0, "out": nan(batch, hq * d),
                          "o_part": nan(batch, hq, splits * d), "lse": nan(batch, hq, splits),
                          "seqlens": torch.full((batch,), -7, dtype=torch.int32)}, check, _seed)


def test_attention_with_rope_folded_in_waits_only_for_its_groups_qkv_tiles():
    """The splits of KV head kv read only their group's q columns and head kv's k and v
    columns of the QKV row, so they wait for the QKV tiles of those columns alone (an early
    group attends while the projection's other tiles still run), never for each other."""
    from mk.tasks.rope import rope_kv_attention_prologue

    batch, hq, hkv, d, max_seq, splits, k, bn = 2, 8, 2, 8, 20, 3, 16, 16
    group, width = hq // hkv, (hq + 2 * hkv) * d
    g = TaskGraph()
    g.buffer("x", torch.randn(batch, k, device=DEV)), g.buffer("w", torch.randn(width, k, device=DEV))
    g.buffer("qkv", nan(batch, width)), g.buffer("pos", torch.tensor([3, 19], dtype=torch.int32, device=DEV))
    g.buffer("inv_freq", rope_inv_freq(d, 10000.0).to(DEV)), g.buffer("q", nan(batch, hq * d))
    g.buffer("kc", torch.randn(batch, hkv, max_seq, d, device=DEV))
    g.buffer("vc", torch.randn(batch, hkv, max_seq, d, device=DEV))
    g.buffer("o_part", nan(batch, hq, splits * d)), g.buffer("lse", nan(batch, hq, splits))
    g.buffer("arrivals", torch.zeros(batch * hkv, dtype=torch.int32, device=DEV)), g.buffer("out", nan(batch, hq * d))
    lin = make_op("linear", M=batch, N=width, K=k, dtype=F32, block_n=bn, block_k=16)
    tiles = dict(zip([a["pid_n"] for a in op_tiles(lin)], add_all(g, lin, x="x", w="w", out="qkv")))
    op = make_op("decode_attention", batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=max_seq,
                 num_splits=splits, from_positions=True,
                 prologue=rope_kv_attention_prologue(batch, hq, hkv, d, max_seq))
    ids = dict(zip([tuple(a.values()) for a in op_tiles(op)],
                   add_all(g, op, q="q", k_cache="kc", v_cache="vc", pos="pos", o_part="o_part", lse="lse",
                           arrivals="arrivals", out="out", qkv="qkv", inv_freq="inv_freq")))
    deps = g.dependencies()
    for (b, kv, s), i in ids.items():
        cols = [*range(kv * group * d, (kv + 1) * group * d), *range((hq + kv) * d, (hq + kv + 1) * d),
                *range((hq + hkv + kv) * d, (hq + hkv + kv + 1) * d)]
        assert deps[i] == sorted({tiles[c // bn] for c in cols}), (b, kv, s)


def interleave_free(t: torch.Tensor, d: int) -> torch.Tensor:
    """Heads of the interleaved rotary layout (pairs adjacent) back in the half-split one."""
    from mk.tasks.rope import deinterleave_rotary

    return deinterleave_rotary(t, d, dim=-1)


def test_attention_splits_past_the_sequence_skip_their_wait():
    """With the length from the positions, a split past the sequence's live ones reads and
    writes nothing, so it does not wait for its inputs: given a wait that can never be met,
    such a split still finishes (and the step is right), where a live split times out."""
    from mk.persistent.runtime import MegakernelTimeout

    batch, hq, hkv, d, max_seq, k = 2, 4, 2, 8, 48, 16
    seqlens = [5, 37]  # 3 splits of 16 keys: sequence 0 has one live split, sequence 1 three
    sizes = dict(batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=max_seq, num_splits=3,
                 block_n=16)

    def build():
        g = TaskGraph()
        g.buffer("x", torch.randn(batch, k, device=DEV)), g.buffer("w", torch.randn(hq * d, k, device=DEV))
        g.buffer("q", nan(batch, hq * d))
        g.buffer("kc", torch.randn(batch, hkv, max_seq, d, device=DEV))
        g.buffer("vc", torch.randn(batch, hkv, max_seq, d, device=DEV))
        g.buffer("pos", torch.tensor(seqlens, dtype=torch.int32, device=DEV) - 1)
        g.buffer("o_part", nan(batch, hq, 3 * d)), g.buffer("lse", nan(batch, hq, 3)), g.buffer("out", nan(batch, hq * d))
        g.buffer("arrivals", torch.zeros(batch * hkv, dtype=torch.int32, device=DEV))
        add_all(g, make_op("linear", M=batch, N=hq * d, K=k, dtype=F32), x="x", w="w", out="q")
        attention = add_all(g, make_op("decode_attention", **sizes, from_positions=True), q="q", k_cache="kc",
                            v_cache="vc", pos="pos", o_part="o_part", lse="lse", arrivals="arrivals", out="out")
        return g, attention

    def never_met(program, task):  # its wait on q's producer, for more signals than there are
        row = [i for q in program.queues for i in q].index(task)
        assert int(program.desc[row, 2]) == 1 and int(program.desc[row, 3]) == task  # one wait
        program.desc[row, HEADER_WORDS + 1] += 1000

    g, attention = build()
    program = lower(g, num_workers=1)
    dead = [t for t in attention if g.tasks[t].args["b"] == 0 and g.tasks[t].args["split"] > 0]
    for t in dead:
        never_met(program, t)
    Megakernel(program).run()
    q3 = g.buffers["q"].view(batch, hq, d)
    assert_close(q3, linear_ref(g.buffers["x"], g.buffers["w"]).view(batch, hq, d), F32, "q")
    ref = decode_attention_ref(q3, g.buffers["kc"], g.buffers["vc"], torch.tensor(seqlens, device=DEV))
    assert_close(g.buffers["out"], ref.reshape(batch, hq * d), F32, "out")

    g, attention = build()
    program = lower(g, num_workers=1)
    live = next(t for t in attention if g.tasks[t].args["b"] == 1 and g.tasks[t].args["split"] == 2)
    never_met(program, live)
    with pytest.raises(MegakernelTimeout, match=rf"task {live} "):
        Megakernel(program, interpret_polls=50).run()


@pytest.mark.parametrize("block_v,out_dtype", [(256, torch.int64), (None, torch.int32)])
def test_argmax_ops(block_v, out_dtype, _seed):
    rows, vocab = 3, 1000
    logits = torch.randn(rows, vocab, device=DEV)
    logits[1, 300] = logits[1, 700] = 10.0  # a tie across chunks: the lower index wins
    logits[2, 900], logits[2, 5] = float("nan"), 50.0  # NaN wins, as in torch.argmax
    g = TaskGraph()
    g.buffer("logits", logits)
    part = make_op("argmax_partial", rows=rows, vocab=vocab, block_v=block_v)
    red = make_op("argmax_reduce", rows=rows, vocab=vocab, block_v=block_v)
    chunks = part.constexprs["N_CHUNKS"]
    assert chunks == (4 if block_v else 1)  # 1000 = 3 * 256 + 232: the last chunk clipped
    g.buffer("pv", nan(rows, chunks)), g.buffer("pi", torch.full((rows, chunks), -1, dtype=torch.int32, device=DEV))
    g.buffer("idx", torch.full((rows,), -1, dtype=out_dtype, device=DEV)), g.buffer("val", nan(rows))
    add_all(g, part, logits="logits", part_val="pv", part_idx="pi")
    add_all(g, red, part_val="pv", part_idx="pi", out_idx="idx", out_val="val")
    ref = argmax_ref(logits)
    assert ref.tolist()[1:] == [300, 900]

    def check(what):
        assert g.buffers["idx"].tolist() == ref.tolist(), what
        got, want = g.buffers["val"], logits[torch.arange(rows), ref]
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got[:2], want[:2]), what

    run_kernel_and_vm(g, {"pv": nan(rows, chunks), "pi": torch.full((rows, chunks), -1, dtype=torch.int32),
                          "idx": torch.full((rows,), -1, dtype=out_dtype), "val": nan(rows)}, check, _seed)


# --- regions and dependencies ------------------------------------------------------------


coverage = region_coverage


def test_attention_waits_for_its_sequences_rope_and_merges_for_their_splits():
    batch, hq, hkv, d, max_seq, splits = 3, 8, 2, 8, 20, 3
    group = hq // hkv
    g, _ = rope_graph(batch, hq, hkv, d, max_seq, torch.tensor([3, 9, 19], dtype=torch.int32, device=DEV))
    g.buffer("o_part", nan(batch, hq, splits * d)), g.buffer("lse", nan(batch, hq, splits))
    g.buffer("out", nan(batch, hq * d))
    part = make_op("decode_attention_partial", batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                   max_seq=max_seq, num_splits=splits)
    merge = make_op("decode_attention_merge", batch=batch, num_q_heads=hq, head_dim=d, num_splits=splits)
    rope_ids = list(range(batch))
    part_ids = dict(zip([tuple(a.values()) for a in op_tiles(part)],
                        add_all(g, part, q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part",
                                lse="lse")))
    merge_ids = dict(zip([tuple(a.values()) for a in op_tiles(merge)],
                         add_all(g, merge, o_part="o_part", lse="lse", out="out")))
    deps = g.dependencies()
    for (b, kv, s), i in part_ids.items():
        assert deps[i] == [rope_ids[b]], (b, kv, s)  # its q, cache rows and length: all from rope_kv(b)
    for (b, h), i in merge_ids.items():
        assert deps[i] == [part_ids[(b, h // group, s)] for s in range(splits)], (b, h)
    # rope_kv's conservative cache region: all rows of its sequence, so the B tasks tile the cache.
    tasks = g.tasks
    for name in ("kc", "vc"):
        assert (coverage(g, name, tasks[:batch], "writes") == 1).all()
        assert (coverage(g, name, [tasks[i] for i in part_ids.values()], "reads") == splits).all()
    for name in ("q", "seqlens"):
        assert (coverage(g, name, tasks[:batch], "writes") == 1).all()
    # The partials write each workspace element once; each merge reads one head's splits.
    for name in ("o_part", "lse"):
        assert (coverage(g, name, [tasks[i] for i in part_ids.values()], "writes") == 1).all()
        assert (coverage(g, name, [tasks[i] for i in merge_ids.values()], "reads") == 1).all()
    assert (coverage(g, "out", [tasks[i] for i in merge_ids.values()], "writes") == 1).all()


def test_one_phase_attention_splits_wait_only_for_rope_and_consumers_for_the_whole_group():
    batch, hq, hkv, d, max_seq, splits = 2, 8, 2, 8, 20, 3
    group = hq // hkv
    g, _ = rope_graph(batch, hq, hkv, d, max_seq, torch.tensor([3, 19], dtype=torch.int32, device=DEV))
    g.buffer("o_part", nan(batch, hq, splits * d)), g.buffer("lse", nan(batch, hq, splits))
    g.buffer("arrivals", torch.zeros(batch * hkv, dtype=torch.int32)), g.buffer("out", nan(batch, hq * d))
    op = make_op("decode_attention", batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=max_seq,
                 num_splits=splits)
    ids = dict(zip([tuple(a.values()) for a in op_tiles(op)],
                   add_all(g, op, q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part", lse="lse",
                           arrivals="arrivals", out="out")))
    # A task writing one head of out (as if it merged it: it must wait for every split of
    # the head's group, any of which may merge), then a second attention on the same
    # workspace, which must wait for the teams that read it.
    heads = make_op("decode_attention_merge", batch=batch, num_q_heads=hq, head_dim=d, num_splits=1)
    g.buffer("y", nan(batch, hq * d)), g.buffer("o1", nan(batch, hq, d)), g.buffer("l1", nan(batch, hq, 1))
    readers = [g.add(heads, o_part="o1", lse="l1", out="out", b=b, q_head=h)
               for b in range(batch) for h in range(hq)]
    again = add_all(g, op, q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part", lse="lse",
                    arrivals="arrivals", out="y")
    deps = g.dependencies()
    for (b, kv, s), i in ids.items():
        assert g.tasks[i].team_start == ids[(b, kv, 0)]
        assert deps[i] == [b], (b, kv, s)  # rope_kv(b) only: never another split of its team
    for j, i in enumerate(readers):
        b, h = divmod(j, hq)
        assert deps[i] == [ids[(b, h // group, s)] for s in range(splits)], (b, h)
    for (b, kv, s), i in zip(ids, again):
        # The whole earlier team: any of its splits may have been the one reading the workspace.
        assert set(deps[i]) >= {ids[(b, kv, t)] for t in range(splits)}, (b, kv, s)


def test_embedding_and_argmax_regions_tile_their_buffers():
    rows, vocab, hidden = 3, 100, 40
    g = TaskGraph()
    g.buffer("ids", torch.zeros(rows, dtype=torch.int32)), g.buffer("table", torch.zeros(vocab, hidden))
    g.buffer("x", torch.zeros(rows, hidden)), g.buffer("logits", torch.zeros(rows, vocab))
    g.buffer("pv", torch.zeros(rows, 7)), g.buffer("pi", torch.zeros(rows, 7, dtype=torch.int32))
    g.buffer("val", torch.zeros(rows))
    emb = make_op("embedding", rows=rows, vocab=vocab, hidden=hidden, block_h=16)
    part = make_op("argmax_partial", rows=rows, vocab=vocab, block_v=16)
    red = make_op("argmax_reduce", rows=rows, vocab=vocab, block_v=16)
    e = add_all(g, emb, ids="ids", table="table", out="x")
    p = add_all(g, part, logits="logits", part_val="pv", part_idx="pi")
    r = add_all(g, red, part_val="pv", part_idx="pi", out_idx="ids", out_val="val")  # ids fed back
    t = g.tasks
    assert (coverage(g, "x", [t[i] for i in e], "writes") == 1).all()
    assert (coverage(g, "table", [t[i] for i in e], "reads") == rows).all()  # any row: the id is runtime
    assert (coverage(g, "logits", [t[i] for i in p], "reads") == 1).all()
    for name in ("pv", "pi"):
        assert (coverage(g, name, [t[i] for i in p], "writes") == 1).all()
        assert (coverage(g, name, [t[i] for i in r], "reads") == 1).all()
    deps = g.dependencies()
    blocks = -(-hidden // 16)
    for row, i in enumerate(r):
        # Its row's 7 chunk partials, and (writing the ids) the embedding tasks that read ids[row].
        assert deps[i] == sorted(e[row * blocks:(row + 1) * blocks] + p[row * 7:(row + 1) * 7]), row


def test_bad_sizes_and_tiles_are_named():
    with pytest.raises(ValueError, match="multiple"):
        make_op("decode_attention_partial", batch=1, num_q_heads=6, num_kv_heads=4, head_dim=8, max_seq=8,
                num_splits=1)
    with pytest.raises(ValueError, match="block_n"):
        make_op("decode_attention_partial", batch=1, num_q_heads=4, num_kv_heads=4, head_dim=8, max_seq=8,
                num_splits=1, block_n=8)
    with pytest.raises(ValueError, match="even"):
        make_op("rope_kv", batch=1, num_q_heads=2, num_kv_heads=1, head_dim=7, max_seq=8)
    with pytest.raises(ValueError, match="block_v"):
        make_op("argmax_partial", rows=1, vocab=10, block_v=24)
    g = TaskGraph()
    g.buffer("o", torch.zeros(2, 4, 8)), g.buffer("l", torch.zeros(2, 4, 1)), g.buffer("y", torch.zeros(2, 32))
    g.add(make_op("decode_attention_merge", batch=2, num_q_heads=4, head_dim=8, num_splits=1),
          o_part="o", lse="l", out="y", b=0, q_head=4)
    with pytest.raises(ValueError, match="q_head=4"):
        g.dependencies()
    # A buffer whose 2-D view is not the one the regions are given in is refused by the VM.
    g = TaskGraph()
    g.buffer("o", torch.zeros(1, 2, 3, 8)), g.buffer("l", torch.zeros(1, 2, 3)), g.buffer("y", torch.zeros(1, 16))
    g.add(make_op("decode_attention_merge", batch=1, num_q_heads=2, head_dim=8, num_splits=3),
          o_part="o", lse="l", out="y", b=0, q_head=0)
    with pytest.raises(ValueError, match=r"o_part.*\[2, 24\]"):
        run_vm(lower(g, 1))


# --- a decoder layer, end to end -----------------------------------------------------------


class DecoderStep:
    """One decode step of a one-layer Llama-shaped model as a task graph, and its reference."""

    B, H, HQ, HKV, D, I, V, S_MAX, SPLITS = 2, 24, 4, 2, 8, 20, 50, 40, 3

    def __init__(self):
        B, H, HQ, HKV, D, I, V, S = self.B, self.H, self.HQ, self.HKV, self.D, self.I, self.V, self.S_MAX
        g = self.g = TaskGraph()
        qkv_n = (HQ + 2 * HKV) * D
        w = lambda n, k: torch.randn(n, k, device=DEV) / k**0.5  # noqa: E731
        nw = lambda n: 1 + 0.1 * torch.randn(n, device=DEV)  # noqa: E731
        self.weights = {"emb": torch.randn(V, H, device=DEV), "ln1": nw(H), "wqkv": w(qkv_n, H),
                        "inv_freq": rope_inv_freq(D, 10000.0).to(DEV), "wo": w(H, HQ * D), "ln2": nw(H),
                        "wg": w(I, H), "wu": w(I, H), "wd": w(H, I), "lnf": nw(H), "wlm": w(V, H)}
        for name, t in self.weights.items():
            if name not in ("wg", "wu"):
                g.buffer(name, t)
        g.buffer("wgu", interleave_gate_up(self.weights["wg"], self.weights["wu"]))
        g.buffer("ids", torch.zeros(B, dtype=torch.int32, device=DEV))
        g.buffer("pos", torch.zeros(B, dtype=torch.int32, device=DEV))
        # Caches: a random prefix per sequence, NaN past it (never read before it is written).
        kc, vc = torch.randn(B, HKV, S, D, device=DEV), torch.randn(B, HKV, S, D, device=DEV)
        self.prefix = [20, 37]
        for b, n in enumerate(self.prefix):
            kc[b, :, n:], vc[b, :, n:] = float("nan"), float("nan")
        self.cache0 = (kc.clone(), vc.clone())
        g.buffer("kc", kc), g.buffer("vc", vc)
        self.outputs = {"x": (B, H), "xn": (B, H), "qkv": (B, qkv_n), "q": (B, HQ * D),
                        "o_part": (B, HQ, self.SPLITS * D), "lse": (B, HQ, self.SPLITS), "attn": (B, HQ * D),
                        "h1": (B, H), "h1n": (B, H), "act": (B, I), "ws": (2, B, H), "h2": (B, H), "h2n": (B, H),
                        "logits": (B, V), "pv": (B, -(-V // 16)), "next_val": (B,)}
        for name, shape in self.outputs.items():
            g.buffer(name, nan(*shape))
        g.buffer("seqlens", torch.zeros(B, dtype=torch.int32, device=DEV))
        g.buffer("pi", torch.zeros(B, -(-V // 16), dtype=torch.int32, device=DEV))
        g.buffer("next_ids", torch.full((B,), -1, dtype=torch.int64, device=DEV))

        rms = make_op("rmsnorm", n=H, eps=EPS)
        add_all(g, make_op("embedding", rows=B, vocab=V, hidden=H, block_h=16), ids="ids", table="emb", out="x")
        for a in op_tiles(rms, B):
            g.add(rms, x="x", w="ln1", out="xn", **a)
        add_all(g, make_op("linear", M=B, N=qkv_n, K=H, block_n=32, dtype=F32), x="xn", w="wqkv", out="qkv")
        add_all(g, make_op("rope_kv", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_seq=S),
                qkv="qkv", pos="pos", inv_freq="inv_freq", q="q", k_cache="kc", v_cache="vc", seqlens="seqlens")
        add_all(g, make_op("decode_attention_partial", batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                           max_seq=S, num_splits=self.SPLITS, block_n=16),
                q="q", k_cache="kc", v_cache="vc", seqlens="seqlens", o_part="o_part", lse="lse")
        add_all(g, make_op("decode_attention_merge", batch=B, num_q_heads=HQ, head_dim=D, num_splits=self.SPLITS),
                o_part="o_part", lse="lse", out="attn")
        add_all(g, make_op("linear", M=B, N=H, K=HQ * D, residual=True, dtype=F32), x="attn", w="wo", res="x",
                out="h1")
        for a in op_tiles(rms, B):
            g.add(rms, x="h1", w="ln2", out="h1n", **a)
        add_all(g, make_op("linear", M=B, N=2 * I, K=H, silu_mul=True, block_n=16, dtype=F32), x="h1n", w="wgu",
                out="act")
        part = make_op("linear_partial", M=B, N=H, K=I, split_k=2, block_k=16, dtype=F32)
        red = make_op("linear_reduce", M=B, N=H, K=I, split_k=2, block_k=16, residual=True, dtype=F32)
        add_all(g, part, x="act", w="wd", ws="ws")
        add_all(g, red, ws="ws", res="h1", out="h2")
        for a in op_tiles(rms, B):
            g.add(rms, x="h2", w="lnf", out="h2n", **a)
        add_all(g, make_op("linear", M=B, N=V, K=H, block_n=16, dtype=F32), x="h2n", w="wlm", out="logits")
        add_all(g, make_op("argmax_partial", rows=B, vocab=V, block_v=16), logits="logits", part_val="pv",
                part_idx="pi")
        add_all(g, make_op("argmax_reduce", rows=B, vocab=V, block_v=16), part_val="pv", part_idx="pi",
                out_idx="next_ids", out_val="next_val")

    def start(self, ids, positions, cache) -> None:
        """Reset every output to NaN and the caches to ``cache``; set this step's ids and positions."""
        for name in self.outputs:
            self.g.buffers[name].fill_(float("nan"))
        self.g.buffers["next_ids"].fill_(-1), self.g.buffers["seqlens"].zero_()
        self.g.buffers["kc"].copy_(cache[0]), self.g.buffers["vc"].copy_(cache[1])
        self.g.buffers["ids"].copy_(torch.tensor(ids)), self.g.buffers["pos"].copy_(torch.tensor(positions))

    def reference(self, ids, positions, cache) -> dict:
        """The step op by op with mk.tasks' references; the caches after it under 'kc'/'vc'."""
        B, HQ, HKV, D = self.B, self.HQ, self.HKV, self.D
        w = self.weights
        ids, pos = torch.tensor(ids, device=DEV), torch.tensor(positions, device=DEV)
        r = {"x": embedding_ref(ids, w["emb"])}
        r["xn"] = rmsnorm_ref(r["x"], w["ln1"], EPS)
        r["qkv"] = linear_ref(r["xn"], w["wqkv"])
        q, k, v = r["qkv"].view(B, 1, HQ + 2 * HKV, D).split([HQ, HKV, HKV], dim=2)
        q_rot, r["kc"], r["vc"] = rope_kv_ref(q, k, v, pos.view(B, 1), w["inv_freq"], *cache)
        r["q"] = q_rot.reshape(B, HQ * D)
        r["seqlens"] = pos + 1
        r["attn"] = decode_attention_ref(q_rot.view(B, HQ, D), r["kc"], r["vc"], r["seqlens"]).reshape(B, HQ * D)
        r["h1"] = linear_ref(r["attn"], w["wo"], residual=r["x"])
        r["h1n"] = rmsnorm_ref(r["h1"], w["ln2"], EPS)
        gu = interleave_gate_up(w["wg"], w["wu"])
        r["act"] = linear_ref(r["h1n"], gu, silu_mul=True)
        r["h2"] = linear_ref(r["act"], w["wd"], residual=r["h1"])
        r["h2n"] = rmsnorm_ref(r["h2"], w["lnf"], EPS)
        r["logits"] = linear_ref(r["h2n"], w["wlm"])
        r["next_ids"] = argmax_ref(r["logits"])
        return r

    def check(self, ref: dict, what: str) -> None:
        b = self.g.buffers
        for name in ("x", "xn", "qkv", "q", "attn", "h1", "h1n", "act", "h2", "h2n", "logits"):
            assert_close(b[name], ref[name], F32, f"{what}: {name}")
        for name in ("kc", "vc"):
            # NaN exactly where the reference has it (rows never written), close elsewhere.
            hole = torch.isnan(ref[name])
            assert torch.equal(torch.isnan(b[name]), hole), f"{what}: {name} rows"
            assert_close(b[name][~hole], ref[name][~hole], F32, f"{what}: {name}")
        assert b["seqlens"].tolist() == ref["seqlens"].tolist(), what
        assert b["next_ids"].tolist() == ref["next_ids"].tolist(), f"{what}: next token"
        assert torch.equal(b["next_val"], b["logits"][torch.arange(self.B), ref["next_ids"]]), what

    def steps(self):
        """Two steps: (ids, positions, cache before) each; the second advances the positions by one."""
        ids1 = torch.randint(0, self.V, (self.B,)).tolist()
        ids2 = torch.randint(0, self.V, (self.B,)).tolist()
        ref1 = self.reference(ids1, self.prefix, self.cache0)
        return [(ids1, list(self.prefix), self.cache0, ref1),
                (ids2, [p + 1 for p in self.prefix], (ref1["kc"], ref1["vc"]), None)]


def test_decoder_layer_megakernel_two_launches():
    step = DecoderStep()
    ops = {t.op.name for t in step.g.tasks}
    assert {"embedding", "rmsnorm", "linear", "rope_kv", "decode_attention_partial", "decode_attention_merge",
            "linear_partial", "linear_reduce", "argmax_partial", "argmax_reduce"} <= ops
    kernel = Megakernel(lower(step.g, num_workers=1))
    (ids1, pos1, cache1, ref1), (ids2, pos2, _, _) = step.steps()
    step.start(ids1, pos1, cache1)
    kernel.run()
    step.check(ref1, "launch 1")
    # Launch 2 straight on the state launch 1 left (its cache rows included): only the
    # positions advance and new token ids come in. Nothing is re-lowered or re-uploaded.
    ref2 = step.reference(ids2, pos2, (ref1["kc"], ref1["vc"]))
    step.g.buffers["pos"] += 1
    step.g.buffers["ids"].copy_(torch.tensor(ids2))
    kernel.run()
    step.check(ref2, "launch 2")
    assert int(kernel.state[0]) == 2


@pytest.mark.parametrize("workers", [1, 3, 16])
def test_decoder_layer_vm_many_workers(workers, _seed):
    step = DecoderStep()
    steps = step.steps()
    ref2 = step.reference(steps[1][0], steps[1][1], steps[1][2])
    for trial, schedule in enumerate(SCHEDULES):
        program = lower(step.g, num_workers=workers, schedule=schedule)
        for (ids, pos, cache, _), ref in zip(steps, (steps[0][3], ref2)):
            step.start(ids, pos, cache)
            report = run_vm(program, interleave="random", seed=_seed + trial)
            assert sorted(report.order) == list(range(len(step.g.tasks)))
            step.check(ref, f"{workers} workers, {schedule}")


# --- compiled for the GPU ------------------------------------------------------------------


@pytest.mark.compile_script("_compile_sm90_model.py")
@pytest.mark.skipif(not can_compile_for_cuda(), reason="Triton's NVIDIA backend is not installed")
def test_decoder_megakernel_compiles_for_sm90_in_bf16(request, tmp_path):
    # The interpreter checks no types or layouts: a bf16 decoder-layer megakernel with every
    # op above must also compile for Hopper (run in a subprocess: the interpreter switch is
    # read when Triton decorates kernels).
    compile_script_ok(request, tmp_path)
