"""A request stream over a static batch: prefill, then decode steps enqueued back to back,
their tokens read back in blocks without stalling the GPU (``generate`` and ``stream``)."""

from __future__ import annotations

import time
from typing import Iterator

import torch

from mk.persistent.runtime import MegakernelTimeout
from mk.tasks.append_token import append_token
from mk.tasks.argmax import argmax
from mk.tasks.sample import gumbel_noise, sample, scale_logits_ref

from .steps import Decoder


def first_token(device, logits, lengths, temperature, top_k, top_p, seed) -> torch.Tensor:
    """The token after each prompt, chosen as the decode steps choose theirs."""
    if temperature == 0.0:
        return argmax(logits).to(torch.int32)
    if top_k is None and top_p is None:
        # The megakernel's draw for a token at position p uses Philox offset p, row b.
        B, V = logits.shape
        noise = torch.stack([gumbel_noise(seed, n, B, V, device=device)[b] for b, n in enumerate(lengths)])
        return (scale_logits_ref(logits, temperature) + noise).argmax(dim=1).to(torch.int32)
    return sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=0).to(torch.int32)


def decode(model, ids: torch.Tensor, lengths: list[int], max_new_tokens: int, next_token: str, temperature: float,
           top_k: int | None, top_p: float | None, seed: int, eos: set[int], read_every: int
           ) -> Iterator[torch.Tensor]:
    """``model``'s prompts ``ids`` (right-padded, ``lengths``) prefilled into slots
    ``[0, B)``, then decoded in one step for all of them, yielding each step's tokens
    (:meth:`~mk.models.decoder.DecoderModel.stream`, on checked arguments)."""
    B = ids.shape[0]
    dec = model.last_decoder = model.steps.get(B, next_token, model.plan_length(max(lengths) + max_new_tokens))
    phases = dec.unreported_build()
    st = dec.state
    t0 = time.perf_counter()
    logits = model.prefiller.run(ids, lengths)
    first = first_token(model.device, logits, lengths, temperature, top_k, top_p, seed)
    # Device state: the history holds the prompt and the first token; pos points at it.
    model.steps.slots.start(0, ids, lengths, first)  # (dec.state: the slots' rows [0, B))
    st["temperature"].fill_(temperature if next_token == "sample" else 1.0)
    st["seed"].fill_(seed)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t_prefill = time.perf_counter() - t0
    done: list[int | None] = [None] * B  # the EOS id each finished row stopped at
    starts = torch.tensor(lengths)
    rows = torch.arange(B)
    blocks = HistoryReader(dec, model.device)
    enqueued, produced, t_decode = 0, 0, time.perf_counter()
    while produced < max_new_tokens:
        # Keep the next block queued behind the one being read: the GPU never idles on the host.
        while enqueued < max_new_tokens and blocks.in_flight < 2:
            block = min(read_every, max_new_tokens - enqueued)
            # Step i of the block feeds token enqueued+i; the last block's final step is not needed.
            steps = block - (1 if enqueued + block == max_new_tokens else 0)
            for i in range(steps):
                decode_step(dec, enqueued + i + 1, temperature, top_k, top_p, seed)
            blocks.read(block)
            enqueued += block
        try:
            block, history = blocks.wait()  # a timed-out wait raises MegakernelTimeout here, never hangs
        except MegakernelTimeout as e:
            if model.tp > 1:  # the ranks' launch counts part, and a late peer's words may land after the reset
                model.ranks.out_of_step = f"a decode step failed on rank {model.rank}: {e}"
            raise
        for i in range(block):
            tok = history[rows, starts + produced + i].long()
            for b in range(B):
                if done[b] is not None:
                    tok[b] = done[b]
                elif int(tok[b]) in eos:
                    done[b] = int(tok[b])
            yield tok
            if all(d is not None for d in done):
                produced = max_new_tokens
                break
        else:
            produced += block
    elapsed = time.perf_counter() - t_decode
    model.last_stats = {**phases, "prefill_s": t_prefill, "decode_s": elapsed}

def decode_step(dec, step: int, temperature=0.0, top_k=None, top_p=None, seed=0) -> None:
    """Enqueue decode step number ``step`` (1, 2, ...; the prefill chose token 0)."""
    dec.kernel.launch()
    if dec.step.next_token == "logits":  # top-k / top-p: the sampler, then the append
        st = dec.state
        logits = dec.step.graph.buffers[dec.step.logits]
        st["ids"].copy_(sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                               offset=step))
        append_token(st["ids"], st["pos"], st["tokens"])


class HistoryReader:
    """Reads a decoder's token history back in blocks without stalling the GPU: each block's
    copy goes to its own pinned host buffer behind an event (two buffers, so one block is
    read while the next is copied), with the watchdog's error words beside it. On the CPU
    the copy is immediate."""

    def __init__(self, dec: Decoder, device: torch.device):
        self.dec, self.cuda = dec, device.type == "cuda"
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, object]] = []
        if self.cuda and not dec.host:
            tokens, error = dec.state["tokens"], dec.kernel.error
            dec.host = [(torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                         torch.empty(error.shape, dtype=error.dtype, pin_memory=True)) for _ in range(2)]
        self.count = 0

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def read(self, block: int) -> None:
        """Queue the read-back of the history after the steps enqueued so far."""
        tokens, error = self.dec.state["tokens"], self.dec.kernel.error
        if not self.cuda:
            self.pending.append((block, tokens.clone(), error.clone(), None))
            return
        host_tokens, host_error = self.dec.host[self.count % 2]
        self.count += 1
        host_tokens.copy_(tokens, non_blocking=True)
        host_error.copy_(error, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((block, host_tokens, host_error, event))

    def drop(self) -> None:
        """Forget the reads queued (their blocks will not be read: a step failed)."""
        self.pending.clear()

    def wait(self) -> tuple[int, torch.Tensor]:
        """The oldest queued block: (its number of tokens, the history as it was read).
        Raises MegakernelTimeout if a wait in its steps timed out."""
        block, tokens, error, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()
        self.dec.kernel.check(error)
        return block, tokens
