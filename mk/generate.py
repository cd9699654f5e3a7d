"""``python -m mk generate``: decode through the megakernel, checked against the reference.

With ``--model DIR`` it loads a Hugging Face checkpoint of any family mk runs (Llama,
Mistral, Qwen2, Qwen3: :class:`~mk.models.AutoModel`), with ``--model FILE.gguf`` a GGUF
file of those architectures (:mod:`mk.models.gguf`); without, it builds a small Llama
with random weights from a fixed seed, so the command works on any machine (on a CPU
through the Triton interpreter, in well under a minute).

Output goes where tools people know put it: row 0's text (or ids) is printed to stdout
as its tokens arrive; what the command is doing (loading weights, planning + compiling,
prefill) goes to stderr, as one line rewritten in place on a terminal (with progress bars
where the work is countable) and as plain lines elsewhere (:class:`Status`).
"""

from __future__ import annotations

import os
import re
import sys
import time

import torch

from .models import AutoConfig, AutoModel, Llama, LlamaConfig, ReferenceLlama, greedy_generate
from .models.blocks import MAX_BATCH
from .models.decoder import MIN_TEMPERATURE, describe_formats
from .persistent.symmetric import SETUP_TIMEOUT_S, check_gpu_ranks, launch_env
from .tasks import supported_dtypes
from .tasks._cache import check_cache_dir
from .tasks.sample import _check_counter, _check_temperature, _check_top_k, _check_top_p

#: The embedded default model: small enough for the interpreter, a real GQA Llama shape.
DEFAULT_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, eos_token_id=None)
DEFAULT_SEED = 0
DEFAULT_IDS = [1, 17, 42, 311, 7, 99]
#: Default ``--max-new-tokens``: the interpreter takes a second or so a step, a GPU microseconds.
DEFAULT_NEW_TOKENS = {"cpu": 8, "cuda": 32}


class Status:
    """What a command is doing, on ``stream`` (default stderr): ``status("loading weights")``.

    On a terminal it is one line rewritten in place and cleared (:meth:`clear`) before the
    command prints to stdout; a step followed by a progress bar (``bar=True``) keeps its line
    above the bar and clears it once the step is done (the bar must not leave a line, as
    the planner's does not). Anywhere else (a pipe, a log file) each step is one plain line,
    ``mk: loading weights ...``, and nothing is rewritten: no carriage returns, no bars
    (:attr:`tty` says which; pass it as the ``progress`` of the work the step runs).
    """

    def __init__(self, stream=None):
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._shown: str | None = None  # None, "line" (the cursor is on it) or "above" (a bar's line below)

    def __call__(self, what: str, bar: bool = False) -> None:
        """Say that the command is now doing ``what``; ``bar``: a progress bar follows."""
        if self.tty:
            self.clear()
            self.stream.write(f"{what} ..." + ("\n" if bar else ""))
            self._shown = "above" if bar else "line"
        else:
            self.stream.write(f"mk: {what} ...\n")
        self.stream.flush()

    def clear(self) -> None:
        """Remove the status line from a terminal (no-op elsewhere, or with nothing shown)."""
        if self.tty and self._shown:
            # "above": the bar cleared its own line and left the cursor there; go up to the status.
            self.stream.write("\033[F\033[K" if self._shown == "above" else "\r\033[K")
            self.stream.flush()
        self._shown = None


class TextStreamer:
    """A row's text, piece by piece as its tokens arrive: ``put(token)`` returns the text
    that token adds, ``end()`` whatever is still held back.

    Each :meth:`put` decodes a short window of the sequence: the tokens since the last text
    it returned, after a few before them (:data:`ANCHOR` tokens of the prompt at first), and
    returns what the window's text adds to the anchor's. Decoding after an anchor keeps the
    space between tokens that a decoder strips from a sequence's first token; a character
    spread over several tokens (the UTF-8 bytes of a byte-level vocabulary) comes out whole:
    text ending in an incomplete character (U+FFFD) is held until the token that completes
    it. The work a token is constant, however long the sequence.
    """

    #: Prompt tokens decoded before the first new token (the anchor of the first window).
    ANCHOR = 6

    def __init__(self, tokenizer, prompt_ids=()):
        self.tokenizer = tokenizer
        self.prompt = list(prompt_ids)
        self.ids: list[int] = []
        self.prompt_text = tokenizer.decode(self.prompt)
        self._all = list(self.prompt)
        self._anchor = max(0, len(self._all) - self.ANCHOR)  # the window starts here...
        self._read = len(self._all)  # ...and its text up to here was returned

    def put(self, token: int) -> str:
        """Add one generated token; return the new text it completes (may be empty)."""
        self.ids.append(int(token))
        self._all.append(int(token))
        text = self.tokenizer.decode(self._all[self._anchor:])
        if text.endswith("\ufffd"):
            return ""
        return self._take(text, len(self._all))

    def end(self) -> str:
        """The text still held back (an incomplete last character comes out as U+FFFD)."""
        return self._take(self.tokenizer.decode(self._all[self._anchor:]), len(self._all))

    def _take(self, text: str, upto: int) -> str:
        seen = self.tokenizer.decode(self._all[self._anchor:self._read])
        self._anchor, self._read = self._read, upto
        return text[len(seen):]


#: An id of ``--ids``: ASCII digits, a leading minus allowed (refused by value, as out of range).
_ID = re.compile(r"-?[0-9]+")
#: Digits of the longest ``--ids`` item read as a number (no vocabulary is near 10**18).
_MAX_ID_DIGITS = 18


def _parse_ids(text: str) -> list[int]:
    """``--ids``' integers (ASCII digits only: int() would also take "1_0" and other
    scripts' digits); ValueError naming the first item that is not one."""
    items = [t for t in (t.strip() for t in text.split(",")) if t]
    for k, t in enumerate(items):
        if not _ID.fullmatch(t):
            got = repr(text) if len(text) <= 80 else f"{t[:20]!r} at position {k}"
            raise ValueError(f"--ids must be comma-separated integers, got {got}")
        if len(t.lstrip("-")) > _MAX_ID_DIGITS:
            raise ValueError(f"--ids: the id at position {k} has {len(t.lstrip('-'))} digits, beyond any "
                             f"vocabulary")
    if not items:
        raise ValueError("--ids is empty")
    return [int(t) for t in items]


def _check_ids(ids: list[int], vocab_size: int) -> None:
    """ValueError naming the first id outside the vocabulary, and its position (not the whole list)."""
    for k, i in enumerate(ids):
        if not 0 <= i < vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got {i} at position {k} of the prompt")


def _flag(flag: str, check, value):
    """``check(value)`` (one of mk.tasks.sample's checkers), its error naming the CLI flag."""
    try:
        return check(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{flag}: {err}") from None


def check_quantize_flags(args) -> None:
    """``--quantize-lm-head`` only with ``--quantize`` (argparse refuses an unknown format)."""
    if args.quantize_lm_head and not args.quantize:
        raise ValueError("--quantize-lm-head needs --quantize (the format: fp8 or fp8-block)")


def _check_args(args) -> int:
    """Every check that needs no model (flags, their ranges, torchrun's environment, the
    cache folder); returns max-new-tokens."""
    check_gpu_ranks("generate")  # (also reads WORLD_SIZE, RANK, LOCAL_RANK: each an int, in range)
    if args.model is not None and not args.model.strip():
        raise ValueError("--model is empty: give a checkpoint folder, or leave --model out for the default model")
    if args.prompt is not None and args.ids is not None:
        raise ValueError("give --prompt or --ids, not both")
    if args.chat and args.prompt is None:
        raise ValueError("--chat needs --prompt (the user message)")
    if args.ids is not None:
        _parse_ids(args.ids)
    if not 1 <= args.batch <= MAX_BATCH:
        raise ValueError(f"--batch must be in [1, {MAX_BATCH}] (sequences a decode step holds), got {args.batch}")
    if args.check_steps < 0:
        raise ValueError(f"--check-steps must be >= 0, got {args.check_steps}")
    _flag("--temperature", _check_temperature, args.temperature)
    _flag("--top-k", _check_top_k, args.top_k)
    _flag("--top-p", _check_top_p, args.top_p)
    _flag("--seed", lambda v: _check_counter("seed", v), args.seed)
    check_quantize_flags(args)
    # The model goes to the GPU when there is one (mk.tasks.default_device; its type only
    # here: no CUDA context is made before torchrun's rank picks its GPU).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.kv_dtype is not None and getattr(torch, args.kv_dtype) not in supported_dtypes(device):
        names = ", ".join(str(d).replace("torch.", "") for d in supported_dtypes(device))
        where = "the CPU (Triton interpreter)" if device == "cpu" else "a CUDA GPU"
        raise ValueError(f"--kv-dtype {args.kv_dtype}: the model goes to {where}, where mk's kernels run {names}")
    check_cache_dir()
    new = args.max_new_tokens
    if new is None:
        new = DEFAULT_NEW_TOKENS[device]
    if new < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {new}")
    return new


def _check_checkpoint(folder: str):
    """The checkpoint's config and tokenizer (None without tokenizer.json), once the folder,
    config.json, the safetensors headers and the tokenizer files are known good (the tensors
    themselves are checked as they load). The tokenizer is read by the loader the model
    uses (it reads it too, after the weights), so that a broken one is reported first. A
    GGUF file: its metadata, tensor index and tokenizer, likewise."""
    from .models.gguf import is_gguf_path, read_gguf
    from .models.tokenizer import load_tokenizer
    from .models.weights import SINGLE_FILE, _read_headers, _weight_files

    config = AutoConfig.from_pretrained(folder)
    if is_gguf_path(folder):
        gguf = read_gguf(folder)   # (kept: the model's load reads it again)
        gguf.check_tensors(config)
        return config, gguf.tokenizer()
    shards = sorted(set(_weight_files(folder).values())) or [os.path.join(folder, SINGLE_FILE)]
    _read_headers(shards)
    return config, load_tokenizer(folder)


def _size(nbytes: int) -> str:
    """Bytes as people read them: ``1.1 GiB``, ``12.5 MiB``, ``3.0 KiB``."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def model_line(model, ready_s: float) -> str:
    """What the commands say of a model once it is ready: its family and sizes, how its
    weights are stored and their bytes on its device (``footprint()``), its KV cache, its
    prefill precision and where it runs. FP8 weights on the CPU are held in float32 (the
    interpreter computes in float32): the line says so, as their bytes are four a weight."""
    config, fp = model.config, model.footprint()
    dtype, kv = (str(d).replace("torch.", "") for d in (model.dtype, model.kv_dtype))
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "CPU (Triton interpreter)"
    held = ("" if model.device.type == "cuda" or fp["weight_format"] == fp["lm_head_format"] == "plain"
            else ", FP8 values held in float32")
    return (f"model {model.name} ({config.MODEL_TYPE}): {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"vocab {config.vocab_size}; weights {describe_formats(fp['weight_format'], fp['lm_head_format'], dtype)} "
            f"{_size(fp['weights'])}{' a rank' if model.tp > 1 else ''}, KV cache {kv} {_size(fp['kv_cache'])}, "
            f"{model.prefill_precision} prefill; on "
            f"{where}{held} (ready in {ready_s:.1f} s)")


def _speed(stats: dict, rows: list[list[int]]) -> str:
    """The request's times: the prefill, and a rate only where decode steps ran (the
    prefill chooses each row's first token; the steps choose the rest)."""
    prefill = f"prefill {stats.get('prefill_s', 0.0) * 1e3:.1f} ms"
    launches, decode_s = max(len(r) for r in rows) - 1, stats.get("decode_s", 0.0)
    if launches < 1:
        return f"{prefill} (it chose the only new token); no decode step ran, so there is no rate to show"
    if decode_s <= 0:
        return f"{prefill}; decode {launches} steps, not timed"
    decoded = sum(max(len(r) - 1, 0) for r in rows)
    return (f"{prefill}; decode {launches} steps in {decode_s:.3f} s: {decoded / decode_s:.1f} tokens/s "
            f"({decode_s / launches * 1e3:.2f} ms/step, one launch each)")


#: Characters a token covers at most, for the cheap look at a long prompt before it is
#: tokenized whole: the longest tokens of real vocabularies are a few dozen characters.
CHARS_PER_TOKEN = 32


def _encode_bounded(text: str, room: int, positions: int, new: int, encode) -> list[int]:
    """``encode(text)``, once a text too long to fit the model is refused cheaply: with more
    than ``room * CHARS_PER_TOKEN`` characters, its first ones are tokenized alone (cut at a
    space, where tokenizers split words anyway), and if they already make more than ``room``
    tokens the prompt is refused without tokenizing the rest."""
    limit = max(room, 1) * CHARS_PER_TOKEN
    if len(text) > limit:
        cut = text.rfind(" ", limit // 2, limit)
        head = len(encode(text[:cut if cut > 0 else limit]))
        if head > room:
            raise ValueError(f"the prompt ({len(text)} characters) is too long: its first {cut if cut > 0 else limit} "
                             f"characters alone make {head} tokens, and with {new} new they exceed the model's "
                             f"{positions} positions")
    return encode(text)


def _prompt_ids(args, tokenizer, config, new: int) -> list[int]:
    if args.prompt is None:
        return _parse_ids(args.ids) if args.ids is not None else DEFAULT_IDS
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (no tokenizer.json, or a GGUF tokenizer mk does not build): "
                         "give token ids with --ids")
    positions = config.max_position_embeddings
    room = positions - new
    if args.chat:   # the message alone first (cheap), then the text the template makes of it
        _encode_bounded(args.prompt, room, positions, new, lambda t: tokenizer.encode(t, add_bos=False))
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False)
        return _encode_bounded(text, room, positions, new,
                               lambda t: tokenizer.tokenizer.encode(t, add_special_tokens=False).ids)
    return _encode_bounded(args.prompt, room, positions, new, tokenizer.encode)


def run_generate(args) -> int:
    """Build or load the model and generate, streaming row 0 to stdout as its tokens
    arrive; then print each row's ids, tokens/s and the check against the float32 reference.

    Every argument and the checkpoint (folder, config.json, safetensors headers) are
    checked before the model is built; a status line on stderr says what is being done.
    Returns the exit code: 1 when a float32 model's greedy tokens differ from the reference.
    """
    new = _check_args(args)
    temperature, top_k, top_p = args.temperature, args.top_k, args.top_p
    if temperature < MIN_TEMPERATURE:   # greedy, as the model decodes it (and so checked against the reference)
        temperature = 0.0
    status = Status()
    t0 = time.perf_counter()
    tokenizer = None
    if args.model:
        config, tokenizer = _check_checkpoint(args.model)
        if args.prompt is None:   # ids in, ids out: the tokenizer was only checked
            tokenizer = None
    else:
        config = LlamaConfig(**DEFAULT_CONFIG)
    ids = _prompt_ids(args, tokenizer, config, new)
    if not ids:
        raise ValueError("the prompt is empty: its text gives no tokens")
    _check_ids(ids, config.vocab_size)
    total = len(ids) + new
    if total > config.max_position_embeddings:
        raise ValueError(f"{len(ids)} prompt tokens + {new} new exceed the model's "
                         f"{config.max_position_embeddings} positions")
    if temperature == 0.0 and (top_k is not None or top_p is not None):
        print("mk: note: --top-k / --top-p apply to sampling (--temperature > 0); greedy decoding ignores them",
              file=sys.stderr)
    # Under torchrun: tensor parallelism over its processes, one GPU each; rank 0 prints.
    tp, rank, _ = launch_env()
    if tp > 1 and not args.model:
        raise ValueError("tensor parallelism (torchrun) needs a checkpoint: give --model")
    if tp > 1 and rank != 0:
        sys.stdout = open(os.devnull, "w")
        status = Status(open(os.devnull, "w"))
    model = _load_model(args, config, total, tp, status)
    status.clear()
    print(model_line(model, time.perf_counter() - t0), flush=True)
    prompts = [ids] * args.batch
    if new == 0:   # as Llama.generate: the prompts come back unchanged
        out = model.generate(prompts, max_new_tokens=0)
        for b, o in enumerate(out):
            print(f"[{b}] {o[:len(ids)]} -> {o[len(ids):]}")
        print("no new tokens asked for (--max-new-tokens 0): nothing decoded")
        return 0
    length = model.plan_length(total)
    status(f"planning + compiling the decode step (batch {args.batch}, length {length})", bar=True)
    model.prepare(args.batch, total, temperature=temperature, top_k=top_k, top_p=top_p, progress=status.tty)
    plan, _ = model.plan(args.batch, length)   # the plan prepare() made, from the plan cache
    status.clear()
    print(f"plan: {plan.predicted_s * 1e6:.1f} us predicted per step on {plan.device}, "
          f"{sum(1 for c in plan.choices.values() for _ in c.fuse)} fusions, peak shared memory "
          f"{plan.peak_smem_bytes / 1024:.1f} KiB", flush=True)

    eos = set(tokenizer.eos_token_ids) if tokenizer and tokenizer.eos_token_ids else set(config.eos_token_ids)
    status(f"prefill ({args.batch} x {len(ids)} tokens), then decoding")
    stream = model.stream(prompts, new, temperature=temperature, top_k=top_k, top_p=top_p, seed=args.seed,
                          eos_token_id=sorted(eos), read_every=1 if model.device.type == "cpu" else 8)
    rows = _print_rows(stream, args.batch, ids, new, eos, tokenizer, args.chat, status)
    print(_speed(model.last_stats, rows), flush=True)
    if tp > 1 and temperature == 0.0 and args.check_steps > 0:
        print("check: skipped under tensor parallelism (each rank holds its share of the weights)")
    elif temperature == 0.0 and args.check_steps > 0:
        return _check_reference(model, config, ids, rows[0][:args.check_steps], status)
    return 0


def _load_model(args, config, total: int, tp: int, status: Status):
    """The checkpoint at ``--model`` (this rank's share under torchrun), or the default
    model's random weights, sized for ``--batch`` rows of ``total`` positions."""
    kv_dtype = getattr(torch, args.kv_dtype) if args.kv_dtype else None
    common = dict(max_batch_size=args.batch, max_seq_len=total, kv_dtype=kv_dtype,
                  prefill_precision=args.prefill_precision, quantize=args.quantize,
                  quantize_lm_head=args.quantize_lm_head)
    if not args.model:
        status("building the default model (random weights)")
        return Llama.from_config(config, seed=DEFAULT_SEED, name="mk-default-llama", **common)
    if tp > 1:
        status(f"joining the other {tp - 1} rank(s) started by torchrun (at most {SETUP_TIMEOUT_S} s)")
    status(f"loading weights from {args.model}" + (f" (this rank's share of {tp})" if tp > 1 else ""))
    return AutoModel.from_pretrained(args.model, progress=status.tty, tp=tp, **common)


def _print_rows(stream, batch: int, ids: list[int], new: int, eos: set[int], tokenizer, chat: bool,
                status: Status) -> list[list[int]]:
    """Each of the ``batch`` rows' new tokens from ``stream`` (a row ends at its first EOS):
    row 0 printed as they arrive (its text, or its ids without a tokenizer), then every
    row's ids and where rows stopped at EOS."""
    text = TextStreamer(tokenizer, ids) if tokenizer else None
    rows: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    for step, tokens in enumerate(stream):
        if step == 0:
            status.clear()
            # Row 0 streams: its text after the prompt's (a chat reply alone), or its ids line.
            print(("" if chat else text.prompt_text) if text else f"[0] {ids} -> [", end="", flush=True)
        for b, t in enumerate(tokens.tolist()):
            if finished[b]:
                continue
            rows[b].append(t)
            finished[b] = t in eos
            if b == 0:
                print(text.put(t) if text else f"{', ' if len(rows[0]) > 1 else ''}{t}", end="", flush=True)
    print(text.end() if text else "]", flush=True)
    for b, r in enumerate(rows):
        if b > 0 or text:   # row 0's ids line was streamed in ids mode
            shown = f"  {tokenizer.decode(r)!r}" if text and b > 0 else ""
            print(f"[{b}] {ids} -> {r}{shown}")
    stopped = [f"row {b} after {len(r)} of {new} tokens" for b, r in enumerate(rows) if finished[b]]
    if stopped:
        print(f"stopped at EOS ({', '.join(map(str, sorted(eos)))}): {', '.join(stopped)}")
    return rows


def _check_reference(model, config, ids: list[int], got: list[int], status: Status) -> int:
    """Row 0's first greedy tokens ``got`` against the float32 torch reference on the model's
    own weights: prints the verdict; returns 1 when a float32 model's tokens differ."""
    check = len(got)   # shorter than asked when row 0 stopped at EOS
    status("checking the greedy tokens against the float32 torch reference")
    try:
        want = greedy_generate(ReferenceLlama(config, model.hf_weights()), [ids], check)[0]
    except FloatingPointError as e:  # nothing to compare against: never a match
        status.clear()
        print(f"check: failed: {e}")
        return 1
    status.clear()
    same = sum(1 for a, b in zip(got, want) if a == b)
    print(f"check: first {check} greedy tokens {'match' if got == want else 'differ from'} the float32 "
          f"torch reference ({same}/{check})")
    return 1 if got != want and model.dtype == torch.float32 else 0
