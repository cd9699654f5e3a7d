"""A linear's weight format (mk.tasks.linear.format): FP8 values with scales per output channel
or per row and 128 columns, applied by every body that multiplies (the standalone op, the
megakernel's GEMV streams, runs, grouped streams, split-K partials, tensor-core tiles, the
fused QKV + RoPE tiles) against torch's product of the dequantized weight. On the CPU the FP8
values are held in float32: the same code path, exact."""

from dataclasses import replace

import pytest
import torch

from mk.models.blocks import ModelShape, decode_graph
from mk.persistent.graph import TaskGraph, lower
from mk.persistent.runtime import Megakernel
from mk.planner.cost import phase_costs
from mk.planner.device import DeviceSpec
from mk.planner.search import search
from mk.tasks import OpChoice, default_device, make_op
from mk.tasks.linear import X_GROUP, linear, linear_ref, linear_tiles
from mk.tasks.linear.format import FP8_BLOCK, FP8_CHANNEL, FP8_MAX, PLAIN, weight_format
from mk.tasks.linear.planning import one_byte_x_floor
from tests.conftest import assert_close
from tests.persistent._helpers import can_compile_for_cuda, compile_script_ok

F32 = torch.float32
EPS = 1e-5
FORMATS = [pytest.param(FP8_CHANNEL, id="channel"), pytest.param(FP8_BLOCK, id="block")]
#: How the FP8 values are stored: as float8_e4m3fn (what a GPU runs: GEMV tiles widen them to
#: float32, tensor-core tiles to float16; the interpreter runs the same code), and
#: on the CPU also as float32 holding them (what a model keeps there).
STORAGE = [pytest.param(torch.float8_e4m3fn, id="e4m3"),
           pytest.param(F32, id="f32", marks=pytest.mark.skipif(default_device().type == "cuda", reason="CPU"))]


def _quantized(fmt, N, K, storage=torch.float8_e4m3fn):
    """(q, scale, the dequantized float32 weight) of a random [N, K] weight, q stored as ``storage``."""
    q, scale = fmt.quantize(torch.randn(N, K) / K**0.5)
    dev = default_device()
    return q.to(dev, storage), scale.to(dev), fmt.dequantize(q, scale).to(dev)


# --------------------------------------------------------------------------- the format


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_values_are_e4m3_and_dequantize_close_to_the_weight(fmt):
    w = torch.randn(300, 260) * torch.logspace(-3, 1, 300)[:, None]   # rows of very different ranges
    q, scale = fmt.quantize(w)
    assert torch.equal(q, q.to(torch.float8_e4m3fn).float())          # e4m3 values, held exactly
    assert q.abs().max() <= FP8_MAX and tuple(scale.shape) == fmt.scale_shape(300, 260)
    back = fmt.dequantize(q, scale)
    assert ((back - w).norm(dim=1) / w.norm(dim=1)).max() < 0.04     # e4m3: 3 mantissa bits, a row at a time
    assert fmt.nbytes(300, 260, 2) == 300 * 260 + scale.numel() * 4 < PLAIN.nbytes(300, 260, 2) / 1.9


def test_block_scales_follow_their_rows_blocks_of_128():
    w = torch.randn(260, 300)
    w[:128, 128:256] *= 100   # one block much larger: only its rows' scales of those columns grow
    q, scale = FP8_BLOCK.quantize(w)
    assert scale.shape == (260, 3) and (scale[:128, 1] > 50 * scale[:128, 0]).all()
    assert torch.equal(scale[:128], scale[:1].expand(128, 3)) and torch.equal(scale[128:256], scale[128:129].expand(128, 3))


@pytest.mark.parametrize("scale,message", [
    (None, "needs its scales"), (torch.ones(7), r"scales of shape \(7,\), expected \(8,\)"),
    (torch.tensor([1.0] * 7 + [float("nan")]), "finite and > 0"), (torch.zeros(8), "finite and > 0"),
])
def test_bad_scales_are_named(scale, message):
    with pytest.raises(ValueError, match=message):
        FP8_CHANNEL.check_scale("model.layers.0.mlp.up_proj.weight", (8, 16), scale)
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        weight_format("int3")


# --------------------------------------------------------------------------- the standalone op


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M,N,K,kw", [(1, 37, 200, {}), (3, 74, 260, {"silu_mul": True}), (5, 40, 384, {"split_k": 3}),
                                      (2, 24, 130, {"residual": True})])
def test_the_op_multiplies_the_dequantized_weight(fmt, M, N, K, kw, storage):
    q, scale, w = _quantized(fmt, N, K, storage)
    x, g = torch.randn(M, K, device=q.device), 1 + 0.1 * torch.randn(K, device=q.device)
    res = torch.randn(M, N, device=q.device) if kw.pop("residual", False) else None
    y = linear(x, q, weight_scale=scale, norm_weight=g, norm_eps=EPS, residual=res, **kw)
    kw.pop("split_k", None)
    assert_close(y, linear_ref(x, w, norm_weight=g, norm_eps=EPS, residual=res, **kw), F32)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(" + str(N)):
        linear(x, q, weight_scale=scale[:-1])


# --------------------------------------------------------------------------- the megakernel's tiles


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tma,norm,run", [(0, False, 1), (3, False, 1), (3, True, 2), (0, True, 2)])
def test_gemv_streams_apply_the_format(fmt, tma, norm, run, storage):
    """GEMV tiles (register path or TMA ring, a run of tiles a task, an RMSNorm prologue): a
    ragged last chunk, a clipped last tile, rows of several 128-row blocks."""
    dev = default_device()
    N, K = 140, 208
    q, scale, w = _quantized(fmt, N, K, storage)
    g = TaskGraph()
    g.buffer("x", torch.randn(1, K, device=dev) * 3), g.buffer("w", q), g.buffer("s", scale)
    g.buffer("g", torch.rand(K, device=dev) + 0.5), g.buffer("y", torch.full((1, N), float("nan"), device=dev))
    op = make_op("linear", M=1, N=N, K=K, block_n=16, block_k=64, tma_stages=tma, norm=norm, eps=EPS, dtype=q.dtype,
                 tiles_per_task=run, w_scale=fmt.scale_code)
    assert op.constexprs["W_SCALE"] == fmt.scale_code and "w_scale" in op.operands
    for a in linear_tiles(op):
        g.add(op, x="x", w="w", w_scale="s", out="y", **({"norm_w": "g"} if norm else {}), **a)
    Megakernel(lower(g, 1)).run()
    norm_kw = dict(norm_weight=g.buffers["g"], norm_eps=EPS) if norm else {}
    assert_close(g.buffers["y"], linear_ref(g.buffers["x"], w, **norm_kw), F32)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_streams_split_k_and_tensor_core_tiles_apply_the_format(fmt, storage):
    """A grouped GEMV stream that waits for x inside it, split-K partials (finished by the
    format, then summed by the reduce) and decode tensor-core tiles (3 rows, weight-major and
    x-major boxes) all equal torch's chain over the dequantized weights."""
    dev, ring = default_device(), 1 + 2 * X_GROUP
    K1, N1, N2, N3 = 64 * X_GROUP, 136, 48, 130
    (q1, s1, w1), (q2, s2, w2), (q3, s3, w3) = (_quantized(fmt, n, k, storage)
                                                for n, k in ((N1, K1), (N2, N1), (N3, N2)))
    g = TaskGraph()
    for name, t in (("x", torch.randn(1, K1)), ("w1", q1), ("s1", s1), ("h", torch.full((1, N1), float("nan"))),
                    ("w2", q2), ("s2", s2), ("ws", torch.zeros(2, 1, N2)), ("z", torch.full((1, N2), float("nan"))),
                    ("x3", torch.randn(3, N2)), ("w3", q3), ("s3", s3), ("y", torch.full((3, N3), float("nan")))):
        g.buffer(name, t.to(dev))
    c, wt = fmt.scale_code, q1.dtype
    grouped = make_op("linear", M=1, N=N1, K=K1, block_n=16, block_k=32, tma_stages=ring, tiles_per_task=3,
                      dtype=wt, w_scale=c)
    part = make_op("linear_partial", M=1, N=N2, K=N1, split_k=2, block_n=32, block_k=32, dtype=wt, w_scale=c)
    red = make_op("linear_reduce", M=1, N=N2, K=N1, split_k=2, block_n=32, block_k=32, dtype=F32)
    dot = make_op("linear", M=3, N=N3, K=N2, block_n=128, block_k=16, tma_stages=3, dtype=wt, w_scale=c)
    assert grouped.waits_in_body and grouped.constexprs["X_GROUP"] == X_GROUP
    for a in linear_tiles(grouped):
        g.add(grouped, x="x", w="w1", w_scale="s1", out="h", **a)
    for a in linear_tiles(part):
        g.add(part, x="h", w="w2", w_scale="s2", ws="ws", **a)
    for a in linear_tiles(red):
        g.add(red, ws="ws", out="z", **a)
    for a in linear_tiles(dot):
        g.add(dot, x="x3", w="w3", w_scale="s3", out="y", **a)
    Megakernel(lower(g, 1)).run()
    b = g.buffers
    h = linear_ref(b["x"], w1)
    assert_close(b["h"], h, F32)
    assert_close(b["z"], linear_ref(h, w2), F32)
    assert_close(b["y"], linear_ref(b["x3"], w3), F32)


def test_a_block_scaled_tile_needs_chunks_within_one_block():
    with pytest.raises(ValueError, match="block_k dividing 128, got 256"):
        make_op("linear", M=1, N=64, K=512, block_n=16, block_k=256, dtype=F32, w_scale=2)


@pytest.mark.compile_script("../tasks/_compile_sm90_fp8.py")
@pytest.mark.skipif(not can_compile_for_cuda(), reason="Triton's NVIDIA backend is not installed")
def test_fp8_tiles_compile_for_sm90(request, tmp_path):
    # The interpreter holds FP8 in float32: only a compile sees the e4m3 loads and conversions.
    compile_script_ok(request, tmp_path)


# --------------------------------------------------------------------------- planning


def _fp8_graph(name, batch=1):
    """The decode graph of preset ``name`` with its projections and LM head in FP8."""
    return decode_graph(replace(ModelShape.preset(name), linear_format="fp8", lm_head_format="fp8"), batch, 1024)


def test_fp8_gemv_boxes_are_priced_by_their_x_reads_as_measured():
    """A batch-1 FP8 GEMV chunk's x reads, not its bytes, set its time while two workers share
    an SM (FP8 probe, H200, 264 workers, fraction of the copy bandwidth): 16 x 256 boxes 0.54-0.60,
    32 x 256 0.92-0.98, 64 x 256 0.98-1.02. One worker an SM is left to the ring's own limits,
    and 16-bit weights and batch 8 are priced as before."""
    h200 = DeviceSpec.preset("h200")
    gate_up = _fp8_graph("llama-3-8b").node("l0.gate_up")  # 28672 x 4096: 1792, 896, 448 tasks

    def fraction(block_n):
        """What 264 workers streaming such tasks reach, over the copy bandwidth."""
        task = phase_costs(gate_up, OpChoice(block_n=block_n, block_k=256, tma_stages=4), h200, 264)[0]
        return block_n * 4096 * 264 / (task.task_s - h200.task_overhead_s) / h200.dram_bandwidth

    assert 0.45 < fraction(16) < 0.7
    assert fraction(32) > 0.85 and fraction(64) > 0.85
    assert fraction(32) > 1.4 * fraction(16)
    # No two busy workers on an SM (few tasks, or one worker an SM): no x floor.
    box = OpChoice(block_n=16, block_k=256, tma_stages=4)
    assert one_byte_x_floor(gate_up, box, h200, 132) == 0 < one_byte_x_floor(gate_up, box, h200, 264)
    plain = decode_graph(ModelShape.preset("llama-3-8b"), 1, 1024).node("l0.gate_up")  # 16-bit
    for node in (plain, _fp8_graph("llama-3-8b", batch=8).node("l0.gate_up")):
        assert one_byte_x_floor(node, OpChoice(block_n=16, block_k=256, tma_stages=4), h200, 264) == 0


def test_fp8_batch1_projections_are_planned_with_boxes_of_32_rows_or_more():
    """Where 32-row boxes fit, the 8B FP8 step plans none narrower at batch 1: a 16-row box
    streams at 0.6 of the copy bandwidth with 264 workers, a 32-row one at 0.98."""
    g = _fp8_graph("llama-3-8b")
    plan = search(g, DeviceSpec.preset("h200"), top_k=1)[0]
    rows = {n: c.block_n for n, c in plan.choices.items() if g.node(n).kind == "linear"}
    assert rows and min(rows.values()) >= 32, rows
