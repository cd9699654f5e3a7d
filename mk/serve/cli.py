"""``python -m mk serve``: load a checkpoint, build its decode steps, and serve the OpenAI API
on ``--host``:``--port`` until interrupted."""

from __future__ import annotations

import os
import socket
import sys
import time

#: ``--max-seq-len`` when none is given (at most the model's positions): the cache every slot has.
DEFAULT_MAX_SEQ_LEN = 4096


def check_serve_args(args) -> None:
    """Every flag, before anything is loaded: one line naming a bad one."""
    from mk.models.blocks import MAX_BATCH

    if not 1 <= args.max_batch <= MAX_BATCH:
        raise ValueError(f"--max-batch must be in [1, {MAX_BATCH}] (sequences a decode step holds), got {args.max_batch}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise ValueError(f"--max-seq-len must be >= 2, got {args.max_seq_len}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    from mk.persistent.symmetric import launch_env

    if launch_env()[0] > 1:
        raise ValueError("serve runs on one GPU: serving a tensor-parallel model (torchrun) is not built; start "
                         "it without torchrun")


def _check_port(host: str, port: int) -> None:
    """Refuse a host:port that cannot be bound, before the model loads (minutes on a big one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _stopping_scheduler_first(uvicorn):
    """uvicorn's server, which on Ctrl-C (or SIGTERM) first tells the scheduler to stop: the
    handlers waiting on it then answer (503, or an error event ending a stream) within a
    poll, inside uvicorn's graceful-shutdown bound, instead of being cancelled mid-wait."""

    class Server(uvicorn.Server):
        def __init__(self, config, scheduler):
            super().__init__(config)
            self.scheduler = scheduler

        def handle_exit(self, sig, frame):
            self.scheduler.stop(timeout=0)  # (returns at once: the loop ends after its block)
            super().handle_exit(sig, frame)

    return Server


def run_serve(args) -> int:
    """Load, prepare, serve; returns the exit code once the server stops."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ValueError(f"serve needs FastAPI and uvicorn ({e.name} is missing): pip install 'mk[serve]'") from None
    import torch

    from mk.engine.scheduler import Scheduler
    from mk.generate import Status, _check_checkpoint, check_quantize_flags, model_line
    from mk.models import AutoModel

    from .app import create_app

    check_serve_args(args)
    check_quantize_flags(args)
    _check_port(args.host, args.port)
    status = Status()
    t0 = time.perf_counter()
    config, tokenizer = _check_checkpoint(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer (tokenizer.json, or a GGUF file's tokenizer metadata): the "
                         f"server reads and writes text")
    positions = config.max_position_embeddings
    max_seq_len = min(DEFAULT_MAX_SEQ_LEN, positions) if args.max_seq_len is None else args.max_seq_len
    if max_seq_len > positions:
        raise ValueError(f"--max-seq-len {max_seq_len} exceeds the model's {positions} positions")
    status(f"loading weights from {args.model}")
    model = AutoModel.from_pretrained(args.model, max_batch_size=args.max_batch, max_seq_len=max_seq_len,
                                      kv_dtype=getattr(torch, args.kv_dtype) if args.kv_dtype else None,
                                      progress=status.tty, quantize=args.quantize,
                                      quantize_lm_head=args.quantize_lm_head)
    scheduler = Scheduler(model, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk)
    status(f"planning + compiling the decode steps (batch 1 to {args.max_batch})")
    steps = model.max_batch_size
    scheduler.prepare(progress=lambda done, n: status(
        f"planning + compiling the decode steps ({done} of {steps} built)" if done <= steps else
        f"capturing the prefill graphs of prompt pieces ({done - steps} of {n - steps})"))
    status.clear()
    print(model_line(model, time.perf_counter() - t0), flush=True)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = create_app(scheduler.start(), tokenizer, name)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (OpenAI API; {args.max_batch} slots, "
          f"{max_seq_len} positions each, up to {args.max_queue} waiting); Ctrl-C stops", flush=True)
    server = _stopping_scheduler_first(uvicorn)(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                       timeout_graceful_shutdown=5), scheduler)
    try:
        server.run()
    finally:
        scheduler.stop()
    print("mk: server stopped", file=sys.stderr)
    return 0 if not scheduler.failed else 1


def add_serve_parser(sub, quantize_flags) -> None:
    """The ``serve`` command's flags."""
    from mk.models.blocks import MAX_BATCH

    p = sub.add_parser("serve", help="serve a model over the OpenAI API (completions, chat) with continuous batching",
                       description="Serve a checkpoint over HTTP with the OpenAI API: /v1/completions, "
                       "/v1/chat/completions, /v1/models, /health and /metrics. Requests join free slots of the "
                       "batch between decode blocks and leave when they finish.")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder with tokenizer.json, or a .gguf "
                   "file (Llama, Mistral, Qwen2, Qwen3)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8, help=f"slots decoded together, 1 to {MAX_BATCH} (default 8)")
    p.add_argument("--max-seq-len", type=int, default=None, help=f"positions each slot holds, prompt + new tokens "
                   f"(default {DEFAULT_MAX_SEQ_LEN}, or the model's positions if fewer)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429 "
                   "(default 64)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="most prompt tokens prefilled between two "
                   "decode blocks: bounds how long running streams wait for an arriving prompt (default 256)")
    p.add_argument("--served-model-name", default=None, help="the model's id in the API (default: the folder's name)")
    p.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="KV-cache dtype (default: the weights')")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; info logs each request)")
    quantize_flags(p)
