"""Text in and out: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.

Only the fast-tokenizer file is read (every Llama on the Hub ships one); a folder
without it has no tokenizer, and mk then works on token ids alone. Instruct checkpoints
also ship a chat template (Jinja), which :meth:`Tokenizer.apply_chat_template` renders
as ``transformers`` does.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import re
import stat
from datetime import datetime

from tokenizers import Tokenizer as _HFTokenizer

from .config import json_bool, parse_config_json, read_text_file

#: The standalone chat-template file; it wins over ``tokenizer_config.json``'s entry (as in transformers).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: A ``tokenizer.json`` larger than this is refused before it is read (the largest on the Hub are tens of MiB).
MAX_TOKENIZER_BYTES = 2**30
#: Token ids the ``tokenizers`` library takes: unsigned 32-bit.
_MAX_TOKEN_ID = 2**32

# A chat template is code from the checkpoint, run in jinja2's sandbox (no attribute of
# Python's internals, no mutation of the inputs), which bounds what it may reach but not
# how much it may compute: `{{ 'a' * 10**9 }}` or a loop doubling a string would fill the
# memory, nested range() loops would run for ever. So the rendering is bounded too:
#: Characters of the rendered text, and the most any string or list the template makes
#: (by *, +, ~, %, a filter or a call) may hold; a width or count argument beyond it is
#: refused before the call. 16 Mi characters: far more than any model's context.
MAX_CHAT_TEXT = 2**24
#: Items all the range() calls of one rendering may produce together (jinja2's sandbox
#: bounds one range at 100000 items, which nested loops multiply).
MAX_RANGE_ITEMS = 100_000
#: Bits of the largest integer a template may compute (``**`` or ``*`` of big numbers).
MAX_INT_BITS = 2**16


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
                 chat_template: str | None = None, special_tokens: dict | None = None,
                 chat_template_source: str = "this tokenizer"):
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        #: Where the chat template comes from (a file), for error messages.
        self.chat_template_source = chat_template_source
        self.special_tokens = dict(special_tokens or {})

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added (special) tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``, with BOS first if the checkpoint wants one (or ``add_bos`` says)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TypeError(f"add_bos must be a bool or None, got {type(add_bos).__name__}")
        ids = self.tokenizer.encode(text).ids
        want = self.add_bos if add_bos is None else (add_bos and self.bos_token_id is not None)
        # Llama 3's tokenizer.json adds BOS itself (a TemplateProcessing post-processor): never add a second.
        if want and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, ...) left out unless asked for. An id
        the vocabulary does not hold decodes to nothing (a model's vocabulary may be padded
        beyond its tokenizer's); one that is no token id at all (negative, or beyond the
        tokenizer's unsigned 32 bits) is a ValueError naming it."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        out = []
        for k, i in enumerate(ids):
            try:
                if isinstance(i, (bool, float)):
                    raise TypeError
                i = operator.index(i)
            except TypeError:
                raise TypeError(f"ids must be ints, got {i!r} ({type(i).__name__}) at ids[{k}]") from None
            if not 0 <= i < _MAX_TOKEN_ID:
                raise ValueError(f"ids[{k}] is {i}, not a token id (ids are in [0, 2**32))")
            out.append(i)
        return self.tokenizer.decode(out, skip_special_tokens=bool(skip_special_tokens))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """The checkpoint's chat template rendered over ``messages`` (``[{"role": "user",
        "content": "..."}, ...]``), as ``transformers``' ``apply_chat_template`` renders it.

        The template sees ``messages``, ``add_generation_prompt`` (true: end with the header
        that opens the assistant's turn), ``bos_token``, ``eos_token`` and the checkpoint's
        other special tokens as strings. Returns the token ids (``tokenize=True``) or the
        text; the ids are the text's with no BOS added (the template writes it into the text).
        Raises ValueError when the checkpoint has no chat template, or the template refuses
        the messages (its ``raise_exception``), fails (any error it raises), or makes more
        than :data:`MAX_CHAT_TEXT` characters (``chat template of <file>: ...``).
        """
        import jinja2

        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (no \"chat_template\" in tokenizer_config.json, "
                             f"no {CHAT_TEMPLATE_FILE}); give the prompt as plain text instead")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)) or not messages or \
                any(not isinstance(m, dict) for m in messages):
            raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
        # As transformers does: keys whose value is None are left out; tools/documents are none.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, "tools": None, "documents": None}
        where = f"chat template of {self.chat_template_source}"
        template = _compile_chat_template(self.chat_template, where)
        pieces, size = [], 0
        try:
            # Streamed, so that the text is refused as it passes the bound, not once it is all made.
            for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           range=_RangeBudget(), **variables):
                size += len(piece)
                if size > MAX_CHAT_TEXT:
                    raise _TooLarge(f"the rendered text passes {MAX_CHAT_TEXT} characters")
                pieces.append(piece)
        except RecursionError:
            raise ValueError(f"{where}: it recurses without end") from None
        except Exception as e:   # the template's own error (raise_exception) or Python's (1 // 0, ...)
            what = str(e) if isinstance(e, (jinja2.TemplateError, _TooLarge)) else f"{type(e).__name__}: {e}"
            raise ValueError(f"{where}: {what}") from None
        text = "".join(pieces)
        if not tokenize:
            return text
        return self.tokenizer.encode(text, add_special_tokens=False).ids


class _TooLarge(Exception):
    """A chat template went past one of the bounds above."""


class _RangeBudget:
    """``range`` for one rendering: jinja2's sandboxed range, all calls together bounded at
    :data:`MAX_RANGE_ITEMS` items."""

    def __init__(self):
        self.left = MAX_RANGE_ITEMS

    def __call__(self, *args):
        r = range(*args)
        try:
            self.left -= len(r)
        except OverflowError:   # more items than a Python int of the machine's size
            self.left = -1
        if self.left < 0:
            raise _TooLarge(f"its range() calls ask for more than {MAX_RANGE_ITEMS} items in all")
        return r


#: A %-format or str.format width (or precision) in a template's string: "%12d", "{:>12}".
_WIDTH = re.compile(r"%[-#0 +]*(\d+)|%[-#0 +]*\d*\.(\d+)|\{[^{}]*?[:.](?:[^{}]*?\D)?(\d+)[^{}]*\}")
#: A %-format taking its width from the arguments: "%*s".
_STAR_WIDTH = re.compile(r"%[-#0 +]*\*")


def _check_made(value):
    """``value`` once it is within the bounds a template's values must keep (strings and
    containers of at most :data:`MAX_CHAT_TEXT` items, integers of at most :data:`MAX_INT_BITS`)."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_CHAT_TEXT:
        raise _TooLarge(f"it makes a {type(value).__name__} of {len(value)} items (at most {MAX_CHAT_TEXT})")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise _TooLarge(f"it makes an integer of {value.bit_length()} bits (at most {MAX_INT_BITS})")
    return value


def _check_counts(args, kwargs) -> None:
    """Refuse, before the call, a width or count argument (of center, indent, ljust, ...)
    beyond :data:`MAX_CHAT_TEXT`: the call would make a value that large."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_CHAT_TEXT:
            raise _TooLarge(f"it passes a width or count of {a} (at most {MAX_CHAT_TEXT})")


def _check_format_widths(text: object) -> None:
    """Refuse a format string (``%``, ``|format``, ``str.format``) with a width or precision
    beyond :data:`MAX_CHAT_TEXT`."""
    if isinstance(text, str):
        for m in _WIDTH.finditer(text):
            width = int(next(g for g in m.groups() if g is not None))
            if width > MAX_CHAT_TEXT:
                raise _TooLarge(f"it formats with a width of {width} (at most {MAX_CHAT_TEXT})")


def _check_join(parts: object, sep: object = "") -> None:
    """Refuse a join of strings (and separators) holding more than :data:`MAX_CHAT_TEXT`
    characters together."""
    if isinstance(parts, (list, tuple)):
        total = sum(len(p) if isinstance(p, str) else 1 for p in parts)
        total += len(sep) * max(len(parts) - 1, 0) if isinstance(sep, str) else 0
        if total > MAX_CHAT_TEXT:
            raise _TooLarge(f"it joins {total} characters (at most {MAX_CHAT_TEXT})")


#: Filters and str methods whose int arguments are widths or counts of what they make.
_COUNTING = frozenset({"center", "indent", "wordwrap", "slice", "batch", "ljust", "rjust", "zfill", "expandtabs"})


def _bounded_filter(name: str, f):
    """A filter of the template's, its widths, counts and result held to the bounds."""
    @functools.wraps(f)   # (keeps jinja2's pass_context & co. marks)
    def call(*args, **kwargs):
        if name in _COUNTING:
            _check_counts(args, kwargs)
        elif name == "format":
            _check_format_widths(next((a for a in args if isinstance(a, str)), None))
        elif name == "join":   # join(value, d="", attribute=None), after jinja2's eval context
            from jinja2.nodes import EvalContext

            rest = [a for a in args if not isinstance(a, EvalContext)]
            _check_join(rest[0] if rest else None, rest[1] if len(rest) > 1 else kwargs.get("d", ""))
        return _check_made(f(*args, **kwargs))

    return call


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str, where: str = "chat template"):
    """A chat template compiled the way transformers compiles it: a sandboxed Jinja
    environment (Hub templates are untrusted code) with ``trim_blocks`` and
    ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and a ``tojson``
    that does not escape HTML; every operator, filter and call that can make a large value
    held to the bounds above (:data:`MAX_CHAT_TEXT`, :data:`MAX_INT_BITS`)."""
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):   # `a ~ b`: no operator jinja2 lets a sandbox intercept
            self.write("environment.check_made(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        check_made = staticmethod(_check_made)

        def call_binop(self, context, op, left, right):
            if op == "*":   # 'a' * n, [x] * n: the size before it is made
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and \
                            len(seq) * max(n, 0) > MAX_CHAT_TEXT:
                        raise _TooLarge(f"it repeats a {type(seq).__name__} of {len(seq)} items {n} times "
                                        f"(at most {MAX_CHAT_TEXT} items)")
            elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                    right * left.bit_length() > MAX_INT_BITS:
                raise _TooLarge(f"it raises {left} to the power {right} (at most {MAX_INT_BITS} bits)")
            elif op == "%" and isinstance(left, str):
                _check_format_widths(left)
                if _STAR_WIDTH.search(left):   # '%*s' % (n, x): n is a width
                    _check_counts(right if isinstance(right, tuple) else (right,), {})
            return _check_made(super().call_binop(context, op, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            method = getattr(__obj, "__wrapped__", __obj)   # (the sandbox wraps str.format)
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str):   # a method of a string
                name = getattr(method, "__name__", "")
                if name in _COUNTING:
                    _check_counts(args, kwargs)
                elif name in ("format", "format_map"):
                    _check_format_widths(owner)
                elif name == "join" and args:
                    _check_join(args[0], owner)
            return _check_made(super().call(__context, __obj, *args, **kwargs))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {k: _bounded_filter(k, f) for k, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: not valid Jinja ({e})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to compile") from None


def _read_json(path: str) -> dict:
    """A JSON object file of the checkpoint ({} when there is none); ValueError naming the
    file when it is not a small regular UTF-8 file holding a JSON object."""
    try:
        text = read_text_file(path)
    except FileNotFoundError:
        return {}
    value = parse_config_json(text, path)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(tok: object, key: str, path: str) -> str | None:
    """A special token of tokenizer_config.json: written as ``"<s>"`` or ``{"content": "<s>", ...}``
    (or null); ValueError naming the file and the field for anything else."""
    content = tok.get("content") if isinstance(tok, dict) else tok
    if content is not None and not isinstance(content, str):
        raise ValueError(f'{path}: {key} must be a string or {{"content": string}}, got {tok!r}')
    return content


def _special_tokens(tok_cfg: dict, path: str) -> dict:
    """``tokenizer_config.json``'s special tokens as the strings a chat template sees:
    ``bos_token``, ``eos_token``, ``pad_token``... (each a string or ``{"content": ...}``)
    and ``additional_special_tokens``."""
    out = {}
    for key, value in tok_cfg.items():
        if key.endswith("_token") and isinstance(value, (str, dict)):
            content = value.get("content") if isinstance(value, dict) else value
            if isinstance(content, str):
                out[key] = content
    extra = tok_cfg.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [c.get("content") if isinstance(c, dict) else c for c in extra]
        out["additional_special_tokens"] = [c for c in out["additional_special_tokens"] if isinstance(c, str)]
    return out


def _chat_template(folder: str, tok_cfg: dict, cfg_path: str) -> tuple[str | None, str]:
    """The folder's chat template and the file it comes from: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name",
    "template"}`` of which the one named ``"default"`` is taken); None when there is none.
    ValueError naming the file and the field when either is there but unreadable or of
    another type."""
    path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    try:
        return read_text_file(path), path
    except FileNotFoundError:
        pass
    value = tok_cfg.get("chat_template")
    if value is None:
        return None, cfg_path
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in value):
            raise ValueError(f'{cfg_path}: chat_template must be a string or a list of {{"name": string, '
                             f'"template": string}}, got {value!r:.200}')
        value = next((t["template"] for t in value if t["name"] == "default"), None)
    elif not isinstance(value, str):
        raise ValueError(f"{cfg_path}: chat_template must be a string or a list of named templates, got {value!r:.200}")
    return value, cfg_path


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or None when it has no ``tokenizer.json``.

    BOS comes from ``tokenizer_config.json`` (``bos_token``, ``add_bos_token``), else from
    ``config.json``'s ``bos_token_id``; the EOS ids are both files' together. The chat
    template comes from ``chat_template.jinja`` or ``tokenizer_config.json``. Raises
    ValueError naming the file (and the field) when ``tokenizer.json``, a config or the
    template file is unreadable or says something of the wrong type.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: is {'a folder' if stat.S_ISDIR(st.st_mode) else 'not a plain file'}, "
                         f"not a regular file")
    if st.st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{path}: larger than the {MAX_TOKENIZER_BYTES // 2**20} MiB mk reads of a tokenizer")
    try:
        tok = _HFTokenizer.from_file(path)
    except Exception as e:   # tokenizers raises a plain Exception on a malformed file
        raise ValueError(f"{path}: not a readable tokenizer file: {e}") from None
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    tok_cfg = _read_json(cfg_path)
    model_cfg = _read_json(os.path.join(folder, "config.json"))

    def token_id(key: str) -> int | None:
        content = _token_content(tok_cfg.get(key), key, cfg_path)
        return tok.token_to_id(content) if content is not None else None

    def is_id(i) -> bool:
        return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < _MAX_TOKEN_ID

    bos = token_id("bos_token")
    if bos is None and is_id(model_cfg.get("bos_token_id")):
        bos = model_cfg["bos_token_id"]
    # Llama 3 instruct stops on any of several ids: the tokenizer's EOS and all of config.json's.
    e = model_cfg.get("eos_token_id")
    eos_ids = [token_id("eos_token")] + (list(e) if isinstance(e, list) else [e])
    eos_ids = tuple(dict.fromkeys(i for i in eos_ids if is_id(i)))
    add_bos = json_bool(tok_cfg, "add_bos_token", cfg_path, default=True)
    template, template_path = _chat_template(folder, tok_cfg, cfg_path)
    return Tokenizer(tok, bos, eos_ids, add_bos=add_bos, chat_template=template,
                     special_tokens=_special_tokens(tok_cfg, cfg_path), chat_template_source=template_path)
