"""The prefiller's pieces (mk.engine.prefill.Prefiller.piece), as a server cuts a prompt:
captured as CUDA graphs once per row, start and length, and replayed with the same logits
and cache as the whole prompt prefilled at once."""

from __future__ import annotations

import threading

import pytest
import torch

from mk.models import Llama, LlamaConfig
from tests.conftest import rel_err


@pytest.mark.gpu
def test_pieces_that_continue_a_prompt_are_captured_and_replayed():
    """A 300-token prompt in pieces of 128 (starts 0, 128, 256; the last one padded to 128)
    into row 2: the first time each piece runs eagerly and is captured under its (row, start,
    length), the second time it replays. Both give the whole prompt's last-token logits (one
    chunk, row 0) within the fast precision's bf16 spread, the replay the first run's within
    bf16 rounding, and row 2's cache the whole prompt's."""
    cfg = LlamaConfig.tiny(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, eos_token_id=None)
    model = Llama.from_config(cfg, seed=5, dtype=torch.bfloat16, max_batch_size=3, max_seq_len=512)
    assert model.prefill_precision == "fast"
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, cfg.vocab_size, (300,), generator=g).tolist()
    whole = model.logits([prompt])[0, -1]
    ids = torch.tensor(prompt, dtype=torch.int32, device=model.device)
    runs = []
    for _ in range(2):
        for start in (0, 128, 256):
            last = model.prefiller.piece(2, ids[start:start + 128], start)
        runs.append(last.clone())
    assert sorted(k for k in model.prefiller.graphs if k[0] == 2) == [(2, 0, 128), (2, 128, 128), (2, 256, 128)]
    assert not model.prefiller.graphs_failed
    for got in runs:
        assert rel_err(got, whole) < 5e-2
    assert rel_err(runs[1], runs[0]) < 1e-2
    for cache in (model.k_cache, model.v_cache):
        assert rel_err(cache[:, 2, :, :300].float(), cache[:, 0, :, :300].float()) < 2e-2


@pytest.mark.gpu
def test_a_prepared_scheduler_replays_the_graph_of_every_piece_of_a_short_prompt():
    """Scheduler.prepare captures the graphs of the pieces prompts are cut into (into the
    row they are prefilled into), so that prompts of one and two pieces replay them: no new
    graph is captured while they are served, and each first token is among the top 3 of the
    whole prompt prefilled at once (bf16 operands: chunkings may round the top two apart; a
    wrong cache row or position gives a token at random, 3 in 1000)."""
    from mk.engine.scheduler import Request, Scheduler

    cfg = LlamaConfig.tiny(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, eos_token_id=None)
    model = Llama.from_config(cfg, seed=6, dtype=torch.bfloat16, kv_dtype=torch.float32, max_batch_size=2,
                              max_seq_len=512)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (90, 200, 300, 400)]
    # (The whole prompts' own graphs, in row 0, fill the graph cache: prepare makes room.)
    want = [model.logits([p])[0, -1].topk(3).indices.tolist() for p in prompts][:2]
    assert len(model.prefiller.graphs) == 4
    scheduler = Scheduler(model, prefill_chunk=128)
    scheduler.prepare()
    last = model.max_batch_size - 1
    keys = sorted(model.prefiller.graphs)
    assert keys == [(last, 0, 128), (last, 128, 128)], keys
    prompts = prompts[:2]
    firsts = []
    scheduler.start()
    try:
        for p in prompts:
            done = threading.Event()
            got = []

            def emit(ev, got=got, done=done):
                if ev[0] == "tokens":
                    got.extend(ev[1])
                if ev[0] in ("done", "error"):
                    done.set()

            scheduler.submit(Request(prompt=p, max_tokens=1, emit=emit))
            assert done.wait(120), "a request never ended"
            firsts.append(got[0])
    finally:
        scheduler.stop()
    assert sorted(model.prefiller.graphs) == keys  # replayed, none captured
    assert all(f in w for f, w in zip(firsts, want)), (firsts, want)
