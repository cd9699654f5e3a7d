"""``python -m mk generate``: decode with a Llama through the megakernel, checked against the reference.

With ``--model DIR`` it loads a Hugging Face checkpoint; without, it builds a small Llama
with random weights from a fixed seed, so the command works on any machine (on a CPU
through the Triton interpreter, in well under a minute).
"""

from __future__ import annotations

import time

import torch

from .models import Llama, LlamaConfig, ReferenceLlama, greedy_generate
from .tasks import INTERPRET

#: The embedded default model: small enough for the interpreter, a real GQA Llama shape.
DEFAULT_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, eos_token_id=None)
DEFAULT_SEED = 0
DEFAULT_IDS = [1, 17, 42, 311, 7, 99]


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--ids is empty")
    return ids


def run_generate(args) -> int:
    """Build or load the model, generate, print plan, tokens (or text), tokens/s and the check."""
    if args.prompt is not None and args.ids is not None:
        raise ValueError("give --prompt or --ids, not both")
    new = args.max_new_tokens if args.max_new_tokens is not None else (8 if INTERPRET else 32)
    if new < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {new}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    t0 = time.perf_counter()
    if args.model:
        config = LlamaConfig.from_pretrained(args.model)
        tokenizer_model = args.model
    else:
        config, tokenizer_model = LlamaConfig(**DEFAULT_CONFIG), None
    if args.prompt is not None:
        from .models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_model) if tokenizer_model else None
        if tokenizer is None:
            raise ValueError("this model has no tokenizer.json: give token ids with --ids")
        ids = tokenizer.encode(args.prompt)
    else:
        tokenizer = None
        ids = _parse_ids(args.ids) if args.ids is not None else DEFAULT_IDS
    if any(not 0 <= i < config.vocab_size for i in ids):
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got {ids}")
    max_seq = len(ids) + new
    if max_seq > config.max_position_embeddings:
        raise ValueError(f"{len(ids)} prompt tokens + {new} new exceed the model's "
                         f"{config.max_position_embeddings} positions")
    kv_dtype = getattr(torch, args.kv_dtype) if args.kv_dtype else None
    if args.model:
        model = Llama.from_pretrained(args.model, max_batch_size=args.batch, max_seq_len=max_seq, kv_dtype=kv_dtype)
    else:
        model = Llama.from_config(config, seed=DEFAULT_SEED, max_batch_size=args.batch, max_seq_len=max_seq,
                                  name="mk-default-llama", kv_dtype=kv_dtype)
    where = "CPU (Triton interpreter)" if INTERPRET else torch.cuda.get_device_name()
    print(f"model {model.name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
          f"{config.vocab_size}, {str(model.dtype).replace('torch.', '')} (KV cache "
          f"{str(model.kv_dtype).replace('torch.', '')}) on {where} "
          f"(ready in {time.perf_counter() - t0:.1f} s)")
    plan, _ = model.plan(args.batch, model.plan_length(len(ids) + new))
    print(f"plan: {plan.predicted_s * 1e6:.1f} us predicted per step on {plan.device}, "
          f"{sum(1 for c in plan.choices.values() for _ in c.fuse)} fusions, peak shared memory "
          f"{plan.peak_smem_bytes / 1024:.1f} KiB")
    prompts = [ids] * args.batch
    out = model.generate(prompts, max_new_tokens=new, temperature=args.temperature, top_p=args.top_p,
                         seed=args.seed)
    stats = model.last_stats
    produced = sum(len(o) - len(ids) for o in out)
    steps = max(len(o) - len(ids) for o in out)
    decode_s = stats.get("decode_s", 0.0)
    for b, o in enumerate(out):
        text = f"  {tokenizer.decode(o[len(ids):])!r}" if tokenizer else ""
        print(f"[{b}] {o[:len(ids)]} -> {o[len(ids):]}{text}")
    print(f"prefill {stats.get('prefill_s', 0.0) * 1e3:.1f} ms; decode {steps} steps in {decode_s:.2f} s: "
          f"{produced / max(decode_s, 1e-9):.1f} tokens/s ({decode_s / max(steps, 1) * 1e3:.2f} ms/step, one "
          f"launch each)")
    if args.temperature == 0.0:
        check = min(args.check_steps, new)
        ref = ReferenceLlama(config, model.hf_weights())
        want = greedy_generate(ref, [ids], check)[0]
        got = out[0][len(ids):len(ids) + check]
        same = sum(1 for a, b in zip(got, want) if a == b)
        print(f"check: first {check} greedy tokens {'match' if got == want else 'differ from'} the float32 "
              f"torch reference ({same}/{check})")
        if got != want and model.dtype == torch.float32:
            return 1
    return 0
