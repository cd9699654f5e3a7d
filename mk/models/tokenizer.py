"""Text in and out: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.

Only the fast-tokenizer file is read (every Llama on the Hub ships one); a folder
without it has no tokenizer, and mk then works on token ids alone.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` for one checkpoint.

    ``bos_token_id`` is added in front by :meth:`encode` when the checkpoint asks for it
    (``add_bos_token`` in ``tokenizer_config.json``, default true when a BOS token is
    known) and the tokenizer's own post-processor has not already put it there.
    """

    def __init__(self, tokenizer: _HFTokenizer, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), add_bos: bool = True):
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos and bos_token_id is not None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``, with BOS first if the checkpoint wants one (or ``add_bos`` says)."""
        ids = self.tokenizer.encode(text).ids
        want = self.add_bos if add_bos is None else (add_bos and self.bos_token_id is not None)
        # Llama 3's tokenizer.json adds BOS itself (a TemplateProcessing post-processor): never add a second.
        if want and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, ...) left out unless asked for."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def _token_content(tok: object) -> str | None:
    # tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}.
    return tok.get("content") if isinstance(tok, dict) else tok


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or None when it has no ``tokenizer.json``.

    BOS comes from ``tokenizer_config.json`` (``bos_token``, ``add_bos_token``), else from
    ``config.json``'s ``bos_token_id``; the EOS ids are both files' together. Raises ValueError
    naming the file when ``tokenizer.json`` or a config is unreadable.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        tok = _HFTokenizer.from_file(path)
    except Exception as e:   # tokenizers raises a plain Exception on a malformed file
        raise ValueError(f"{path}: not a readable tokenizer file: {e}") from None
    tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    model_cfg = _read_json(os.path.join(folder, "config.json"))

    def token_id(key: str) -> int | None:
        content = _token_content(tok_cfg.get(key))
        return tok.token_to_id(content) if content is not None else None

    bos = token_id("bos_token")
    if bos is None and isinstance(model_cfg.get("bos_token_id"), int):
        bos = model_cfg["bos_token_id"]
    # Llama 3 instruct stops on any of several ids: the tokenizer's EOS and all of config.json's.
    e = model_cfg.get("eos_token_id")
    eos_ids = [token_id("eos_token")] + (list(e) if isinstance(e, list) else [e])
    eos_ids = tuple(dict.fromkeys(i for i in eos_ids if isinstance(i, int)))
    return Tokenizer(tok, bos, eos_ids, add_bos=bool(tok_cfg.get("add_bos_token", True)))
