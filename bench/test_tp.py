"""Tensor-parallel decode on the GPUs of one machine (2 or 4): what users get, against one
GPU and against a gpt-fast-style TP peer, all in the same run.

Every figure comes from fresh processes (``bench/_tp_run.py``, under torchrun for TP): the
8B shape over 2 (and 4) GPUs and on one, batch 1 and 8, through ``generate`` (tokens/s, time
to first token, memory beyond weights + KV cache), the step launched back to back (the
kernel's time against the per-GPU floor: one GPU's share of the weights over the copy
bandwidth), the peer (torch.compile(mode="reduce-overhead") with functional all-reduces,
the same shares), the GPU link calibrated, and the numerics (greedy tokens on a float32
cache, the prefill's logits); the 70B shape over the most GPUs (up to 4) where it fits; and
a 1B checkpoint from
``from_pretrained(tp=N)`` to the first token, with cold and warm caches. Where the machine
has a GPU more than the first TP run takes, the one-GPU run goes there at the same time
(the two share no GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _llama_shapes import SHAPES, TP_SHAPES, random_model

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "_tp_run.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
#: Ranks of the tensor-parallel runs: 2, and 4 where the machine has them.
TP_RANKS = [n for n in (2, 4) if n <= GPUS] or [2]
PROMPT, NEW = 64, 256

pytestmark = pytest.mark.skipif(GPUS < 2, reason="tensor parallelism needs at least 2 GPUs")


def _launch(spec: dict, ranks: int, out: Path, gpu: int | None = None,
            env: dict | None = None) -> subprocess.Popen:
    """Start ``bench/_tp_run.py`` over ``ranks`` processes (one GPU each: the first ``ranks``
    GPUs, or GPU ``gpu`` alone). Its output goes to OUT.log (a pipe left unread while
    another run goes on could fill and stop it)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
                if ranks > 1 else [sys.executable])
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if gpu is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(launcher + [str(WORKER), json.dumps({"prompt": PROMPT, "new": NEW, **spec}), str(out)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _finish(run: subprocess.Popen, out: Path, timeout: int = 900) -> dict:
    """Wait (bounded) for a run of :func:`_launch`; rank 0's figures."""
    try:
        run.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        raise AssertionError(f"bench/_tp_run.py ran past {timeout} s", Path(f"{out}.log").read_text()[-6000:]) from None
    assert run.returncode == 0, Path(f"{out}.log").read_text()[-6000:]
    return json.loads(out.read_text())


def _run(spec: dict, ranks: int, out: Path, env: dict | None = None) -> dict:
    """``bench/_tp_run.py`` over ``ranks`` processes (one GPU each); rank 0's figures."""
    return _finish(_launch(spec, ranks, out, env=env), out)


def _rows(result: dict) -> dict[int, dict]:
    return {int(b): row for b, row in result["batches"].items()}


SPEC_8B = dict(shape="8b", batches=[1, 8], peer_batches=[1, 8], check=True)
#: One GPU's run: the 8B shape without its own peer (the single-GPU peer is the llama and
#: generate suites'), so that on a 2-GPU machine, where it cannot run beside TP's, the two
#: runs end within one device call.
ONE_GPU_8B = {**SPEC_8B, "peer_batches": []}


class _OneGpu:
    """The 8B shape on one GPU of the machine, run once for the module: on a GPU the first
    TP run leaves free, while it runs (the runs share no GPU), or else before it."""

    def __init__(self, folder: Path):
        self.folder, self.run, self.figures = folder, None, None

    def _launch(self, gpu: int) -> subprocess.Popen:
        return _launch(ONE_GPU_8B, 1, self.folder / "one.json", gpu=gpu)

    def start(self, ranks: int) -> None:
        """Before a TP run over ``ranks`` GPUs: start on the last GPU where that run leaves it
        free; where it does not, finish a run started before."""
        if ranks < GPUS:
            if self.run is None and self.figures is None:
                self.run = self._launch(GPUS - 1)
        elif self.run is not None:
            self.result()

    def result(self) -> tuple[dict, Path]:
        """(figures, folder of its logits)."""
        if self.figures is None:
            run, self.run = self.run or self._launch(0), None
            self.figures = _finish(run, self.folder / "one.json")
        return self.figures, self.folder


@pytest.fixture(scope="module")
def one_gpu_8b(tmp_path_factory):
    one = _OneGpu(tmp_path_factory.mktemp("one-gpu"))
    yield one
    if one.run is not None:
        one.run.kill()
        one.run.wait()


@pytest.mark.parametrize("ranks", TP_RANKS)
def test_tp_decode_8b(record, tmp_path, one_gpu_8b, ranks):
    """8B shape: TP over ``ranks`` GPUs against one GPU and the peer; TP's greedy tokens equal
    one GPU's for 32 steps on a float32 cache, and its prefill logits agree to bf16 tolerance."""
    one_gpu_8b.start(ranks)
    tp = _run({**SPEC_8B, "link": True, "ablate": True}, ranks, tmp_path / "tp.json")
    one, one_dir = one_gpu_8b.result()
    same = sum(a == b for a, b in zip(tp["check_tokens"], one["check_tokens"]))
    # bf16 logits: TP's and one GPU's, each against one GPU's exact float32 prefill (TP adds
    # its ranks' partial sums in float32 where one GPU rounds each projection to bf16).
    a, b = torch.load(tmp_path / "tp.json.logits.pt"), torch.load(one_dir / "one.json.logits.pt")
    exact = torch.load(one_dir / "one.json.exact.pt")
    scale = exact.abs().max()
    tp_err, one_err = float((a - exact).abs().max() / scale), float((b - exact).abs().max() / scale)
    record("tp-decode", op="link", ranks=ranks, link_latency_s=tp["link_latency_s"],
           link_crowd_s=tp["link_crowd_s"], link_bandwidth=tp["link_bandwidth"])
    record("tp-decode", op="numerics", model="8b", ranks=ranks, tokens_equal_of_32=same,
           tp_logits_max_rel_err=tp_err, one_gpu_logits_max_rel_err=one_err,
           tp_vs_one_gpu_logits_max_rel_diff=float((a - b).abs().max() / scale),
           logits_argmax_equal=bool(a.argmax() == b.argmax() == exact.argmax()))
    for batch, row in _rows(tp).items():
        base = _rows(one)[batch]
        record("tp-decode", op="decode", model="8b", ranks=ranks, batch=batch, **row, floor_ms=tp["floor_ms"],
               kernel_of_floor=tp["floor_ms"] / row["kernel_ms_per_step"],
               vs_torch_compile=row["torch_compile_ms"] / row["generate_ms_per_token"],
               one_gpu_tokens_per_s=base["tokens_per_s"], one_gpu_kernel_ms=base["kernel_ms_per_step"],
               one_gpu_time_to_first_token_ms=base["time_to_first_token_ms"],
               vs_one_gpu=row["tokens_per_s"] / base["tokens_per_s"], copy_Bps=tp["copy_Bps"])
    assert same == 32, (tp["check_tokens"], one["check_tokens"])
    # The float32 reference itself: one GPU's bf16 logits sit a few percent from it.
    assert one_err < 0.2, one_err
    assert tp_err <= 1.5 * one_err, (tp_err, one_err)  # within one GPU's own bf16 error


@pytest.mark.parametrize("key", list(TP_SHAPES))
def test_tp_decode_large(record, tmp_path, key):
    """A model too large for one GPU (70B) over the most GPUs (up to 4), batch 1 and 8,
    against the peer at batch 1, and the step with its all-reduces in tiles of their own."""
    from mk.models import LlamaConfig

    ranks = max(TP_RANKS)
    share = LlamaConfig(**TP_SHAPES[key]).to_model_shape().shard(ranks).weight_bytes
    free = min(torch.cuda.mem_get_info(i)[0] for i in range(ranks))
    if share + 12 * 2**30 > free:
        pytest.skip(f"{key} over {ranks} GPUs needs {share / 2**30:.0f} GiB of weights a GPU; "
                    f"{free / 2**30:.0f} GiB are free")
    tp = _run(dict(shape=key, batches=[1, 8], peer_batches=[1], ablate=True), ranks, tmp_path / "tp.json")
    rows = _rows(tp)
    for batch, row in rows.items():
        record("tp-large", op="decode", model=key, ranks=ranks, batch=batch, **row, floor_ms=tp["floor_ms"],
               kernel_of_floor=tp["floor_ms"] / row["kernel_ms_per_step"],
               generate_of_floor=tp["floor_ms"] / row["generate_ms_per_token"],
               vs_torch_compile=(row["torch_compile_ms"] / row["generate_ms_per_token"]
                                 if "torch_compile_ms" in row else None),
               b8_over_b1=row["generate_ms_per_token"] / rows[1]["generate_ms_per_token"], copy_Bps=tp["copy_Bps"])


def test_tp_time_to_first_token(record, tmp_path_factory):
    """From ``from_pretrained(folder, tp=N)`` to the first token (1B checkpoint on local
    disk), in fresh processes: cold caches (plan, kernel, Triton), then warm."""
    from mk.models import LlamaConfig
    from mk.models.weights import save_weights

    folder = tmp_path_factory.mktemp("ckpt-1b")
    cfg = LlamaConfig(**SHAPES["1b"])
    weights = random_model(cfg)
    save_weights(weights, cfg, folder, shard_bytes=4 * 2**30)
    del weights
    torch.cuda.empty_cache()
    caches = tmp_path_factory.mktemp("caches")
    env = {"MK_CACHE_DIR": str(caches / "mk"), "TRITON_CACHE_DIR": str(caches / "triton")}
    for state in ("cold", "warm"):
        got = _run({"first_token": str(folder)}, max(TP_RANKS), folder / f"{state}.json", env=env)
        record("tp-first-token", op="time_to_first_token", model="1b", ranks=max(TP_RANKS), caches=state,
               **{k: v for k, v in got.items() if k not in ("ranks", "device")})
