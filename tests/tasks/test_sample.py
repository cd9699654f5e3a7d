import importlib
import math

import pytest
import torch

from mk.tasks import TaskCost
from mk.tasks.argmax import argmax_ref
from mk.tasks.sample import (
    gumbel_noise, sample, sample_allowed, sample_allowed_ref, sample_cost, sample_num_passes, sample_ref,
    sample_smem_bytes, sample_workspace, scale_logits_ref,
)
from tests.conftest import DTYPES

sample_mod = importlib.import_module("mk.tasks.sample")  # the module: mk.tasks.sample is the op

#: Chance that a statistical test fails although the sampler is right (union bound).
FALSE_ALARM = 1e-9


def _critical_top_p(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """The top_p values at which a row's nucleus changes: its cumulative sorted probabilities."""
    z = scale_logits_ref(logits.float(), temperature)
    allowed = sample_allowed_ref(logits, temperature, top_k, None)
    p = torch.softmax(torch.where(allowed, z, float("-inf")).double(), dim=-1)
    return torch.sort(p, dim=-1, descending=True).values.cumsum(-1).flatten().cpu()


def _safe_top_p(logits, temperature, top_k, target, margin=2e-5) -> float:
    """A top_p near ``target`` at least ``margin`` away from every row's critical values.

    The kernel sums probabilities in float32 (with the GPU's approximate exp) and the
    reference in float64; away from the critical values both give the same set. The
    float32 mass is off by a few 1e-6 at most here (ex2.approx plus the rounding of
    z - z_max, and tree sums of <= 1024 terms), well inside the margin.
    """
    crit = _critical_top_p(logits, temperature, top_k)
    cands = torch.linspace(target - 0.05, target + 0.05, 2001, dtype=torch.float64)
    dist = (cands[:, None] - crit[None, :]).abs().min(dim=1).values
    best = int(dist.argmax())
    assert dist[best] >= margin, "no top_p with a safe margin; change the target"
    return float(cands[best])


def _binomial_bounds(n: int, q: float, alpha: float) -> tuple[int, int]:
    """[lo, hi] with P(X < lo) <= alpha/2 and P(X > hi) <= alpha/2 for X ~ Binomial(n, q), exactly."""
    if q <= 0.0:
        return 0, 0
    if q >= 1.0:
        return n, n
    x = torch.arange(n + 1, dtype=torch.float64)
    logpmf = (math.lgamma(n + 1) - torch.lgamma(x + 1) - torch.lgamma(n - x + 1)
              + x * math.log(q) + (n - x) * math.log1p(-q))
    pmf = logpmf.exp()
    below = pmf.cumsum(0) - pmf                  # P(X < x)
    above = pmf.flip(0).cumsum(0).flip(0) - pmf  # P(X > x)
    lo = int((below <= alpha / 2).nonzero().max())
    hi = int((above <= alpha / 2).nonzero().min())
    return lo, hi


def _assert_frequencies(tokens: torch.Tensor, expected: torch.Tensor, what: str):
    """Counts of each token within exact binomial bounds; FALSE_ALARM split over the tokens."""
    n, v = tokens.numel(), expected.numel()
    counts = torch.bincount(tokens.cpu(), minlength=v)
    assert counts.numel() == v, f"{what}: token out of range"
    for tok in range(v):
        lo, hi = _binomial_bounds(n, float(expected[tok]), FALSE_ALARM / v)
        assert lo <= counts[tok] <= hi, (
            f"{what}: token {tok} drawn {int(counts[tok])} times of {n}, expected p={float(expected[tok]):.4f} "
            f"-> [{lo}, {hi}]; counts {counts.tolist()}")


def _restricted_softmax(logits, temperature, top_k, top_p) -> torch.Tensor:
    """softmax(logits / T) restricted to the allowed set and renormalised (float64)."""
    allowed = sample_allowed_ref(logits[None], temperature, top_k, top_p)[0]
    z = logits.double() / temperature
    p = torch.softmax(torch.where(allowed, z, float("-inf")), dim=-1)
    return p


# --------------------------------------------------------------------------------------------
# Exactness: allowed sets and tokens equal the sort-based reference

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, v, block_v, temperature, top_k, top_p, radix_bits", [
    (3, 1000, None, 1.0, 50, None, 4),
    (3, 1000, None, 0.5, None, 0.9, 4),
    (3, 1000, None, 2.0, 100, 0.8, 4),
    (3, 777, 256, 0.5, 40, 0.7, 8),      # odd V, 4 chunks
    (2, 200, 64, 1.3, 5, 0.6, 2),        # 16 passes per threshold
    (2, 300, None, 1.0, 300, 1.0, 4),    # top_k = V and top_p = 1 keep everything
])
def test_allowed_set_matches_reference(rows, v, block_v, temperature, top_k, top_p, radix_bits, dtype, device):
    logits = (2 * torch.randn(rows, v, device=device)).to(dtype)
    if top_p is not None and top_p < 1:
        top_p = _safe_top_p(logits, temperature, top_k, top_p)
    got = sample_allowed(logits, temperature=temperature, top_k=top_k, top_p=top_p, block_v=block_v,
                         radix_bits=radix_bits)
    ref = sample_allowed_ref(logits, temperature, top_k, top_p)
    assert got.shape == (rows, v) and got.dtype == torch.bool
    assert torch.equal(got.cpu(), ref.cpu()), f"allowed counts {got.sum(1).tolist()} vs {ref.sum(1).tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, v, block_v, temperature, top_k, top_p", [
    (3, 1000, None, 1.0, None, None),
    (3, 1000, None, 0.5, 50, None),
    (3, 1000, None, 2.0, None, 0.9),
    (3, 777, 256, 1.0, 100, 0.8),        # odd V, 4 chunks
])
def test_tokens_match_reference(rows, v, block_v, temperature, top_k, top_p, dtype, device):
    logits = (2 * torch.randn(rows, v, device=device)).to(dtype)
    if top_p is not None:
        top_p = _safe_top_p(logits, temperature, top_k, top_p)
    seed, offset = 1234 + v, 7
    got = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset,
                 block_v=block_v)
    noise = gumbel_noise(seed, offset, rows, v, device=device)
    ref = sample_ref(logits, temperature, top_k, top_p, noise)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), ref.cpu())


def test_select_loops_over_chunk_blocks(monkeypatch, device):
    # The select tile reads chunk histograms two at a time here: 5 chunks, 3 blocks.
    monkeypatch.setattr(sample_mod, "MAX_BLOCK_C", 2)
    logits = 2 * torch.randn(2, 300, device=device)
    top_p = _safe_top_p(logits, 1.0, 30, 0.8)
    got = sample_allowed(logits, top_k=30, top_p=top_p, block_v=64, radix_bits=8)
    assert torch.equal(got, sample_allowed_ref(logits, 1.0, 30, top_p))


def test_ties_at_the_thresholds_are_kept(device):
    v, rows = 40, 2
    logits = torch.full((rows, v), -2.0, device=device)
    logits[:, 0] = 3.0
    logits[:, [7, 20, 33]] = 1.0            # tied group
    logits[:, 39] = 0.0
    # top_k=2: the 2nd largest value, 1.0, is shared by three tokens: all four stay.
    expect_k = torch.zeros(v, dtype=torch.bool)
    expect_k[[0, 7, 20, 33]] = True
    got_k = sample_allowed(logits, top_k=2, block_v=16, radix_bits=8)
    assert torch.equal(got_k.cpu(), expect_k.expand(rows, v))
    # top_p just above p(token 0): the boundary falls inside the tied group, which stays whole.
    p0 = torch.softmax(logits[0].double(), -1)[0].item()
    got_p = sample_allowed(logits, top_p=p0 + 0.01, block_v=16, radix_bits=8)
    assert torch.equal(got_p.cpu(), expect_k.expand(rows, v))
    assert torch.equal(got_p.cpu(), sample_allowed_ref(logits, 1.0, None, p0 + 0.01).cpu())
    # ... and just below it only token 0 is left.
    assert sample_allowed(logits, top_p=p0 - 0.01, block_v=16, radix_bits=8).sum().item() == rows
    # Draws stay inside the set and replay the reference.
    for offset in range(2):
        tok = sample(logits, top_k=2, seed=3, offset=offset, block_v=16, radix_bits=8)
        assert expect_k[tok.cpu()].all()
        assert torch.equal(tok, sample_ref(logits, 1.0, 2, None, gumbel_noise(3, offset, rows, v, device=device)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_tokens_kept_when_the_reciprocal_is_inexact(dtype, device):
    # At T = 1.3, x * float32(1/T) is one ulp below x / T for about a quarter of all positive
    # x. torch on CUDA divides by a CPU scalar that way, and an allowed mask once built from
    # it dropped the tokens sitting exactly at a threshold (the kernels divide: z = x / T).
    # Put such an x, tied twice, at the top-k and at the top-p threshold: a deterministic
    # failure on a GPU for that bug, where random logits hit it only now and then.
    temperature, v = 1.3, 96
    t = torch.tensor(temperature, dtype=torch.float32)
    grid = 1 + torch.arange(128, dtype=torch.float32) / 128  # exact in bfloat16 too
    inexact = grid[grid * (1 / t) != grid / t]               # CPU float32: IEEE multiply and divide
    assert inexact.numel() >= 2
    logits = torch.full((2, v), -3.0)
    logits[:, [5, 40, 77]] = torch.tensor([6.0, 5.0, 4.0])
    logits[0, [10, 70]] = inexact[0]   # boundary group, across chunks
    logits[1, [33, 95]] = inexact[-1]
    logits = logits.to(device=device, dtype=dtype)
    expect = torch.zeros(2, v, dtype=torch.bool)
    expect[:, [5, 40, 77]] = True
    expect[0, [10, 70]] = expect[1, [33, 95]] = True

    # Cumulative sorted softmax of each row: [r, 2] is the leaders' mass, [r, 4] with the group.
    cum = torch.sort(torch.softmax(scale_logits_ref(logits.float(), temperature).double(), -1), -1,
                     descending=True).values.cumsum(-1).cpu()
    p_only = float((cum[:, 2].max() + cum[:, 4].min()) / 2)
    assert (cum[:, 2] < p_only - 0.005).all() and (p_only + 0.005 < cum[:, 4]).all()
    cases = [
        (4, None),      # the 4th largest is the tied group: 5 kept
        (4, 0.999),     # top-p over the top-k set ends at the group too
        (None, p_only),  # top-p alone ends at the group
    ]
    for top_k, top_p in cases:
        got = sample_allowed(logits, temperature=temperature, top_k=top_k, top_p=top_p, block_v=32, radix_bits=4)
        ref = sample_allowed_ref(logits, temperature, top_k, top_p)
        assert torch.equal(ref.cpu(), expect), f"reference, top_k={top_k} top_p={top_p}: {ref.sum(1).tolist()}"
        assert torch.equal(got.cpu(), expect), f"kernel, top_k={top_k} top_p={top_p}: {got.sum(1).tolist()}"
        for offset in range(2):
            tok = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=5, offset=offset,
                         block_v=32)
            noise = gumbel_noise(5, offset, 2, v, device=device)
            assert torch.equal(tok, sample_ref(logits, temperature, top_k, top_p, noise))


def test_banned_tokens_never_drawn(device):
    v = 64
    logits = torch.full((3, v), float("-inf"), device=device)
    logits[:, ::7] = torch.randn(3, len(range(0, v, 7)), device=device)
    tok = sample(logits, top_k=20, seed=11)  # k beyond the finite entries: -inf ties are allowed, never win
    assert (tok.cpu() % 7 == 0).all()
    assert torch.equal(tok, sample_ref(logits, 1.0, 20, None, gumbel_noise(11, 0, 3, v, device=device)))
    tok = sample(logits, top_p=0.95, seed=12, offset=4)
    assert (tok.cpu() % 7 == 0).all()


def test_temperature_zero_and_top_k_one_are_argmax(device):
    logits = torch.randn(5, 500, device=device)
    ref = argmax_ref(logits)
    assert torch.equal(sample(logits, temperature=0.0, top_k=3, top_p=0.5, seed=9), ref)
    assert torch.equal(sample_allowed(logits, temperature=0), sample_allowed_ref(logits, 0))
    for seed in (0, 1):
        assert torch.equal(sample(logits, temperature=0.7, top_k=1, seed=seed, offset=seed), ref)


def test_same_seed_same_tokens_new_seed_or_offset_new_draw(device):
    logits = 0.1 * torch.randn(8, 1000, device=device)  # nearly flat: a new draw almost surely differs
    first = sample(logits, seed=5, offset=2)
    assert torch.equal(sample(logits, seed=5, offset=2), first)
    assert not torch.equal(sample(logits, seed=6, offset=2), first)
    assert not torch.equal(sample(logits, seed=5, offset=3), first)
    noise = gumbel_noise(5, 2, 8, 1000, device=device)
    assert torch.equal(gumbel_noise(5, 2, 8, 1000, device=device), noise)
    assert torch.equal(gumbel_noise(5, 2, 8, 1000, device=device, block_v=64), noise)  # chunking-free
    # The offset's high word and a seed's high bits count too.
    assert not torch.equal(gumbel_noise(5, 2 + 2**32, 8, 1000, device=device), noise)
    assert not torch.equal(gumbel_noise(5 + 2**40, 2, 8, 1000, device=device), noise)
    # Rows draw independently: identical rows get different noise.
    assert (noise[0] != noise[1]).float().mean() > 0.99


def test_workspace_reuse_needs_no_clearing(device):
    logits = 2 * torch.randn(2, 500, device=device)
    kw = dict(temperature=0.9, top_k=40, top_p=0.9, seed=21, offset=5, block_v=128, radix_bits=8)
    fresh = sample(logits, **kw)
    ws = sample_workspace(2, 4, radix_bits=8, device=device)
    for name, t in ws.items():  # garbage, NaN included
        t.copy_(torch.randint(-2**31, 2**31 - 1, t.shape, dtype=torch.int32).view(t.dtype)
                if t.dtype == torch.float32 else torch.randint(-2**31, 2**31 - 1, t.shape, dtype=t.dtype))
    assert torch.equal(sample(logits, workspace=ws, **kw), fresh)
    assert torch.equal(sample(logits, workspace=ws, **kw), fresh)  # reused after a run


# --------------------------------------------------------------------------------------------
# Statistics: draws follow softmax(logits / T) restricted to the allowed set

LOGITS8 = [2.0, 1.6, 1.1, 0.9, 0.3, 0.0, -0.4, -1.5]


def test_sample_frequencies_match_softmax(device):
    # sample() itself: n rows of the same logits (row stride 0) draw independently. The
    # interpreter keeps n modest, so this bound is loose (about ±0.1 in probability); the
    # next test checks the same noise with 40000 draws.
    n = 250
    logits = torch.tensor(LOGITS8, device=device)
    tokens = torch.cat([sample(logits.expand(n, 8), temperature=0.8, seed=2024, offset=step) for step in (0, 1)])
    _assert_frequencies(tokens, _restricted_softmax(logits.cpu(), 0.8, None, None), "sample, T=0.8")


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, 6, 0.9), (1.7, None, None), (1.0, None, 0.6)])
def test_kernel_noise_gives_restricted_softmax_frequencies(temperature, top_k, top_p, device):
    # Many draws cheaply: the kernel's noise for consecutive groups of 8 tokens (all
    # independent counters) drives the reference sampler, which sample() replays token for
    # token (tests above). 40000 draws: counts within ~1.5 points of probability.
    groups = 2500
    noise = torch.cat([gumbel_noise(99, offset, 8, 8 * groups, device=device, block_v=16384)
                       for offset in (0, 1)])
    noise = noise.reshape(-1, 8)
    logits = torch.tensor(LOGITS8, device=device)
    tokens = sample_ref(logits.expand(noise.shape[0], 8), temperature, top_k, top_p, noise)
    expected = _restricted_softmax(logits.cpu(), temperature, top_k, top_p)
    _assert_frequencies(tokens, expected, f"T={temperature} top_k={top_k} top_p={top_p}")


def test_noise_is_gumbel(device):
    # Dvoretzky-Kiefer-Wolfowitz (Massart's constant): P(sup|F_n - F| > t) <= 2 exp(-2 n t^2).
    g = gumbel_noise(7, 3, 4, 40000, device=device, block_v=8192).flatten().double().cpu()
    n = g.numel()
    t = math.sqrt(math.log(2 / FALSE_ALARM) / (2 * n))
    g, _ = torch.sort(g)
    cdf = torch.exp(-torch.exp(-g))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    dist = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max().item()
    assert torch.isfinite(g).all()
    assert dist <= t, f"KS distance {dist:.4g} > {t:.4g}"


# --------------------------------------------------------------------------------------------
# Arguments and planner hooks

def test_sample_rejects_bad_arguments(device):
    logits = torch.randn(2, 50, device=device)
    cases = [
        (ValueError, "temperature", dict(temperature=-0.5)),
        (ValueError, "temperature", dict(temperature=float("nan"))),
        (TypeError, "temperature", dict(temperature="hot")),
        (ValueError, "top_p", dict(top_p=0.0)),
        (ValueError, "top_p", dict(top_p=1.5)),
        (TypeError, "top_p", dict(top_p="0.9")),
        (ValueError, "top_k", dict(top_k=0)),
        (TypeError, "top_k", dict(top_k=2.5)),
        (ValueError, "seed", dict(seed=-1)),
        (ValueError, "offset", dict(offset=2**63)),
        (TypeError, "seed", dict(seed=1.0)),
        (ValueError, "block_v", dict(block_v=48)),
        (ValueError, "radix_bits", dict(radix_bits=3)),
        (TypeError, "workspace", dict(workspace=[])),
        (ValueError, "part_hist", dict(workspace=sample_workspace(2, 2, device=device))),
    ]
    for exc, name, kw in cases:
        with pytest.raises(exc, match=name):
            sample(logits, **kw)
    with pytest.raises(TypeError, match="logits"):
        sample(logits.to(torch.int64))
    with pytest.raises(TypeError, match="logits"):
        sample(logits.numpy() if device.type == "cpu" else logits.tolist())
    with pytest.raises(ValueError, match="logits"):
        sample(logits[0])
    with pytest.raises(ValueError, match="logits"):
        sample(logits.t())
    with pytest.raises(ValueError, match="top_p"):
        sample_allowed(logits, top_p=-1.0)
    with pytest.raises(ValueError, match="seed"):
        gumbel_noise(-3, 0, 2, 50)
    with pytest.raises(ValueError, match="logits"):  # wrong device
        sample(logits.to("meta" if device.type == "cpu" else "cpu"))
    if device.type == "cpu":
        with pytest.raises(TypeError, match="logits"):
            sample(logits.to(torch.bfloat16))


def test_empty_batch(device):
    assert sample(torch.randn(0, 10, device=device), top_k=3).shape == (0,)


def test_sample_planner_hooks():
    base = sample_cost(1, 128256)
    both = sample_cost(1, 128256, top_k=True, top_p=True)
    assert isinstance(both, TaskCost)
    assert base.bytes_read >= 128256 * 2 and both.bytes_read > base.bytes_read and both.flops > base.flops
    assert sample_num_passes(4) == 8 and sample_num_passes(8) == 4
    assert sample_smem_bytes(1024, 8) > sample_smem_bytes(1024, 4) >= 2048
