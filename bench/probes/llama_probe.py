"""GPU probe: Llama-3.2-1B / Llama-3-8B shapes with random bf16 weights through mk.models.Llama.

Correctness (logits vs the float32 reference, greedy tokens vs transformers) and decode
ms/token at batch 1 and 8 against the bf16 torch peer (eager replayed from a CUDA graph,
and torch.compile reduce-overhead), plus 512-token prefill. JSON to $OUT/llama_probe.json.
Usage: python bench/probes/llama_probe.py [1b|8b ...]; PROBE_KV=float32 for a float32 KV cache,
PROBE_NO_TIMING=1 for the checks alone.
"""
import faulthandler, json, os, sys, time, traceback
import torch

faulthandler.dump_traceback_later(int(float(os.environ.get("PROBE_DUMP_S", "1e9"))), exit=False)
T_START = time.time()


def mark(*what):
    print(f"[{time.time() - T_START:7.1f} s]", *what, flush=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _llama_peer import TorchLlamaStep  # noqa: E402
from _harness import back_to_back_ms  # noqa: E402
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import Llama, LlamaConfig, ReferenceLlama  # noqa: E402
from mk.timing import copy_bandwidth  # noqa: E402

OUT = os.environ.get("OUT", ".")
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MK_COMMIT"),
           "copy_Bps": copy_bandwidth()["copy_Bps"], "shapes": {}}
print("copy", results["copy_Bps"] / 1e12, "TB/s", flush=True)


def timed(fn, reps=20, warmup=3):
    return back_to_back_ms(fn, reps, warmup)


def graph_of(fn, warmup=2):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def agree_steps(hf, out, prompts, steps=16):
    """Per prompt: how many of mk's first greedy tokens (``out``) transformers' ``hf`` repeats."""
    agree = []
    for o, p in zip(out, prompts):
        g = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=steps, do_sample=False,
                        attention_mask=torch.ones(1, len(p), device="cuda", dtype=torch.long))[0, len(p):].tolist()
        agree.append(next((i for i, (a, b) in enumerate(zip(o[len(p):], g)) if a != b), steps))
    return agree


def run_shape(key):
    cfg = LlamaConfig(**SHAPES[key])
    r = results["shapes"][key] = {}
    t0 = time.time()
    w = random_model(cfg)
    kv_dtype = getattr(torch, os.environ.get("PROBE_KV", "bfloat16"))
    r["kv_dtype"] = str(kv_dtype)
    model = Llama(cfg, w, device="cuda", dtype=torch.bfloat16, max_batch_size=8, max_seq_len=1024,
                  name=f"llama-{key}", kv_dtype=kv_dtype)
    del w
    r["weight_bytes"] = model.shape.weight_bytes
    floor_ms = model.shape.weight_bytes / results["copy_Bps"] * 1e3
    r["floor_ms"] = floor_ms
    print(key, "built", round(time.time() - t0, 1), "s; floor", round(floor_ms, 3), "ms", flush=True)
    if os.environ.get("PROBE_SKIP_CHECK"):
        time_shape(key, cfg, model, r)
        return
    # --- correctness: prefill + decode logits vs the float32 reference, greedy vs transformers
    ref = ReferenceLlama(cfg, model.hf_weights())
    mark(key, "reference ready")
    prompts = [[128000, 791, 6864, 315, 9822, 374], [128000, 40, 1093, 311]][:int(os.environ.get("PROBE_CHECK_BATCH", "1"))]
    got = model.logits(prompts)
    from mk.models.reference import prefill_logits
    want, _ = prefill_logits(ref, prompts)
    errs = [((got[b, :len(p)] - want[b, :len(p)]).norm() / want[b, :len(p)].norm()).item()
            for b, p in enumerate(prompts)]
    r["prefill_logits_rel_err"] = max(errs)
    mark(key, "prefill checked", errs)
    t0 = time.time()
    plan, graph = model.plan(len(prompts))
    mark(key, "planned", round(time.time() - t0, 2), "s")
    dec = model._decoder(len(prompts), "argmax")
    mark(key, "lowered and compiled", len(dec.step.graph.tasks), "tasks")
    mark(key, "compiled, residency", dec.kernel.residency())
    t0 = time.time()
    out = model.generate(prompts, max_new_tokens=16)
    r["first_generate_s"] = time.time() - t0
    mark(key, "generated")
    dec = model.last_decoder
    r["tasks"] = len(dec.step.graph.tasks)
    r["workers"] = dec.kernel.program.num_workers
    r["plan_predicted_ms"] = dec.step.plan.predicted_s * 1e3
    # decode-step logits: the last step's logits buffer vs the reference at that position
    last = dec.step.graph.buffers["logits"].float()
    seqs = [o[:-1] for o in out]
    ref_last = torch.stack([ref.forward(torch.tensor([s], device="cuda"), 0, ref.new_cache(1, len(s)))[0, -1]
                            for s in seqs])
    r["decode_logits_rel_err"] = ((last - ref_last).norm() / ref_last.norm()).item()
    from mk.models.reference import greedy_generate
    ref_tokens = greedy_generate(ref, prompts, 16)
    r["greedy_vs_f32_reference"] = [sum(a == b for a, b in zip(o[len(p):], t)) for o, p, t in zip(out, prompts, ref_tokens)]
    try:
        from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
        hf = LlamaForCausalLM(HFConfig(**cfg.to_hf_dict())).to(device="cuda", dtype=torch.bfloat16)
        missing = hf.load_state_dict({k: v.contiguous() for k, v in model.hf_weights().items()}, strict=False)
        hf.eval()
        r["greedy_agree_steps_vs_transformers"] = agree_steps(hf, out, prompts)
        # The yardstick: transformers' own bf16 model against the float32 reference.
        with torch.no_grad():
            hf_err = [((hf(torch.tensor([p], device="cuda")).logits[0].float() - want[b, :len(p)]).norm()
                       / want[b, :len(p)].norm()).item() for b, p in enumerate(prompts)]
        r["transformers_bf16_prefill_logits_rel_err"] = max(hf_err)
        r["mk_steps_equal_f32_reference"] = [next((i for i, (a, c) in enumerate(zip(o[len(p):], t)) if a != c), 16)
                                             for o, p, t in zip(out, prompts, ref_tokens)]
        r["hf_missing"] = [k for k in missing.missing_keys if "rotary" not in k][:5]
        # transformers in float32 on the same (bf16-valued) weights: the model itself, unrounded
        hf = hf.float()
        r["greedy_agree_steps_vs_transformers_f32"] = agree_steps(hf, out, prompts)
        del hf
    except Exception as e:  # noqa: BLE001
        r["transformers_error"] = repr(e)[:300]
    del ref
    torch.cuda.empty_cache()
    print(key, {k: v for k, v in r.items()}, flush=True)
    if not os.environ.get("PROBE_NO_TIMING"):
        time_shape(key, cfg, model, r)


def time_shape(key, cfg, model, r):
    # --- decode timing
    for B in [int(b) for b in os.environ.get("PROBE_BATCHES", "1").split(",")]:
        prompts = [[128000 + b, 791, 6864, 315] for b in range(B)]
        list(model.stream(prompts, max_new_tokens=2))
        dec = model.last_decoder
        r[f"mk_b{B}_ms"] = timed(dec.kernel.launch, reps=50)
        dec.kernel.check()
        peer = TorchLlamaStep(model, B)
        ids = torch.ones(B, dtype=torch.long, device="cuda")
        pos = torch.tensor([10], dtype=torch.long, device="cuda")
        with torch.no_grad():
            g = graph_of(lambda: peer.step(ids, pos))
            r[f"torch_graph_b{B}_ms"] = timed(g.replay, reps=30)
            try:
                t0 = time.time()
                step_c = torch.compile(peer.step, mode="reduce-overhead", fullgraph=False)
                for _ in range(3):
                    step_c(ids, pos)
                r[f"compile_b{B}_s"] = time.time() - t0
                r[f"torch_compile_b{B}_ms"] = timed(lambda: step_c(ids, pos), reps=30)
            except Exception as e:  # noqa: BLE001
                r[f"torch_compile_b{B}_error"] = repr(e)[:300]
        del peer
        torch.cuda.empty_cache()
        print(key, B, {k: v for k, v in r.items() if f"b{B}" in k}, flush=True)
    # --- 512-token prefill
    ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda", dtype=torch.int32)
    lengths = [512]
    with torch.no_grad():
        r["mk_prefill512_ms"] = timed(lambda: model._prefill(ids, lengths), reps=5, warmup=2)
        peer = TorchLlamaStep(model, 1)
        pos = torch.arange(512, device="cuda")
        r["torch_prefill512_ms"] = timed(lambda: peer.forward(ids.long(), pos), reps=5, warmup=2)
    print(key, "prefill", r["mk_prefill512_ms"], r["torch_prefill512_ms"], flush=True)
    del model, peer
    torch.cuda.empty_cache()


for key in (sys.argv[1:] or ["1b", "8b"]):
    try:
        run_shape(key)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        results["shapes"].setdefault(key, {})["error"] = traceback.format_exc()[-1500:]
    json.dump(results, open(os.path.join(OUT, "llama_probe.json"), "w"), indent=1)
