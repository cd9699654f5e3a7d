"""Command line: ``python -m mk <command>``.

Commands:
  demo   run every task op on random inputs, check it against its torch reference,
         and print the error and time of each (CPU: Triton interpreter; GPU: compiled).
  plan   plan a decode step for a model shape (a preset name or a checkpoint folder with
         config.json) on a device (a preset or the live GPU) and print the plan
         (``--quantize fp8``: for projections stored in FP8).
  calibrate
         measure the cost model's constants on the live GPU (copy bandwidth, matrix rate,
         launch, task and dependency-wait overheads) and save them for the planner.
  generate
         decode with a model (a checkpoint folder of any family, a .gguf file, or a small random Llama)
         through the megakernel: the text (or ids) streamed as tokens arrive, then tokens/s
         and a check against the reference (``--quantize fp8``: FP8 projections).
  serve  serve a checkpoint over HTTP with the OpenAI API (completions, chat completions,
         models, health, metrics), requests batched continuously (:mod:`mk.serve`).

Results go to stdout; what a command is doing goes to stderr (a status line and progress
bars on a terminal, plain ``mk: ...`` lines elsewhere). Bad arguments or checkpoints are
one ``mk: error: ...`` line, reported before any model is built.

Exit codes: 0 done; 1 an error (one ``mk: error: ...`` line; ``generate``: also a float32
model whose greedy tokens differ from the reference); 2 a command line argparse cannot
read (an unknown flag, a value of the wrong type); 130 interrupted (Ctrl-C). No traceback
is printed unless ``MK_DEBUG`` is 1, true or yes. A stdout closed by its reader (``| head``)
ends the command quietly with exit code 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

#: Exit code of a command interrupted by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130
#: What a command reports as ``mk: error: ...`` (a user's input, the machine, the checkpoint):
#: MegakernelTimeout is a RuntimeError, torch's out-of-memory error too.
USER_ERRORS = (ValueError, TypeError, RuntimeError, OSError, MemoryError)


def _device_names() -> str:
    from .planner.device import PRESETS

    return ", ".join(sorted(PRESETS))


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``mk: warning: ...`` line on stderr (not Python's file:line form)."""
    print(f"mk: warning: {message}", file=sys.stderr if file is None else file)


def debug_wanted() -> bool:
    """``MK_DEBUG`` asks for tracebacks: 1, true or yes (any case); 0, false, no or unset do not."""
    return os.environ.get("MK_DEBUG", "").strip().lower() in ("1", "true", "yes")


def main(argv: list[str] | None = None) -> int:
    """Run one command (``argv``, default ``sys.argv[1:]``); returns the exit code (see the
    module docstring): 0, 1 after a one-line ``mk: error: ...`` on stderr, 130 after Ctrl-C.
    A stdout closed by its reader (``generate ... | head``) ends the command quietly, exit 0."""
    try:
        code = _main(argv)
        sys.stdout.flush()   # (here, not at exit, where a closed pipe would be reported)
        return code
    except KeyboardInterrupt:  # (also while torch and Triton are imported)
        print("\nmk: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _drop_stdout()
        return 0


def _drop_stdout() -> None:
    """Send what is left for stdout to /dev/null: its reader is gone, and Python's flush at
    exit would otherwise report the broken pipe (as the docs of the signal module advise)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # not a file (a test's capture): nothing to flush at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _main(argv: list[str] | None) -> int:
    from . import __version__
    from .models.blocks import MAX_BATCH
    from .models.weights import QUANTIZE

    def quantize_flags(command) -> None:
        command.add_argument("--quantize", default=None, choices=sorted(QUANTIZE),
                             help="store the projections in FP8 (e4m3): fp8 with a float32 scale per output channel, "
                             "fp8-block with one per 128x128 block (default: as the checkpoint stores them)")
        command.add_argument("--quantize-lm-head", action="store_true",
                             help="with --quantize: the LM head too (default: it keeps the weights' dtype)")

    parser = argparse.ArgumentParser(prog="python -m mk", description="mk: LLM decoding as one persistent Triton kernel")
    parser.add_argument("--version", action="version", version=f"mk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run each task op against its reference")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    plan = sub.add_parser("plan", help="search a plan for a model shape and print it")
    plan.add_argument("--model", required=True, help="a preset (llama-3.2-1b, llama-3-8b, mistral-7b, qwen2.5-7b, "
                      "llama-3-70b, qwen3-8b), a folder with config.json of any family mk runs, or a .gguf file")
    plan.add_argument("--batch", type=int, default=1, help=f"sequences decoded together, 1 to {MAX_BATCH}")
    plan.add_argument("--kv-len", type=int, default=None,
                      help=f"the sequence length the step is planned for (its KV splits); default {PLAN_KV_LEN}, or "
                      f"the model's positions if it has fewer")
    plan.add_argument("--device", default=None, help=f"a device preset ({_device_names()}; also h100, a100, 4090 "
                      f"and torch's device names); default: the live GPU")
    plan.add_argument("--smem-budget", default=None, help="shared memory per block to plan for, e.g. 99KiB")
    plan.add_argument("--beam", type=int, default=6, help="beam width of the search")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: the plan of one rank's share")
    quantize_flags(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--no-cache", action="store_true", help="search again even if a cached plan exists")
    cal = sub.add_parser("calibrate", help="measure the planner's cost-model constants on the live GPU")
    cal.add_argument("--no-save", action="store_true", help="print the constants without saving them")
    gen = sub.add_parser(
        "generate", help="generate tokens with a model (Llama, Mistral, Qwen2, Qwen3) through the megakernel",
        description="Generate through the megakernel, with a checkpoint of any family mk runs (Llama, Mistral, "
        "Qwen2, Qwen3) or a small random Llama. Row 0 is streamed to stdout as its tokens "
        "arrive (its text after the prompt's, or with --chat the reply alone; without a tokenizer its ids); with "
        "--batch > 1 the other rows are printed when decoding ends. Then each row's ids, tokens/s and, when "
        "greedy, a check of the first tokens against the float32 torch reference.")
    gen.add_argument("--model", default=None, help="a Hugging Face checkpoint folder or a .gguf file: Llama, "
                     "Mistral, Qwen2 or Qwen3 (default: a small random Llama)")
    gen.add_argument("--prompt", default=None, help="prompt text (needs the checkpoint's tokenizer: tokenizer.json, "
                     "or the GGUF's own)")
    gen.add_argument("--chat", action="store_true", help="send --prompt as a user message through the "
                     "checkpoint's chat template (Instruct models)")
    gen.add_argument("--ids", default=None, help="prompt token ids, comma-separated, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 8 on a CPU, "
                     "32 on a GPU; 0 prints the prompt back)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold, in (0, 1]")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampler, in [0, 2**63)")
    gen.add_argument("--batch", type=int, default=1, help=f"copies of the prompt decoded together, 1 to {MAX_BATCH} "
                     "(row 0 streams, the others print at the end)")
    gen.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                     help="KV-cache dtype (default: the weights'); float32 rounds nothing but the weights")
    gen.add_argument("--prefill-precision", default="fast", choices=["fast", "exact"],
                     help="fast (default): bf16 matmul operands in prefill; exact: float32 activations")
    quantize_flags(gen)
    gen.add_argument("--check-steps", type=int, default=4, help="greedy steps checked against the reference")
    from .serve.cli import add_serve_parser
    add_serve_parser(sub, quantize_flags)
    args = parser.parse_args(argv)
    debug = debug_wanted()
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = _show_warning
            return _run(args)
    except BrokenPipeError:   # stdout's reader went away: not an error of the input (main ends quietly)
        raise
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"mk: error: {_one_line(err)}", file=sys.stderr)
        return 1
    except Exception as err:  # a bug of mk's: still one line, and how to see where
        if debug:
            raise
        print(f"mk: internal error: {type(err).__name__}: {_one_line(err)} (set MK_DEBUG=1 for the traceback, and "
              f"please report it)", file=sys.stderr)
        return 1


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text


def _run(args) -> int:
    """The command ``args`` names; its exit code."""
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(seed=args.seed)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "calibrate":
        from .planner.calibrate import run_calibrate

        return run_calibrate(save=not args.no_save)
    if args.command == "serve":
        from .serve.cli import run_serve

        return run_serve(args)
    from .generate import run_generate

    return run_generate(args)


#: Positions of the model-shape presets (their config.json's max_position_embeddings):
#: ``plan --kv-len`` may not exceed them. ModelShape does not carry it.
PRESET_MAX_POSITIONS = {"llama-3.2-1b": 131072, "llama-3-8b": 8192, "mistral-7b": 32768, "qwen2.5-7b": 32768,
                        "qwen3-8b": 40960, "llama-3-70b": 8192}
#: A config.json without max_position_embeddings: Hugging Face's LlamaConfig default (and mk's).
DEFAULT_MAX_POSITIONS = 2048
#: ``plan --kv-len`` when none is given (at most the model's positions).
PLAN_KV_LEN = 1024


def run_plan(args) -> int:
    """``python -m mk plan``: shape + device -> the best plan, explained (or as JSON); with
    ``--quantize`` (``--quantize-lm-head``) for projections (and LM head) stored in that format.

    The device, the shape, ``--batch`` (1 to :data:`~mk.models.blocks.MAX_BATCH`) and
    ``--kv-len`` (1 to the model's positions; default :data:`PLAN_KV_LEN` or fewer) are
    checked before the search; without ``--device`` the live GPU is planned for, and a
    machine without one is told to name a preset."""
    from dataclasses import replace
    from pathlib import Path

    from .generate import Status, check_quantize_flags
    from .models.decoder import StepPlan
    from .planner.cache import cached_plan
    from .planner.device import PRESETS, DeviceSpec
    from .models.blocks import MAX_BATCH, ModelShape, decode_graph
    from .models.auto import AutoConfig, read_config
    from .models.gguf import is_gguf_path
    from .models.quantization import read_quantization
    from .planner.search import Plan, search
    from .tasks._cache import check_cache_dir

    if args.device:
        device = DeviceSpec.preset(args.device)
    else:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"no CUDA GPU here to plan for: name a device with --device (one of "
                             f"{', '.join(sorted(PRESETS))})")
        device = DeviceSpec.from_gpu()
    if args.smem_budget is not None:   # (at most the device's own per-block maximum)
        try:
            device = device.with_smem_budget(args.smem_budget)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--smem-budget: {e}") from None
    if args.beam < 1:
        raise ValueError(f"--beam must be >= 1, got {args.beam}")
    if not 1 <= args.tp:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if not 1 <= args.batch <= MAX_BATCH:
        raise ValueError(f"--batch must be in [1, {MAX_BATCH}] (sequences a decode step holds), got {args.batch}")
    if not args.model.strip():
        raise ValueError("--model is empty: give a preset or a checkpoint folder")
    check_quantize_flags(args)
    if not args.no_cache:   # (the plan is kept there; --no-cache neither reads nor writes it)
        check_cache_dir()
    folder = Path(args.model)
    if folder.is_dir() or is_gguf_path(folder):
        config = AutoConfig.from_pretrained(folder)
        shape = config.to_model_shape(name=folder.name)
        positions = config.max_position_embeddings
        stored = read_quantization(*read_config(folder))   # an FP8 checkpoint plans in its format (a GGUF: None)
        if stored is not None:
            head = not config.tie_word_embeddings and stored.quantizes("lm_head")
            shape = replace(shape, linear_format=stored.format.name,
                            lm_head_format=stored.format.name if head or args.quantize_lm_head else "plain")
            if args.quantize and args.quantize != stored.format.name:
                raise ValueError(f"--quantize {args.quantize}: {folder} is stored {stored.format.name} already")
    else:
        shape = ModelShape.preset(args.model)
        positions = PRESET_MAX_POSITIONS.get(shape.name, DEFAULT_MAX_POSITIONS)
    if args.quantize and shape.linear_format == "plain":   # (the names of QUANTIZE are the formats')
        shape = replace(shape, linear_format=args.quantize,
                        lm_head_format=args.quantize if args.quantize_lm_head else "plain")
    shape = shape.shard(args.tp)  # (names what does not split over the ranks)
    kv_len = min(PLAN_KV_LEN, positions) if args.kv_len is None else args.kv_len
    if not 1 <= kv_len <= positions:
        raise ValueError(f"--kv-len must be in [1, {positions}] (the positions of {shape.name}), got {kv_len}")
    graph = decode_graph(shape, args.batch, kv_len)
    status = Status()
    status(f"planning {shape.name}, batch {args.batch}, length {kv_len} for {device.name}", bar=True)
    if args.no_cache:
        best = search(graph, device, beam_width=args.beam, progress=status.tty)[0]
    else:
        best, _ = cached_plan(graph, device, beam_width=args.beam, progress=status.tty)
        best = Plan.from_json(best.to_json(), graph, device)  # per-op estimates for explain()
    status.clear()
    print(best.to_json() if args.json else StepPlan(best, graph, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
