"""Text in and out: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.

Only the fast-tokenizer file is read (every Llama on the Hub ships one); a folder
without it has no tokenizer, and mk then works on token ids alone. Instruct checkpoints
also ship a chat template (Jinja), which :meth:`Tokenizer.apply_chat_template` renders
as ``transformers`` does.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime

from tokenizers import Tokenizer as _HFTokenizer

#: The standalone chat-template file; it wins over ``tokenizer_config.json``'s entry (as in transformers).
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` for one checkpoint.

    ``bos_token_id`` is added in front by :meth:`encode` when the checkpoint asks for it
    (``add_bos_token`` in ``tokenizer_config.json``, default true when a BOS token is
    known) and the tokenizer's own post-processor has not already put it there.
    ``chat_template`` (Jinja source, or None) and ``special_tokens`` (``{"bos_token": "<s>",
    ...}``, the strings a template sees) serve :meth:`apply_chat_template`.
    """

    def __init__(self, tokenizer: _HFTokenizer, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), add_bos: bool = True, *,
                 chat_template: str | None = None, special_tokens: dict | None = None):
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added (special) tokens included."""
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """The checkpoint's chat template rendered over ``messages`` (``[{"role": "user",
        "content": "..."}, ...]``), as ``transformers``' ``apply_chat_template`` renders it.

        The template sees ``messages``, ``add_generation_prompt`` (true: end with the header
        that opens the assistant's turn), ``bos_token``, ``eos_token`` and the checkpoint's
        other special tokens as strings. Returns the token ids (``tokenize=True``) or the
        text; the ids are the text's with no BOS added (the template writes it into the text).
        Raises ValueError when the checkpoint has no chat template or the template refuses
        the messages (its ``raise_exception``).
        """
        import jinja2

        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (no \"chat_template\" in tokenizer_config.json, "
                             f"no {CHAT_TEMPLATE_FILE}); give the prompt as plain text instead")
        if isinstance(messages, (str, bytes)) or not messages or \
                any(not isinstance(m, dict) for m in messages):
            raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
        # As transformers does: keys whose value is None are left out; tools/documents are none.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, "tools": None, "documents": None}
        try:
            text = _compile_chat_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e
        if not tokenize:
            return text
        return self.tokenizer.encode(text, add_special_tokens=False).ids


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str):
    """A chat template compiled the way transformers compiles it: a sandboxed Jinja
    environment (Hub templates are untrusted code) with ``trim_blocks`` and
    ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and a ``tojson``
    that does not escape HTML."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template: not valid Jinja ({e})") from e


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


def _special_tokens(tok_cfg: dict) -> dict:
    """``tokenizer_config.json``'s special tokens as the strings a chat template sees:
    ``bos_token``, ``eos_token``, ``pad_token``... (each a string or ``{"content": ...}``)
    and ``additional_special_tokens``."""
    out = {}
    for key, value in tok_cfg.items():
        if key.endswith("_token") and isinstance(_token_content(value), str):
            out[key] = _token_content(value)
    extra = tok_cfg.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [c for c in map(_token_content, extra) if isinstance(c, str)]
    return out


def _chat_template(folder: str, tok_cfg: dict) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which the one named
    ``"default"`` is taken); None when there is none."""
    path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    value = tok_cfg.get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or None when it has no ``tokenizer.json``.

    BOS comes from ``tokenizer_config.json`` (``bos_token``, ``add_bos_token``), else from
    ``config.json``'s ``bos_token_id``; the EOS ids are both files' together. The chat
    template comes from ``chat_template.jinja`` or ``tokenizer_config.json``. Raises
    ValueError naming the file when ``tokenizer.json`` or a config is unreadable.
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
    return Tokenizer(tok, bos, eos_ids, add_bos=bool(tok_cfg.get("add_bos_token", True)),
                     chat_template=_chat_template(folder, tok_cfg), special_tokens=_special_tokens(tok_cfg))
