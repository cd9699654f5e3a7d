"""The tokenizer a GGUF file's metadata describes, built as a ``tokenizers.Tokenizer``.

A GGUF holds no ``tokenizer.json``: llama.cpp keeps the vocabulary (``tokenizer.ggml.tokens``),
each token's type, and per model kind the merges or the scores. Two kinds are built here,
as llama.cpp tokenizes them:

- ``tokenizer.ggml.model = "gpt2"``: byte-level BPE (Llama 3, Qwen, SmolLM, Mistral Nemo):
  the tokens and the merges, the text first split by the regular expressions llama.cpp uses
  for the file's ``tokenizer.ggml.pre`` (:data:`PRE_SPLITS`; SmolLM's splits every digit,
  Llama 3's groups them by three, Qwen2's keeps one a piece). A ``pre`` mk does not know is
  no tokenizer (a warning names it).
- ``"llama"``: SentencePiece-style BPE (Llama 2, Mistral 7B): the tokens and their scores
  (a merge ranks as high as the token it makes), a ``▁`` for each space and one in front of
  the text (unless ``tokenizer.ggml.add_space_prefix`` is false), bytes the vocabulary lacks
  as its ``<0xXX>`` tokens.

Tokens of type control (3) and unknown (2) are special (matched whole in text, left out
when decoding), user-defined ones (4) are matched whole. BOS is added when
``tokenizer.ggml.add_bos_token`` says so (default: as llama.cpp, for SentencePiece and
Llama 3 / Tekken vocabularies). EOS ids are the eos, eot and eom token ids. The chat
template is ``tokenizer.chat_template``, rendered in the same sandbox as a folder's.
Another ``tokenizer.ggml.model`` (bert, t5, rwkv, ...) gives no tokenizer, with a warning
naming it: mk then works on token ids, as with a folder without ``tokenizer.json``.
"""

from __future__ import annotations

import warnings

from .tokenizer import Tokenizer

# llama.cpp's pre-tokenizer expressions (llama-vocab.cpp), written as the ``tokenizers``
# library (Oniguruma) reads them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = r"\p{N}"

#: ``tokenizer.ggml.pre`` -> the expressions that split the text, in turn, before BPE.
PRE_SPLITS = {
    **dict.fromkeys(("gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "megrez"), (_QWEN2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (_DIGITS, _GPT2)),
    "tekken": (_TEKKEN,),
}
#: Vocabularies whose whole words are looked up before any merge (llama.cpp's ignore_merges),
#: and that add BOS unless the file says otherwise.
WHOLE_WORDS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "tekken")
#: llama.cpp's token types.
UNKNOWN, CONTROL, USER_DEFINED, BYTE = 2, 3, 4, 6
#: What each ``tokenizer.ggml.model`` is built as.
MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece-style BPE"}
SPACE = "\u2581"   # SentencePiece's ▁


def build_tokenizer(ckpt) -> Tokenizer | None:
    """The tokenizer of ``ckpt`` (a :class:`mk.models.gguf.GGUFCheckpoint`), or None (see the
    module docstring). ValueError naming the file and the key when the metadata is
    inconsistent: tokens given twice, more tokens than the model's vocabulary, merges naming
    tokens the vocabulary lacks, arrays of another length than the tokens, special ids beyond them."""
    path = ckpt.path
    model = ckpt.get("tokenizer.ggml.model", "str", None)
    if model is None or model == "none":
        return None
    if model not in MODELS:
        return _ids_only(f"{path}: tokenizer.ggml.model is {model!r}; mk builds "
                         f"{' and '.join(f'{k!r} ({v})' for k, v in MODELS.items())} tokenizers")
    pre = ckpt.get("tokenizer.ggml.pre", "str", "default") if model == "gpt2" else None
    if model == "gpt2" and pre not in PRE_SPLITS:
        return _ids_only(f"{path}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer mk does not know (it knows "
                         f"{', '.join(sorted(PRE_SPLITS))})")
    tokens = ckpt.get("tokenizer.ggml.tokens", "strs")
    n = len(tokens)
    vocab = {}
    for i, t in enumerate(tokens):
        if vocab.setdefault(t, i) != i:
            raise ValueError(f"{path}: tokenizer.ggml.tokens holds {t!r} twice (ids {vocab[t]} and {i})")
    if n > ckpt.config["vocab_size"]:
        raise ValueError(f"{path}: tokenizer.ggml.tokens holds {n} tokens, more than the model's vocabulary "
                         f"({ckpt.config['vocab_size']})")
    types = _per_token(ckpt, "tokenizer.ggml.token_type", "ints", n, [1] * n)

    def token_id(key: str) -> int | None:
        i = ckpt.get(f"tokenizer.ggml.{key}", "int", None)
        if i is not None and not 0 <= i < n:
            raise ValueError(f"{path}: tokenizer.ggml.{key} is {i}, beyond the {n} tokens")
        return i

    bos, unk = token_id("bos_token_id"), token_id("unknown_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in map(token_id, ("eos_token_id", "eot_token_id", "eom_token_id"))
                                  if i is not None))
    pad = token_id("padding_token_id")
    if model == "gpt2":
        tok = _byte_level(ckpt, vocab, pre)
        add_bos = pre in WHOLE_WORDS
    else:
        tok = _sentencepiece(ckpt, vocab, tokens, types, unk)
        add_bos = True
    add_bos = ckpt.get("tokenizer.ggml.add_bos_token", "bool", add_bos)
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    names = {"bos_token": bos, "eos_token": eos_ids[0] if eos_ids else None, "unk_token": unk, "pad_token": pad}
    special_tokens = {k: tokens[i] for k, i in names.items() if i is not None}
    template = ckpt.get("tokenizer.chat_template", "str", None)
    return Tokenizer(tok, bos, eos_ids, add_bos=add_bos, chat_template=template, special_tokens=special_tokens,
                     chat_template_source=f"{path} (tokenizer.chat_template)")


def _ids_only(why: str) -> None:
    """No tokenizer: a warning saying ``why`` and what the model then works on."""
    warnings.warn(f"{why}, so this model works on token ids (no text prompts, no chat template)", UserWarning,
                  stacklevel=3)


def _per_token(ckpt, key: str, kind: str, n: int, default):
    """Array ``key`` of one value a token (``default`` when absent); ValueError if its length is not ``n``."""
    values = ckpt.get(key, kind, None)
    if values is None:
        return default
    if len(values) != n:
        raise ValueError(f"{ckpt.path}: {key} holds {len(values)} values for {n} tokens")
    return values


def _byte_level(ckpt, vocab: dict[str, int], pre: str):
    """Byte-level BPE: the file's merges, its pre-tokenizer's splits, then bytes as characters."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    merges = []
    for k, m in enumerate(ckpt.get("tokenizer.ggml.merges", "strs")):
        cut = m.find(" ", 1)   # (as llama.cpp reads them: the first space after the first character)
        if cut < 0 or m[:cut] not in vocab or m[cut + 1:] not in vocab or m[:cut] + m[cut + 1:] not in vocab:
            raise ValueError(f"{ckpt.path}: tokenizer.ggml.merges[{k}] is {m!r}, not two tokens of the vocabulary "
                             f"whose join is one")
        merges.append((m[:cut], m[cut + 1:]))
    tok = HFTokenizer(BPE(vocab, merges, ignore_merges=pre in WHOLE_WORDS))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(ckpt, vocab: dict[str, int], tokens: list[str], types: list[int], unk: int | None):
    """SentencePiece-style BPE: merges from the scores, ``▁`` for spaces, byte fallback."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    scores = _per_token(ckpt, "tokenizer.ggml.scores", "floats", len(tokens), None)
    if scores is None:
        raise ValueError(f"{ckpt.path}: metadata lacks tokenizer.ggml.scores, which a 'llama' (SentencePiece) "
                         f"tokenizer merges by")
    tok = HFTokenizer(BPE(vocab, sentencepiece_merges(tokens, scores, types),
                          unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True))
    prefix = ckpt.get("tokenizer.ggml.add_space_prefix", "bool", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merges a BPE model needs to tokenize as SentencePiece's BPE does: SentencePiece
    joins, again and again, the adjacent pair whose join is the vocabulary's highest-scored
    token; so every split of a token into two tokens is a merge, ranked by the score of the
    token it makes (then by its id). Only normal tokens take part (not control, unknown or
    byte tokens, which SentencePiece never makes by merging)."""
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k not in (CONTROL, UNKNOWN, BYTE)}
    ranked = []
    for t, i in normal.items():
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in normal and b in normal:
                ranked.append((-scores[i], i, cut, a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


__all__ = ["PRE_SPLITS", "build_tokenizer", "sentencepiece_merges"]
