"""Command line: ``python -m mk <command>``.

Commands:
  demo   run every task op on random inputs, check it against its torch reference,
         and print the error and time of each (CPU: Triton interpreter; GPU: compiled).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mk", description="mk: LLM decoding as one persistent Triton kernel")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run each task op against its reference")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(seed=args.seed)
    except (ValueError, TypeError, RuntimeError, OSError) as err:
        print(f"mk: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
