"""GPU probe: where a bf16 Llama's logits error comes from (a float32 torch emulation).

The float32 reference forward, with bf16 rounding switched on at chosen points (what mk's
prefill and decode store in bf16), on the Llama-3.2-1B / Llama-3-8B shapes with random bf16
weights. For each set of rounding points: prefill logits' relative error against no
rounding, the decode-step error after 16 greedy steps (teacher-forced on the float32
tokens), and how many greedy steps agree. Also the top-1 / top-2 logit gaps of the float32
run, which say how close to a tie random weights put the greedy choice.
Usage: OUT=dir python bench/probes/precision_probe.py [1b|8b ...]
"""
import json, math, os, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _llama_shapes import SHAPES, random_model  # noqa: E402
from mk.models import LlamaConfig  # noqa: E402
from mk.models.reference import ReferenceLlama, _rmsnorm, _rotate  # noqa: E402

VARIANTS = {
    "f32": set(),
    "kv": {"kv"},
    "decode_now": {"qkv", "kv", "attn", "act"},
    "prefill_now": {"h", "qkv", "kv", "probs", "attn", "act", "final_h"},
    "kv_h": {"kv", "h"},
    "kv_probs": {"kv", "probs"},
    "kv_h_probs": {"kv", "h", "probs", "final_h"},
}


def bf(t, on):
    return t.to(torch.bfloat16).float() if on else t


class Rounded(ReferenceLlama):
    """The reference forward (batch 1, no padding) with bf16 rounding at ``points``."""

    def run(self, tokens, cache_k, cache_v, start, points):
        c = self.config
        T = len(tokens)
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        pos = torch.arange(start, start + T, device=self.device)
        S = start + T
        angle = pos.float()[:, None] * self.inv_freq
        angle = torch.cat([angle, angle], -1)[:, None, :]
        cos, sin = angle.cos(), angle.sin()
        allowed = torch.arange(S, device=self.device)[None, :] <= pos[:, None]
        x = self._w("model.embed_tokens.weight")[torch.tensor(tokens, device=self.device)]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = bf(_rmsnorm(x, self._w(p + "input_layernorm.weight"), c.rms_norm_eps), "h" in points)
            q = bf(h @ self._w(p + "self_attn.q_proj.weight").T, "qkv" in points).view(T, H, D)
            k = bf(h @ self._w(p + "self_attn.k_proj.weight").T, "qkv" in points).view(T, Hkv, D)
            v = bf(h @ self._w(p + "self_attn.v_proj.weight").T, "qkv" in points).view(T, Hkv, D)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            cache_k[i, start:S] = bf(k, "kv" in points)
            cache_v[i, start:S] = bf(v, "kv" in points)
            keys = cache_k[i, :S].repeat_interleave(c.num_kv_groups, dim=1).transpose(0, 1)   # [H, S, D]
            vals = cache_v[i, :S].repeat_interleave(c.num_kv_groups, dim=1).transpose(0, 1)
            scores = (bf(q, "qkv" in points).transpose(0, 1) @ keys.transpose(-1, -2)) / math.sqrt(D)
            probs = bf(torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), -1), "probs" in points)
            attn = bf((probs @ vals).transpose(0, 1).reshape(T, H * D), "attn" in points)
            x = x + attn @ self._w(p + "self_attn.o_proj.weight").T
            h = bf(_rmsnorm(x, self._w(p + "post_attention_layernorm.weight"), c.rms_norm_eps), "h" in points)
            act = bf(F.silu(h @ self._w(p + "mlp.gate_proj.weight").T) * (h @ self._w(p + "mlp.up_proj.weight").T),
                     "act" in points)
            x = x + act @ self._w(p + "mlp.down_proj.weight").T
        x = bf(_rmsnorm(x, self._w("model.norm.weight"), c.rms_norm_eps), "final_h" in points)
        return x @ self._w(self.lm_head).T

    def greedy(self, prompt, steps, points, force=None):
        c = self.config
        shape = (c.num_hidden_layers, len(prompt) + steps, c.num_key_value_heads, c.head_dim)
        ck, cv = torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device)
        logits = self.run(prompt, ck, cv, 0, points)
        first, toks, last = logits, [], logits[-1]
        for s in range(steps):
            toks.append(int(last.argmax()))
            if s + 1 == steps:
                break
            feed = force[s] if force is not None else toks[-1]
            last = self.run([feed], ck, cv, len(prompt) + s, points)[-1]
        return first, toks, last


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def main():
    out = {"device": torch.cuda.get_device_name(), "shapes": {}}
    prompt = [128000, 791, 6864, 315, 9822, 374]
    steps = 16
    for key in sys.argv[1:] or ["1b", "8b"]:
        cfg = LlamaConfig(**SHAPES[key])
        ref = Rounded(cfg, random_model(cfg))
        r = out["shapes"][key] = {}
        f_first, f_toks, f_last = ref.greedy(prompt, steps, set())
        # gaps of the float32 run, teacher-forced along its own tokens
        gaps, stds = [], []
        ck = torch.zeros(cfg.num_hidden_layers, len(prompt) + steps, cfg.num_key_value_heads, cfg.head_dim,
                         device="cuda")
        cv = torch.zeros_like(ck)
        last = ref.run(prompt, ck, cv, 0, set())[-1]
        for s in range(steps):
            top = last.topk(2).values
            gaps.append((top[0] - top[1]).item())
            stds.append(last.std().item())
            if s + 1 < steps:
                last = ref.run([f_toks[s]], ck, cv, len(prompt) + s, set())[-1]
        r["f32_tokens"] = f_toks
        r["top1_top2_gap"] = gaps
        r["logit_std"] = sum(stds) / len(stds)
        for name, points in VARIANTS.items():
            first, toks, _ = ref.greedy(prompt, steps, points)
            _, _, last_forced = ref.greedy(prompt, steps, points, force=f_toks)
            agree = next((i for i, (a, b) in enumerate(zip(toks, f_toks)) if a != b), steps)
            r[name] = {"prefill_rel_err": rel(first, f_first), "decode_rel_err": rel(last_forced, f_last),
                       "greedy_agree_steps": agree}
            print(key, name, r[name], flush=True)
        try:  # transformers in float32 on the same weights: the yardstick the tokens are compared to
            from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
            hf = LlamaForCausalLM(HFConfig(**cfg.to_hf_dict())).to(device="cuda", dtype=torch.float32)
            hf.load_state_dict({k: v.float() for k, v in ref.weights.items()}, strict=False)
            hf.eval()
            ids = torch.tensor([prompt], device="cuda")
            g = hf.generate(ids, max_new_tokens=steps, do_sample=False,
                            attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
            r["hf_f32_prefill_rel_err"] = rel(hf(ids).logits[0].float(), f_first)
            r["hf_f32_greedy_agree_steps"] = next((i for i, (a, b) in enumerate(zip(g, f_toks)) if a != b), steps)
            print(key, "hf f32", r["hf_f32_prefill_rel_err"], r["hf_f32_greedy_agree_steps"], flush=True)
            del hf
        except Exception as e:  # noqa: BLE001
            r["hf_error"] = repr(e)[:300]
        print(key, "gaps", [round(g, 3) for g in gaps], "logit std", r["logit_std"], flush=True)
        del ref
        torch.cuda.empty_cache()
        json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "precision_probe.json"), "w"), indent=1)


main()
