"""mk.models.Llama: prefill through the task ops, decode through the megakernel, against the
plain-torch reference (itself checked against transformers in test_hf_parity.py).

On a CPU the megakernel runs through the Triton interpreter (one worker, a few seconds a
step), so the decodes here are short; the GPU variants at the end run the same checks
compiled, and the Llama-3 shapes live in bench/.
"""

import pytest
import torch
import triton


import mk.models.prefill
import mk.persistent.runtime
from mk.engine.steps import Steps
from mk.engine.stream import decode_step
from mk.models import Llama, LlamaConfig, ReferenceLlama, random_weights, save_weights
from mk.models.reference import prefill_logits
from mk.tasks import default_device
from mk.tasks.sample import gumbel_noise, scale_logits_ref
from tests.conftest import HAS_CUDA, rel_err, tolerance

# Small enough for the interpreter; GQA 2:1, a vocabulary that is no multiple of a tile.
CONFIG = LlamaConfig.tiny(vocab_size=301, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, eos_token_id=None)
PROMPTS = [[1, 5, 9, 200, 7], [3, 4], [250, 251, 252, 17]]


@pytest.fixture(scope="module")
def pair():
    """(mk model, reference) with the same random weights (float32 on the CPU)."""
    model = Llama.from_config(CONFIG, seed=3, max_batch_size=3, max_seq_len=16, dtype=torch.float32)
    return model, ReferenceLlama(CONFIG, random_weights(CONFIG, seed=3, device=model.device))


def reference_continuation(ref, prompts, new_tokens, choose):
    """Teacher-forced reference: logits after each prefix of prompt + mk's tokens, and the
    token ``choose(logits [V], b, position)`` picks from them."""
    out = []
    for b, (p, gen) in enumerate(zip(prompts, new_tokens)):
        seq = list(p)
        picks = []
        for i in range(len(gen)):
            logits = ref.forward(torch.tensor([seq], device=ref.device), 0, ref.new_cache(1, len(seq)))[0, -1]
            picks.append(choose(logits, b, len(seq)))
            seq.append(gen[i])
        out.append(picks)
    return out


def test_prefill_logits_match_reference(pair):
    model, ref = pair
    got = model.logits(PROMPTS)
    want, _ = prefill_logits(ref, PROMPTS)
    for b, p in enumerate(PROMPTS):
        assert rel_err(got[b, :len(p)], want[b, :len(p)]) < (1e-4 if not HAS_CUDA else tolerance(torch.float32)), b


@pytest.mark.parametrize("precision,chunk", [("fast", 1), ("fast", 2), ("fast", 3), ("exact", 3)])
def test_prompts_prefilled_a_chunk_at_a_time_are_the_same_prompts(pair, precision, chunk):
    # The workspace caps the tokens a prefill runs at once: the prompts are packed and cut
    # into chunks of a few tokens (a prompt split across chunks, or several in one), each
    # chunk's attention reading the cache earlier chunks filled. Every token's logits, the
    # last token's that start decoding, and the cache must be the unchunked ones.
    model, ref = pair
    model.prefill_precision = precision
    try:
        model.prefill_workspace = chunk * model.prefill_budget.per_token
        assert model.prefill_budget.chunk_tokens == chunk
        assert model.footprint()["prefill_workspace"] == chunk * model.prefill_budget.per_token
        got = model.logits(PROMPTS)
        want, _ = prefill_logits(ref, PROMPTS)
        for b, p in enumerate(PROMPTS):
            assert rel_err(got[b, :len(p)], want[b, :len(p)]) < (1e-4 if not HAS_CUDA else tolerance(torch.float32)), b
        ids, lengths = model._check_prompts(PROMPTS, 0)
        last = model.prefiller.run(ids, lengths)
        assert rel_err(last, torch.stack([want[b, n - 1] for b, n in enumerate(lengths)])) < 1e-4
        for b, p in enumerate(PROMPTS):
            cache = ref.new_cache(1, len(p))
            ref.forward(torch.tensor([p], device=ref.device), 0, cache)
            assert rel_err(model.k_cache[:, b, :, :len(p)], cache.k[:, 0]) < 1e-4, b
    finally:
        model.prefill_precision, model.prefill_workspace = "fast", mk.models.prefill.default_workspace(model.device)


def test_prefill_settings_are_checked_and_a_request_that_cannot_fit_is_refused(pair, monkeypatch):
    model, _ = pair
    with pytest.raises(ValueError, match="prefill_precision"):
        Llama.from_config(CONFIG, max_batch_size=1, max_seq_len=8, prefill_precision="fp8")
    with pytest.raises(ValueError, match="prefill_precision"):
        model.prefill_precision = "bf16"
    with pytest.raises(ValueError, match="holds no token"):
        Llama.from_config(CONFIG, max_batch_size=1, max_seq_len=8, prefill_workspace=16)
    with pytest.raises(ValueError, match="prefill_workspace"):
        model.prefill_workspace = 1.5e9
    assert model.prefill_precision == "fast"
    # Too little free memory for the request's workspace: refused before the cache changes.
    model.k_cache.fill_(3.0)
    monkeypatch.setattr(mk.models.prefill, "free_bytes", lambda device, need=0: model.prefill_budget.per_token * 4)
    with pytest.raises(MemoryError, match="prefill needs .* MiB of workspace"):
        model.generate(PROMPTS, max_new_tokens=2)
    assert bool((model.k_cache == 3.0).all())
    per_token = model.prefill_budget.per_token
    monkeypatch.setattr(mk.models.prefill, "free_bytes", lambda device, need=0: 2 * per_token + 100)
    with pytest.raises(MemoryError, match="workspace"):
        model.logits([[1, 2]])  # the two tokens' workspace fits, not with the logits it returns
    monkeypatch.setattr(mk.models.prefill, "free_bytes", lambda device, need=0: model.prefill_budget.per_token * 20)
    assert len(model.generate([[1, 2, 3]], max_new_tokens=1)[0]) == 4


def test_a_precision_whose_token_outgrows_the_workspace_is_refused_and_nothing_changes(pair):
    # A float32 model's fast token holds more than its exact one (exact fuses the norms and
    # SiLU·mul into its linear tiles; fast keeps their outputs between cuBLAS calls).
    model, _ = pair
    model.prefill_precision = "exact"
    model.prefill_workspace = model.prefill_budget.per_token  # one exact token
    try:
        with pytest.raises(ValueError, match="holds no token"):
            model.prefill_precision = "fast"
        assert model.prefill_precision == "exact" and model.prefill_budget.chunk_tokens == 1
    finally:
        model.prefill_workspace = mk.models.prefill.default_workspace(model.device)
        model.prefill_precision = "fast"


def test_captured_chunk_lengths_round_up_within_their_limit():
    from mk.models.prefill import GRAPH_TOKEN_STEP, graph_tokens

    step = GRAPH_TOKEN_STEP
    assert [graph_tokens(n, 4096) for n in (1, step, step + 1, 2048)] == [step, step, 2 * step, 2048]
    assert graph_tokens(300, 320) == 320  # rounding up would pass the cache or the chunk: up to it
    assert graph_tokens(319, 320) == 320 and graph_tokens(320, 320) == 320


def test_pack_cuts_prompts_into_chunks_in_order():
    from mk.models.prefill import Segment, pack

    chunks = pack([5, 2, 4], 3)
    assert chunks == [[Segment(0, 0, 3, 0)], [Segment(0, 3, 5, 0), Segment(1, 0, 1, 2)],
                      [Segment(1, 1, 2, 0), Segment(2, 0, 2, 1)], [Segment(2, 2, 4, 0)]]
    for lengths, size in (([1], 8), ([7, 1, 9, 3], 4), ([8192, 3], 8192), ([3, 3], 1)):
        chunks = pack(lengths, size)
        assert all(0 < sum(s.tokens for s in c) <= size for c in chunks)
        assert all(sum(s.tokens for s in c) == size for c in chunks[:-1])  # only the last is short
        seen = [(s.row, t) for c in chunks for s in c for t in range(s.start, s.stop)]
        assert seen == [(r, t) for r, n in enumerate(lengths) for t in range(n)]
        assert all(s.offset == sum(x.tokens for x in c[:i]) for c in chunks for i, s in enumerate(c))


def test_greedy_generate_matches_reference(pair):
    model, ref = pair
    out = model.generate(PROMPTS, max_new_tokens=4)
    new = [o[len(p):] for o, p in zip(out, PROMPTS)]
    assert [o[:len(p)] for o, p in zip(out, PROMPTS)] == PROMPTS and all(len(n) == 4 for n in new)
    assert new == reference_continuation(ref, PROMPTS, new, lambda logits, b, pos: int(logits.argmax()))


def test_temperature_sampling_runs_in_the_kernel_and_replays(pair):
    # Token at position p of row b = argmax(logits / T + gumbel(seed, offset p, row b)).
    model, ref = pair
    T, seed = 0.7, 1234
    out = model.generate(PROMPTS, max_new_tokens=3, temperature=T, seed=seed)
    new = [o[len(p):] for o, p in zip(out, PROMPTS)]

    def draw(logits, b, pos):
        noise = gumbel_noise(seed, pos, len(PROMPTS), CONFIG.vocab_size, device=logits.device)[b]
        return int((scale_logits_ref(logits, T) + noise).argmax())

    assert new == reference_continuation(ref, PROMPTS, new, draw)
    assert model.generate(PROMPTS, max_new_tokens=3, temperature=T, seed=seed) == out
    assert model.generate(PROMPTS, max_new_tokens=3, temperature=T, seed=seed + 1) != out


def test_top_k_tokens_come_from_the_top_k(pair):
    model, ref = pair
    out = model.generate(PROMPTS[:2], max_new_tokens=3, temperature=1.5, top_k=3, seed=5)
    new = [o[len(p):] for o, p in zip(out, PROMPTS)]
    top3 = reference_continuation(ref, PROMPTS[:2], new, lambda logits, b, pos: set(logits.topk(3).indices.tolist()))
    assert all(t in allowed for n, a in zip(new, top3) for t, allowed in zip(n, a))


def test_one_decode_step_is_one_kernel_launch(pair, monkeypatch):
    model, _ = pair
    list(model.stream(PROMPTS, max_new_tokens=1))  # prefill, state set up, decoder built
    dec = model.last_decoder
    launched, inside = [], []
    for cls in {type(dec.kernel.kernel), triton.runtime.jit.JITFunction}:
        original = cls.run

        def counting(self, *args, _original=original, **kwargs):
            launched.append(getattr(self, "__name__", None) or getattr(self.fn, "__name__", "?"))
            inside.append(True)
            try:
                return _original(self, *args, **kwargs)
            finally:
                inside.pop()

        monkeypatch.setattr(cls, "run", counting)
    ops = []

    class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
        """Torch ops issued by the step itself (the interpreter's own copies inside a launch aside)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside:
                ops.append(func)
            return func(*args, **(kwargs or {}))

    with CountOps():
        decode_step(dec, 1)
    assert launched == ["megakernel"] and ops == [], (launched, ops)


def test_stream_yields_what_generate_returns_and_stops_at_eos(pair):
    model, _ = pair
    ids = torch.tensor([PROMPTS[0], PROMPTS[2][:3] + [9, 9]])
    full = model.generate(ids, max_new_tokens=4)
    assert full.shape == (2, 9) and torch.equal(full[:, :5], ids)
    steps = list(model.stream(ids, max_new_tokens=4))
    assert torch.equal(torch.stack(steps, dim=1), full[:, 5:])
    # EOS = row 0's second new token: row 0 stops there, the list form cuts after it.
    eos = int(full[0, 6])
    out = model.generate([PROMPTS[0]], max_new_tokens=4, eos_token_id=eos)
    assert out[0][5:] == full[0, 5:7].tolist()


def test_bad_requests_are_refused_before_any_work(pair):
    model, _ = pair
    before = (model.k_cache.clone(), model.v_cache.clone())
    with pytest.raises(ValueError, match="max_batch_size=3"):
        model.generate([[1]] * 4, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model.generate([[1] * 10], max_new_tokens=7)
    with pytest.raises(ValueError, match="outside"):
        model.generate([[1, CONFIG.vocab_size]], max_new_tokens=1)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate([[1], []], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([[1]], max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate([[1]], max_new_tokens=1, temperature=-1.0)
    assert torch.equal(model.k_cache, before[0]) and torch.equal(model.v_cache, before[1])


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusals")
def test_bad_device_or_dtype_is_named():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        Llama.from_config(CONFIG, device="cuda")
    with pytest.raises(ValueError, match="bfloat16"):
        Llama.from_config(CONFIG, dtype=torch.bfloat16)


def test_from_pretrained_folder_decodes_like_the_same_weights(pair, tmp_path):
    model, _ = pair
    save_weights(random_weights(CONFIG, seed=3), CONFIG, tmp_path)
    loaded = Llama.from_pretrained(tmp_path, max_batch_size=1, max_seq_len=16, progress=False)
    assert loaded.generate([PROMPTS[0]], max_new_tokens=2) == model.generate([PROMPTS[0]], max_new_tokens=2)
    with pytest.raises(ValueError, match="no-such-folder"):
        Llama.from_pretrained(tmp_path / "no-such-folder")
    # safetensors may hand back a tensor 8 bytes off a 16-byte boundary (the megakernel's
    # buffers need 16): such weights are copied, not refused.
    weights = random_weights(CONFIG, seed=3, device=model.device, dtype=model.dtype)
    embed = weights["model.embed_tokens.weight"]
    store = torch.empty(embed.numel() + 16 // embed.element_size(), dtype=embed.dtype, device=embed.device)
    off = next(i for i in range(1, store.numel()) if store[i:].data_ptr() % 16)
    weights["model.embed_tokens.weight"] = store[off:off + embed.numel()].view(embed.shape).copy_(embed)
    assert weights["model.embed_tokens.weight"].data_ptr() % 16
    shifted = Llama(CONFIG, weights, device=model.device, dtype=model.dtype, max_batch_size=1, max_seq_len=16)
    assert shifted.generate([PROMPTS[0]], max_new_tokens=2) == model.generate([PROMPTS[0]], max_new_tokens=2)


@pytest.mark.gpu
def test_one_decode_step_is_one_cuda_kernel(pair):
    model = Llama.from_config(CONFIG, seed=3, max_batch_size=3, max_seq_len=16)
    list(model.stream(PROMPTS, max_new_tokens=2))
    dec = model.last_decoder
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decode_step(dec, 1)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "megakernel" in kernels[0], kernels


def test_device_default():
    assert Llama.from_config(CONFIG, max_batch_size=1, max_seq_len=8).device.type == default_device().type


def test_measure_mode_times_the_top_plans_and_decodes_the_same(pair, tmp_path, monkeypatch):
    """plan_mode="measure" times the planner's top plans here (through the interpreter on a
    CPU) before the prompt is prefilled, keeps the fastest, and decodes exactly as the
    predicted plan does."""
    monkeypatch.setenv("MK_CACHE_DIR", str(tmp_path))
    model, _ = pair
    measured = Llama.from_config(CONFIG, seed=3, max_batch_size=3, max_seq_len=16, dtype=torch.float32,
                                 plan_mode="measure")
    timed = []
    original = Steps.time_plan
    monkeypatch.setattr(Steps, "time_plan", lambda self, *a: timed.append(original(self, *a)) or timed[-1])
    assert measured.generate(PROMPTS, max_new_tokens=3) == model.generate(PROMPTS, max_new_tokens=3)
    plan, _ = measured.plan(3)
    assert len(timed) >= 2 and all(t > 0 for t in timed) and plan.measured_s == min(timed)
    with pytest.raises(ValueError, match="plan_mode"):
        Llama.from_config(CONFIG, plan_mode="fastest")


def test_a_bad_kv_dtype_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="kv_dtype torch.int8"):
        Llama.from_config(CONFIG, max_batch_size=1, max_seq_len=8, kv_dtype=torch.int8)
    model = Llama.from_config(CONFIG, max_batch_size=1, max_seq_len=8)
    assert model.kv_dtype == model.dtype and model.k_cache.dtype == model.dtype


@pytest.mark.gpu
def test_bf16_weights_with_a_float32_cache_decode_as_the_float32_reference():
    """Exact prefill precision. Activations are float32 and meet the bf16 weights unrounded: with a float32 KV cache
    only the weights are bf16, so prefill and decode match the float32 reference on those
    weights to summation order, and 24 greedy tokens agree. A bf16 cache costs its rounding."""
    from mk.models.reference import greedy_generate

    cfg = LlamaConfig.tiny(num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                           eos_token_id=None)
    prompts = [[1, 5, 9, 200, 7, 3], [3, 4, 11]]
    exact = Llama.from_config(cfg, seed=5, dtype=torch.bfloat16, kv_dtype=torch.float32, max_batch_size=2,
                              max_seq_len=64, prefill_precision="exact")
    assert exact.k_cache.dtype == torch.float32 and exact.shape.kv_dtype_bytes == 4
    ref = ReferenceLlama(cfg, exact.hf_weights())
    want, _ = prefill_logits(ref, prompts)
    got = exact.logits(prompts)
    for b, p in enumerate(prompts):
        assert rel_err(got[b, :len(p)], want[b, :len(p)]) < 1e-4, b
    out = exact.generate(prompts, max_new_tokens=24)
    assert [o[len(p):] for o, p in zip(out, prompts)] == greedy_generate(ref, prompts, 24)
    rounded = Llama.from_config(cfg, seed=5, dtype=torch.bfloat16, max_batch_size=2, max_seq_len=64,
                                prefill_precision="exact")
    got16 = rounded.logits(prompts)
    err16 = max(rel_err(got16[b, :len(p)], want[b, :len(p)]) for b, p in enumerate(prompts))
    assert 1e-4 < err16 < 2e-2, err16


@pytest.mark.gpu
def test_fast_prefill_logits_are_within_the_stated_tolerance_and_greedy_decode_follows_the_reference():
    """The fast prefill precision (bf16 matmul operands, float32 accumulation and residual)
    on the 1B shape with random weights, a float32 cache: its logits stay within 3% of the
    float32 reference on the same bf16 weights (exact mode: 1e-4 in the test above), and the
    greedy tokens decoded after it equal the reference's for 16 steps and more."""
    from mk.models.reference import greedy_generate

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                      rope_theta=500000.0, max_position_embeddings=131072, eos_token_id=None,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    model = Llama.from_config(cfg, seed=7, dtype=torch.bfloat16, kv_dtype=torch.float32, max_batch_size=2,
                              max_seq_len=512)
    assert model.prefill_precision == "fast"
    ref = ReferenceLlama(cfg, model.hf_weights())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (300, 77)]
    want, _ = prefill_logits(ref, prompts)
    got = model.logits(prompts)
    errs = [rel_err(got[b, :len(p)], want[b, :len(p)]) for b, p in enumerate(prompts)]
    print(f"fast prefill logits vs the float32 reference: rel err {max(errs):.2e}")
    assert max(errs) < 3e-2, errs
    steps = 24
    out = model.generate(prompts, max_new_tokens=steps)
    want_tokens = greedy_generate(ref, prompts, steps)
    agree = [next((i for i, (a, b) in enumerate(zip(o[len(p):], w)) if a != b), steps)
             for o, p, w in zip(out, prompts, want_tokens)]
    print(f"greedy tokens equal to the reference's for {agree} of {steps} steps")
    assert min(agree) >= 16, agree
    # One whole prompt a chunk runs as a CUDA graph captured for its length rounded up to
    # 128 tokens: the first request of a length runs eagerly and captures, the next replays
    # (here a shorter prompt of the same bucket, its padding written past its end).
    assert not model.prefiller.graphs
    for n in (300, 290, 300):
        got = model.logits([prompts[0][:n]])[0]
        assert rel_err(got, want[0, :n]) < 3e-2, n
    assert list(model.prefiller.graphs) == [(0, 0, 384)]
    short = prompts[0][:290]
    got, want_short = model.generate([short], max_new_tokens=steps)[0][290:], greedy_generate(ref, [short], steps)[0]
    same = next((i for i, (a, b) in enumerate(zip(got, want_short)) if a != b), steps)
    print(f"after a replayed prefill: greedy tokens equal to the reference's for {same} of {steps} steps")
    assert same >= 16


@pytest.mark.gpu
def test_fast_prefill_over_a_bf16_cache_agrees_with_exact_per_token_when_prompts_split_across_chunks():
    """The fast path's own kernels on a bf16 cache (SDPA for a whole prompt, one varlen
    flash launch for several whole prompts, SDPA with lower-right causal masks for a chunk
    that continues a prompt): every token's logits within 5% of the exact precision's, with
    a workspace small enough that prompts split across chunks."""
    cfg = LlamaConfig.tiny(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, eos_token_id=None)
    model = Llama.from_config(cfg, seed=11, dtype=torch.bfloat16, max_batch_size=4, max_seq_len=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (300, 41, 170, 7)]
    model.prefill_precision = "exact"
    want = model.logits(prompts)
    model.prefill_precision = "fast"
    for workspace_tokens in (None, 128, 200):
        if workspace_tokens:
            model.prefill_workspace = workspace_tokens * model.prefill_budget.per_token
        got = model.logits(prompts)
        for b, p in enumerate(prompts):
            assert rel_err(got[b, :len(p)], want[b, :len(p)]) < 5e-2, (workspace_tokens, b)


@pytest.mark.gpu
def test_generation_holds_at_most_the_stated_workspace_beyond_weights_and_cache():
    """GPU memory while generating: the weights, the KV cache, the prefill workspace that
    footprint() states, and at most 64 MiB more (the decode step's activations and state).
    Long prompts at batch 8 run in several chunks, whatever the workspace."""
    cfg = LlamaConfig.tiny(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=64, eos_token_id=None,
                           max_position_embeddings=2048)
    model = Llama.from_config(cfg, seed=1, max_batch_size=8, max_seq_len=2048)
    prompts = [[(7 * b + 13 * t) % 32000 for t in range(1500 + 50 * b)] for b in range(8)]
    for workspace in (None, 64 * 2**20):
        if workspace:
            model.prefill_workspace = workspace
        fp = model.footprint()
        assert fp["kv_cache"] == 2 * 4 * 8 * 8 * 2048 * 64 * 2
        assert model.prefill_budget.chunk_tokens < sum(map(len, prompts)) and fp["prefill_workspace"] <= model.prefill_workspace
        for batch in (8, 1):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            assert before >= fp["weights"] + fp["kv_cache"]
            torch.cuda.reset_peak_memory_stats()
            out = model.generate(prompts[:batch], max_new_tokens=8)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
            assert all(len(o) == len(p) + 8 for o, p in zip(out, prompts)), batch
            assert extra <= fp["prefill_workspace"] + 64 * 2**20, \
                f"batch {batch}: {extra / 2**20:.1f} MiB beyond the weights and cache, workspace " \
                f"{fp['prefill_workspace'] / 2**20:.0f} MiB"


def test_steps_are_planned_for_the_length_the_request_reaches(pair):
    """A request's decode steps are planned for the first of PLAN_LENGTHS its sequences can
    reach (prompt + new tokens), at most max_seq_len: attention is cut into KV splits for
    that length, so a short request runs no splits past its sequences."""
    from mk.models.decoder import PLAN_LENGTHS

    model, _ = pair
    list(model.stream(PROMPTS, max_new_tokens=2))
    assert model.last_decoder.step.plan.kv_len == model.plan_length(max(map(len, PROMPTS)) + 2) == 16
    assert [k for k in model.steps.built if k[:2] == (3, "argmax")] == [(3, "argmax", 16)]
    long = Llama.from_config(CONFIG, max_batch_size=1, max_seq_len=300)
    assert [long.plan_length(n) for n in (1, 64, 65, 256, 257, 300)] == [64, 64, 256, 256, 300, 300]
    assert PLAN_LENGTHS[0] == 64 and list(PLAN_LENGTHS) == sorted(PLAN_LENGTHS)
    short_plan, short_graph = long.plan(1, 64)
    full_plan, full_graph = long.plan(1)
    assert (short_graph.kv_len, full_graph.kv_len) == (64, 300) == (short_plan.kv_len, full_plan.kv_len)
    splits = [max(c.kv_splits for n, c in p.choices.items() if n.endswith("attention"))
              for p in (short_plan, full_plan)]
    assert splits[0] == 1 and splits[0] <= splits[1]
    for bad in (0, 301, 64.0, True):
        with pytest.raises(ValueError, match="kv_len"):
            long.plan(1, bad)
    # One step a batch size and next-token rule stays built: another planned length replaces it.
    first = long.steps.get(1, "argmax", 64)
    assert long.steps.get(1, "argmax", 64) is first
    long.steps.get(1, "argmax", 300)
    assert list(long.steps.built) == [(1, "argmax", 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,head_dim", [(64, 16), (128, 32), (256, 32)])
def test_batch_one_decodes_as_the_reference_when_rows_are_shorter_than_a_box(hidden, head_dim):
    """Batch-1 steps stream weights through TMA boxes up to 256 wide; layers whose rows are
    shorter (K = 64, 128) must still decode as the float32 reference does (they picked
    256-wide boxes past the rows' end, and wrong tokens, before boxes were kept within K)."""
    from mk.models import greedy_generate

    config = LlamaConfig.tiny(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    model = Llama.from_config(config, seed=0, max_batch_size=1, max_seq_len=16, kv_dtype=torch.float32)
    ref = ReferenceLlama(config, {k: v.float().cpu() for k, v in model.hf_weights().items()})
    prompt = [1, 17, 42, 311, 7, 99]
    got = model.generate([prompt], max_new_tokens=6)[0][len(prompt):]
    assert got == greedy_generate(ref, [prompt], 6)[0]


def test_a_step_lowered_before_is_bound_again_not_lowered(monkeypatch, tmp_path):
    """A request back at a length bucket or batch size seen before lowers nothing: the
    lowered step (tasks, dependencies, queues, descriptors) is kept by plan, batch and
    length, and only bound to new activations and state; it decodes as the first did."""
    import mk.planner.steps as lowering
    from mk.persistent import deps

    monkeypatch.setenv("MK_CACHE_DIR", str(tmp_path))  # (no dependencies from the disk cache)
    calls = {"lower_decode_step": 0, "dependency_intervals": 0, "lower": 0, "step_queues": 0}

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in ((lowering, "lower_decode_step"), (deps, "dependency_intervals"), (lowering, "lower"),
                         (lowering, "step_queues")):
        counting(module, name)
    import mk.persistent.graph as taskgraph

    monkeypatch.setattr(taskgraph, "dependency_intervals", deps.dependency_intervals)
    model = Llama.from_config(CONFIG, seed=3, max_batch_size=2, max_seq_len=300, dtype=torch.float32)
    model.steps.get(1, "argmax", 64)
    first = dict(calls)
    assert all(first.values()), first
    model.steps.get(1, "argmax", 300)  # another length bucket: lowered, and replaces the first decoder
    model.steps.get(2, "argmax", 64)  # another batch size
    built = dict(calls)
    out = model.generate([[3, 4, 5]], max_new_tokens=3)  # plans for 64 again
    again = model.generate([[3, 4, 5]], max_new_tokens=3)
    assert calls == built, "a step lowered before was lowered again"
    assert sorted(model.steps.built) == [(1, "argmax", 64), (2, "argmax", 64)]
    assert out == again
    fresh = Llama.from_config(CONFIG, seed=3, max_batch_size=2, max_seq_len=300, dtype=torch.float32)
    assert fresh.generate([[3, 4, 5]], max_new_tokens=3) == out
