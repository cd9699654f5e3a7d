"""Command line: ``python -m mk <command>``.

Commands:
  demo   run every task op on random inputs, check it against its torch reference,
         and print the error and time of each (CPU: Triton interpreter; GPU: compiled).
  plan   plan a decode step for a model shape (a preset name or a checkpoint folder with
         config.json) on a device (a preset or the live GPU) and print the plan.
  calibrate
         measure the cost model's constants on the live GPU (copy bandwidth, matrix rate,
         launch, task and dependency-wait overheads) and save them for the planner.
  generate
         decode with a Llama (a checkpoint folder, or a small random one built on the fly)
         through the megakernel: plan, tokens, tokens/s, and a check against the reference.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mk", description="mk: LLM decoding as one persistent Triton kernel")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run each task op against its reference")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    plan = sub.add_parser("plan", help="search a plan for a model shape and print it")
    plan.add_argument("--model", required=True, help="a preset (llama-3.2-1b, llama-3-8b) or a folder with config.json")
    plan.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    plan.add_argument("--kv-len", type=int, default=1024,
                      help="the sequence length the step is planned for (its KV splits)")
    plan.add_argument("--device", default=None, help="a device preset (h100, h200, a100, l40s, l20, rtx4090); "
                      "default: the live GPU")
    plan.add_argument("--smem-budget", default=None, help="shared memory per block to plan for, e.g. 99KiB")
    plan.add_argument("--beam", type=int, default=6, help="beam width of the search")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--no-cache", action="store_true", help="search again even if a cached plan exists")
    cal = sub.add_parser("calibrate", help="measure the planner's cost-model constants on the live GPU")
    cal.add_argument("--no-save", action="store_true", help="print the constants without saving them")
    gen = sub.add_parser("generate", help="generate tokens with a Llama through the megakernel")
    gen.add_argument("--model", default=None, help="a Hugging Face Llama folder (default: a small random Llama)")
    gen.add_argument("--prompt", default=None, help="prompt text (needs the folder's tokenizer.json)")
    gen.add_argument("--ids", default=None, help="prompt token ids, comma-separated, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 8 on a CPU, "
                     "32 on a GPU)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    gen.add_argument("--batch", type=int, default=1, help="copies of the prompt decoded together")
    gen.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                     help="KV-cache dtype (default: the weights'); float32 rounds nothing but the weights")
    gen.add_argument("--check-steps", type=int, default=4, help="greedy steps checked against the reference")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(seed=args.seed)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "calibrate":
            from .planner.calibrate import run_calibrate

            return run_calibrate(save=not args.no_save)
        if args.command == "generate":
            from .generate import run_generate

            return run_generate(args)
    except (ValueError, TypeError, RuntimeError, OSError) as err:
        print(f"mk: error: {err}", file=sys.stderr)
        return 1
    return 0


def run_plan(args) -> int:
    """``python -m mk plan``: shape + device -> the best plan, explained (or as JSON)."""
    import json
    from pathlib import Path

    from .planner.device import DeviceSpec
    from .planner.graph import ModelShape, llama_decode_graph
    from .planner.cache import cached_plan
    from .planner.search import Plan, search

    folder = Path(args.model)
    if folder.is_dir():
        config = folder / "config.json"
        if not config.is_file():
            raise ValueError(f"{folder} has no config.json")
        try:
            shape = ModelShape.from_hf_config(json.loads(config.read_text()), name=folder.name)
        except json.JSONDecodeError as err:
            raise ValueError(f"{config} is not valid JSON: {err}") from err
    else:
        shape = ModelShape.preset(args.model)
    device = DeviceSpec.preset(args.device) if args.device else DeviceSpec.from_gpu()
    if args.smem_budget:
        device = device.with_smem_budget(args.smem_budget)
    graph = llama_decode_graph(shape, args.batch, args.kv_len)
    if args.no_cache:
        best = search(graph, device, beam_width=args.beam, progress=True)[0]
    else:
        best, _ = cached_plan(graph, device, beam_width=args.beam, progress=True)
        best = Plan.from_json(best.to_json(), graph, device)  # per-op estimates for explain()
    print(best.to_json() if args.json else best.explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
