"""Tensor parallelism without GPUs: each rank's share of the weights and of the decode step.

The VM runs every rank's lowered step at once, workers of all ranks interleaved at random
(:func:`mk.persistent.vm.run_vm_ranks`): the all-reduces and the choice of the token over
the ranks meet their peers as their flags make them on the GPU. The tokens, every rank's
share of the KV cache and the residual stream must equal the unsharded reference's.
"""

import pytest
import torch

from mk.models import LlamaConfig, Qwen2Config, ReferenceLlama, random_weights
from mk.models.mistral import Mistral, MistralConfig
from mk.models.qwen3 import Qwen3, Qwen3Config
from mk.models.blocks import ModelShape
from mk.models.llama import Llama
from mk.models.qwen2 import Qwen2
from mk.models.weights import SCALE_SUFFIX, load_weights, quantize_weights, save_weights, shard_weights, tp_slices
from mk.tasks.linear.format import FP8_CHANNEL
from mk.persistent.graph import lower
from mk.persistent.vm import run_vm_ranks
from tests.conftest import HAS_CUDA, rel_err

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="float32 interpreter semantics")

B, S, POSITIONS = 2, 12, [3, 7]
SIZES = dict(vocab_size=204, hidden_size=64, intermediate_size=96, num_hidden_layers=3, head_dim=16)
CASES = {"llama-tp2": (Llama, LlamaConfig.tiny(**SIZES, num_attention_heads=4, num_key_value_heads=2), 2),
         "llama-tp4": (Llama, LlamaConfig.tiny(**SIZES, num_attention_heads=8, num_key_value_heads=4), 4),
         "qwen2-bias-tp2": (Qwen2, Qwen2Config.tiny(**SIZES, num_attention_heads=6, num_key_value_heads=2), 2),
         # Qwen3's q / k head norms (each rank's heads' share) and Mistral's window (shorter
         # than the later sequence's length, so that it drops keys).
         "qwen3-qk-norm-tp2": (Qwen3, Qwen3Config.tiny(**SIZES, num_attention_heads=4, num_key_value_heads=2), 2),
         "mistral-window-tp2": (Mistral, MistralConfig.tiny(**SIZES, num_attention_heads=4, num_key_value_heads=2,
                                                            sliding_window=5), 2),
         # Every family over four ranks too (a KV head a rank).
         "qwen2-bias-tp4": (Qwen2, Qwen2Config.tiny(**SIZES, num_attention_heads=8, num_key_value_heads=4), 4),
         "qwen3-qk-norm-tp4": (Qwen3, Qwen3Config.tiny(**SIZES, num_attention_heads=8, num_key_value_heads=4), 4),
         "mistral-window-tp4": (Mistral, MistralConfig.tiny(**SIZES, num_attention_heads=8, num_key_value_heads=4,
                                                            sliding_window=5), 4)}


def _dequantized(weights: dict) -> dict:
    """The float32 weights FP8 ones with per-channel scales stand for (the others as they are)."""
    return {n: FP8_CHANNEL.dequantize(t, weights[n + SCALE_SUFFIX]) if n + SCALE_SUFFIX in weights else t
            for n, t in weights.items() if not n.endswith(SCALE_SUFFIX)}


def _all_reduces(plan, how: str):
    """``plan`` with the O / down projections' all-reduces as ``how`` says: "own" (their own
    tiles after the projection), "split-k" (the projections that fuse them split over K, so
    that their reduce tiles sum over the ranks), else as it is."""
    from dataclasses import replace

    from mk.planner.cost import OpChoice

    choices = dict(plan.choices)
    for name, c in plan.choices.items():
        ar = tuple(f for f in c.fuse if f.endswith("_residual"))
        if how == "own":
            choices[name] = replace(c, fuse=tuple(f for f in c.fuse if f not in ar))
            choices.update({f: OpChoice() for f in ar})
        elif how == "split-k" and ar:
            choices[name] = replace(c, split_k=2, block_n=16, block_k=16, tma_stages=0, tiles_per_task=1,
                                    reduce_block_n=0)
    return replace(plan, choices=choices)


@pytest.mark.parametrize("name,all_reduces,quantize", [(n, "as planned", None) for n in sorted(CASES)]
                         + [("llama-tp2", "own", None), ("llama-tp4", "split-k", None),
                            ("qwen2-bias-tp2", "split-k", None), ("llama-tp2", "as planned", "fp8"),
                            ("qwen3-qk-norm-tp2", "split-k", "fp8")])
def test_every_rank_s_share_of_a_step_matches_the_reference(name, all_reduces, quantize):
    """``quantize``: the whole model's projections and LM head in FP8 with per-channel scales,
    each rank given its share of the values and of the scales (shard_weights)."""
    cls, config, tp = CASES[name]
    weights = random_weights(config, seed=3)
    if quantize:
        weights = quantize_weights(weights, config, quantize, lm_head=True)
    ref = ReferenceLlama(config, _dequantized(weights))
    cache = ref.new_cache(B, S)
    history = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(5))
    for b, n in enumerate(POSITIONS):
        one = ref.new_cache(1, S)
        ref.forward(history[b:b + 1, :n], 0, one)
        cache.k[:, b], cache.v[:, b] = one.k[:, 0], one.v[:, 0]
    k0, v0 = cache.k.clone(), cache.v.clone()
    fed = history[torch.arange(B), torch.tensor(POSITIONS)]
    want = ref.forward(fed[:, None], torch.tensor(POSITIONS), cache)[:, 0].argmax(-1)
    programs, states, models = [], [], []
    for rank in range(tp):
        model = cls(config, shard_weights(weights, tp_slices(config, tp, rank)), device="cpu", dtype=torch.float32,
                    max_batch_size=B, max_seq_len=S, tp=tp, rank=rank)
        assert model.formats == {"layers": quantize or "plain", "lm_head": quantize or "plain"}
        kv = model.shape.kv_heads
        model.k_cache.copy_(k0[:, :, rank * kv:(rank + 1) * kv])
        model.v_cache.copy_(v0[:, :, rank * kv:(rank + 1) * kv])
        # The step as generate builds it (the model's own plan, lowering and buffers), run by the VM.
        plan, graph = model.plan(B, S)
        plan = _all_reduces(plan, all_reduces)
        dec = model.steps.build(plan, graph, B, "argmax")
        dec.state["ids"].copy_(fed), dec.state["pos"].copy_(torch.tensor(POSITIONS)), dec.state["tokens"].copy_(history)
        programs.append(lower(dec.step.graph, num_workers=3, schedule="list"))
        states.append(dec.state)
        models.append(model)
    run_vm_ranks(programs, interleave="random", seed=tp)
    last = f"x{config.num_hidden_layers}"
    for rank, (model, state, program) in enumerate(zip(models, states, programs)):
        assert state["ids"].tolist() == want.tolist(), (name, rank)
        assert state["pos"].tolist() == [p + 1 for p in POSITIONS]
        assert state["tokens"][:, 1:].gather(1, state["pos"][:, None].long() - 1)[:, 0].tolist() == want.tolist()
        kv = model.shape.kv_heads
        for b, p in enumerate(POSITIONS):
            assert rel_err(model.k_cache[:, b, :, :p + 1], cache.k[:, b, rank * kv:(rank + 1) * kv, :p + 1]) < 1e-5
            assert rel_err(model.v_cache[:, b, :, :p + 1], cache.v[:, b, rank * kv:(rank + 1) * kv, :p + 1]) < 1e-5
        # Every rank sums the partials in rank order: one residual stream, bit for bit.
        assert torch.equal(program.graph.buffers[last], programs[0].graph.buffers[last]), (name, rank)


@pytest.mark.parametrize("all_reduces", ["as planned", "own"])
def test_every_all_reduce_of_a_lowered_step_has_its_own_tag(all_reduces):
    from mk.models.blocks import decode_graph
    from mk.planner.device import DeviceSpec
    from mk.planner.lower import lower_decode_step, meta_buffers
    from mk.planner.search import search

    # Layers past the second are the layer before's tasks copied: their all-reduces must
    # still take their own index in the step (the words' tag), not the copied one's.
    shape = ModelShape("t", hidden=256, intermediate=512, layers=5, heads=8, kv_heads=4, head_dim=32, vocab=512)
    graph = decode_graph(shape.shard(2), 1, 64)
    plan = _all_reduces(search(graph, DeviceSpec.preset("h200"), beam_width=2)[0], all_reduces)
    bufs = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in meta_buffers(graph, 64).items()}
    step = lower_decode_step(plan, graph, bufs, eps=1e-5, rank=1)
    hops = {}  # by the all-reduce's sum (its own tiles' out, a projection's fused tail's total)
    for t in step.graph.tasks:
        if "hop" in t.args:
            hops.setdefault(t.bind.get("total", t.bind.get("out")), set()).add(t.args["hop"])
    assert len(hops) == 2 * shape.layers + 1 and all(len(h) == 1 for h in hops.values()), hops
    assert sorted(h for (h,) in hops.values()) == list(range(2 * shape.layers + 1))


def test_consecutive_sums_over_the_ranks_push_into_different_buffers():
    from mk.models.blocks import decode_graph

    # A peer may push an all-reduce's words while this rank still reads the one before's
    # (never the one two before): two buffers, in turn, and only the token's choice between
    # a step's last all-reduce and the next step's first, which share one.
    graph = decode_graph(ModelShape.preset("llama-3-8b").shard(2), 1, 64)
    recvs = [n.buffers["recv"] for n in graph.nodes if n.kind == "all_reduce"]
    assert len(recvs) == 2 * 32 + 1 and len(set(recvs)) == 2
    assert all(a != b for a, b in zip(recvs, recvs[1:])) and recvs[0] == recvs[-1]


def test_a_model_that_does_not_split_is_refused_naming_the_size():
    shape = ModelShape.preset("llama-3-8b")
    with pytest.raises(ValueError, match="8 key/value heads do not split over tp=16"):
        shape.shard(16)
    with pytest.raises(ValueError, match="90 intermediate size do not split over tp=4"):
        ModelShape("odd", hidden=64, intermediate=90, layers=1, heads=4, kv_heads=4, head_dim=16, vocab=64).shard(4)
    assert shape.shard(4).heads == 8 and shape.shard(4).vocab == shape.vocab


def test_a_rank_reads_only_its_slices_of_the_checkpoint(tmp_path):
    config = CASES["qwen2-bias-tp2"][1]
    config = type(config).from_dict({**config.to_dict(), "tie_word_embeddings": True})
    weights = random_weights(config, seed=1)
    save_weights(weights, config, tmp_path)
    for rank in range(2):
        slices = tp_slices(config, 2, rank)
        got = load_weights(tmp_path, config, shard=slices, progress=False)
        want = shard_weights(weights, slices)
        assert got.keys() == want.keys() and "lm_head.weight" in got  # a tied head's rows of the embedding
        for n in want:
            assert torch.equal(got[n], want[n]), n
        assert got["model.layers.0.self_attn.o_proj.weight"].shape == (64, 3 * 16)  # its heads' columns
        drawn = random_weights(config, seed=1, shard=slices)  # what from_config(tp=2) draws
        assert drawn.keys() == want.keys()
        for n in want:
            assert torch.equal(drawn[n], want[n]), n


def test_the_plan_command_shows_one_rank_s_share(capsys):
    from mk.__main__ import main

    assert main(["plan", "--model", "llama-3-8b", "--tp", "2", "--device", "h100"]) == 0
    text = capsys.readouterr().out
    assert "llama-3-8b/tp2" in text and "all_reduce" in text


def _words(values: torch.Tensor, tag: int) -> torch.Tensor:
    """Float32 ``values`` as the all-reduce pushes them: 64-bit words, ``tag`` in the high half."""
    return (tag << 32) | (values.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF)


@pytest.mark.parametrize("world, late", [(2, (1,)), (4, (2,)), (4, (2, 3))])
def test_the_all_reduce_pushes_sums_every_rank_and_names_a_peer_that_never_arrives(world, late):
    from mk.tasks.all_reduce import HOP_SPACE, all_reduce, all_reduce_ref

    # The ranks' receive buffers on the CPU (each its rank's "workspace"): every peer has
    # pushed its partial of launch 0 (tag 1) into rank 0's, so rank 0's launch sums every
    # rank's partial in rank order, and pushes its own into its slot of every rank's.
    M, N = 3, 100
    recv = [torch.zeros(world, M, N, dtype=torch.int64) for _ in range(world)]
    parts = [torch.randn(M, N) for _ in range(world)]
    peers = torch.tensor([r.data_ptr() for r in recv], dtype=torch.int64)
    res, out = torch.randn(M, N), torch.empty(M, N)
    for q in range(1, world):
        recv[0][q] = _words(parts[q], 1)
    all_reduce(parts[0], out, recv[0], peers, 0, residual=res)
    assert torch.equal(out, all_reduce_ref(parts, res))
    for q in range(world):
        assert torch.equal(recv[q][0], _words(parts[0], 1)), q
    # The next launch: every peer pushes launch 1's words but those ``late``, one of whose
    # words is still launch 0's: the whole box waits, and the error names the first of them.
    for q in range(1, world):
        recv[0][q] = _words(parts[q], HOP_SPACE + 1)
        if q in late:
            recv[0][q, 2, 99] = _words(parts[q][2, 99], 1)
    with pytest.raises(RuntimeError, match=f"rank 0 waited 0.01 s for rank {late[0]}: its words showed tag 1, "
                                           f"expected {HOP_SPACE + 1}"):
        all_reduce(parts[0], out, recv[0], peers, 0, residual=res, epoch=1, timeout_s=0.01)


def test_the_all_reduce_refuses_a_receive_buffer_of_another_shape():
    from mk.tasks.all_reduce import all_reduce

    # Each rank's words of the whole [M, N] partial, a slot a rank: a buffer with a slot too
    # few would take a peer's words past its end. Refused before any work.
    recv = torch.zeros(1, 2, 64, dtype=torch.int64)
    peers = torch.tensor([recv.data_ptr()] * 2, dtype=torch.int64)
    out = torch.full((2, 64), 7.0)
    with pytest.raises(ValueError, match=r"recv must have shape \(2, 2, 64\), got \(1, 2, 64\)"):
        all_reduce(torch.randn(2, 64), out, recv, peers, 0)
    assert torch.equal(out, torch.full((2, 64), 7.0)) and not recv.any()


def test_the_link_calibration_s_hops_wait_for_every_word_of_the_peer():
    from mk.tasks.all_reduce import HOP_COLS, check_hops, rank_hops

    # Two ranks' receive words on the CPU, two halves a hop uses in turn ([half, rank,
    # programs x HOP_COLS] words): rank 1 has pushed its (zero) words of hops 0 and 1 into
    # rank 0's, so rank 0's two hops pass, and push its words into rank 1's.
    recv = [torch.zeros(2 * 2 * 3 * HOP_COLS, dtype=torch.int64) for _ in range(2)]
    peers = torch.tensor([r.data_ptr() for r in recv], dtype=torch.int64)
    one = recv[0][:4 * HOP_COLS].view(2, 2, HOP_COLS)
    one[0, 1], one[1, 1] = 1 << 32, 2 << 32
    check_hops(rank_hops(recv[0], peers, 0, 2, timeout_s=0.01), 0, 0.01)
    assert recv[1][:4 * HOP_COLS].view(2, 2, HOP_COLS)[1, 0].tolist() == [2 << 32] * HOP_COLS
    # A third hop finds half 0 still at hop 0: rank 1 stopped after 2.
    error = rank_hops(recv[0], peers, 0, 3, timeout_s=0.01)
    with pytest.raises(RuntimeError, match="rank 0 waited 0.01 s at hop 2 for rank 1: its words showed tag 1, "
                                           "expected 3"):
        check_hops(error, 0, 0.01)
    # Three programs at once, each on its own words: the third's peer stopped after 1.
    recv[0].zero_()
    three = recv[0].view(2, 2, 3 * HOP_COLS)
    three[0, 1], three[1, 1, :2 * HOP_COLS] = 1 << 32, 2 << 32
    error = rank_hops(recv[0], peers, 0, 2, programs=3, timeout_s=0.01)
    with pytest.raises(RuntimeError, match="at hop 1 for rank 1: its words showed tag 0, expected 2"):
        check_hops(error, 0, 0.01)
    with pytest.raises(ValueError, match=r"4 program\(s\) over 2 ranks need recv of 256 words"):
        rank_hops(recv[0], peers, 0, 5, programs=4)


def _prefill_rank(rank: int, tp: int, init: str, config_dict: dict, prompts: list, out: dict) -> None:
    """One process of a CPU tensor-parallel prefill (gloo between the ranks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        config = LlamaConfig.from_dict(config_dict)
        for precision in ("exact", "fast"):
            model = Llama.from_config(config, seed=7, device="cpu", max_batch_size=len(prompts), max_seq_len=16,
                                      prefill_precision=precision, tp=tp)
            assert model.rank == rank and model.shape.heads == config.num_attention_heads // tp
            out[(rank, precision)] = model.logits(prompts)
    finally:
        dist.destroy_process_group()


def _spawned(rank, tp, init, config_dict, prompts, queue):
    out = {}
    _prefill_rank(rank, tp, init, config_dict, prompts, out)
    queue.put({k: v.numpy() for k, v in out.items()})


def test_prefill_over_ranks_gives_the_whole_model_s_logits(tmp_path):
    # Two processes, each its share of the weights: the O / down partials summed and the LM
    # head's shares gathered over gloo give every rank the unsharded model's logits.
    import torch.multiprocessing as mp

    config = CASES["llama-tp2"][1]
    prompts = [[5, 17, 101, 3, 9, 44], [8, 2, 60]]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, 2, f"file://{tmp_path}/rendezvous", config.to_dict(), prompts,
                                                queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        got.update(queue.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ref = ReferenceLlama(config, random_weights(config, seed=7))
    for b, ids in enumerate(prompts):
        want = ref.forward(torch.tensor([ids]), 0, ref.new_cache(1, 16))[0]
        for (rank, precision), logits in got.items():
            assert rel_err(torch.from_numpy(logits)[b, :len(ids)], want) < 1e-4, (rank, precision, b)


def _on_gloo_rank(rank, init, body, args, queue):
    """One of two gloo processes: ``body(rank, *args)``'s result, or its refusal's message."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        queue.put((rank, body(rank, *args)))
    except (ValueError, RuntimeError) as e:
        queue.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def _two_gloo_ranks(tmp_path, body, *args, timeout: int = 120) -> dict[int, str]:
    """What each of two processes said (:func:`_on_gloo_rank`), by rank; every wait bounded."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_on_gloo_rank, args=(r, f"file://{tmp_path}/rendezvous", body, args, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    said = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return said


def _load_with_own_eps(rank, config_dict):
    config = LlamaConfig.from_dict({**config_dict, "rms_norm_eps": 1e-5 if rank == 0 else 1e-6})
    Llama.from_config(config, device="cpu", max_batch_size=1, max_seq_len=8, tp=2)
    return "loaded"


def test_a_rank_that_loaded_another_config_is_refused_on_every_rank(tmp_path):
    said = _two_gloo_ranks(tmp_path, _load_with_own_eps, CASES["llama-tp2"][1].to_dict())
    assert all("rank(s) [1] loaded another model or config than rank 0" in said[r] for r in range(2)), said


def _build_with_own_cache_length(rank, config_dict):
    Llama.from_config(LlamaConfig.from_dict(config_dict), device="cpu", max_batch_size=1,
                      max_seq_len=16 if rank == 0 else 32, tp=2)
    return "built"


def test_ranks_built_with_other_options_are_refused_on_every_rank(tmp_path):
    # Other cache lengths plan other steps and cut prefill into other chunks: their
    # collectives would not pair up.
    said = _two_gloo_ranks(tmp_path, _build_with_own_cache_length, CASES["llama-tp2"][1].to_dict())
    assert all("they differ in max_seq_len (by rank: [16, 32])" in said[r] for r in range(2)), said


def _prepare_a_step(rank, config_dict, case):
    from mk.persistent.runtime import Megakernel

    model = Llama.from_config(LlamaConfig.from_dict(config_dict), device="cpu", max_batch_size=1, max_seq_len=16,
                              tp=2)
    if rank == 1 and case == "another schedule":  # rank 1 halves one projection's tiles of rank 0's plan
        from dataclasses import replace

        agreed = model.plan

        def other_plan(batch, kv_len=None, **kw):
            plan, graph = agreed(batch, kv_len, **kw)
            name = next(n for n, c in plan.choices.items() if c.block_n >= 32)
            halved = replace(plan.choices[name], block_n=plan.choices[name].block_n // 2)
            return replace(plan, choices={**plan.choices, name: halved}), graph
        model.plan = other_plan
    if rank == 1 and case == "a failed build":
        def refuse(self, program):
            raise RuntimeError("no kernel on rank 1")
        Megakernel.__init__ = refuse
    model.prepare(1, 6)
    return "built"


@pytest.mark.parametrize("case", ["alike", "another schedule", "a failed build"])
def test_ranks_that_built_unlike_decode_steps_are_refused_on_every_rank(tmp_path, case):
    # The ranks' projection tiles wait on one another's words: queued in other orders they
    # can wait on each other for ever. Every rank compares the schedules it built, and one
    # rank's failed build ends every rank's call (none waits in a collective for it).
    said = _two_gloo_ranks(tmp_path, _prepare_a_step, CASES["llama-tp2"][1].to_dict(), case, timeout=300)
    if case == "alike":
        assert said == {0: "built", 1: "built"}, said
    elif case == "another schedule":
        assert all("rank(s) [1] built another schedule of the decode step than rank 0" in said[r] for r in range(2)), said
    else:
        assert said[1] == "no kernel on rank 1", said
        assert "building the decode step failed on rank(s) [1]" in said[0], said


def test_an_embedding_share_gives_its_rows_and_zeros_for_the_other_ranks_tokens():
    # The kernel's own code (the interpreter), rank 1 of 2: ids in [4, 8) are its rows.
    from mk.persistent.graph import TaskGraph
    from mk.persistent.runtime import Megakernel
    from mk.tasks import make_op, op_tiles

    table = torch.randn(4, 48)
    ids = torch.tensor([1, 5, 7, 4, 0], dtype=torch.int32)
    g = TaskGraph()
    for name, t in (("ids", ids), ("table", table), ("out", torch.full((5, 48), 9.0))):
        g.buffer(name, t)
    spec = make_op("embedding", rows=5, vocab=4, hidden=48, ranks=2, block_h=32)
    g.add_tiles(spec, [dict(t, rank=1) for t in op_tiles(spec)], ids="ids", table="table", out="out")
    Megakernel(lower(g, num_workers=1)).run()
    want = torch.zeros(5, 48)
    want[1], want[2], want[3] = table[1], table[3], table[0]
    assert torch.equal(g.buffers["out"], want)


def test_a_kernel_reset_zeroes_the_pushed_words_and_a_peer_s_timeout_names_the_rank():
    # The words carry the launch's number + 1; a reset after a failed launch restarts the
    # count, so it must zero them too, or a later launch would take an old word for its own.
    from mk.persistent.graph import TaskGraph
    from mk.persistent.runtime import Megakernel, MegakernelTimeout
    from mk.tasks import make_op, op_tiles

    g = TaskGraph()
    for name, t in (("part", torch.randn(2, 40)), ("res", torch.randn(2, 40)), ("out", torch.zeros(2, 40)),
                    ("recv", torch.zeros(1, 2, 40, dtype=torch.int64)), ("peers", torch.zeros(1, dtype=torch.int64))):
        g.buffer(name, t)
    g.buffers["peers"][0] = g.buffers["recv"].data_ptr()
    spec = make_op("all_reduce", M=2, N=40, world=1)
    g.add_tiles(spec, [dict(t, rank=0, hop=0) for t in op_tiles(spec)], part="part", res="res", out="out",
                recv="recv", peers="peers")
    kernel = Megakernel(lower(g, num_workers=1))
    kernel.run()
    assert torch.equal(g.buffers["out"], g.buffers["res"] + g.buffers["part"])
    assert torch.equal(g.buffers["recv"][0], _words(g.buffers["part"], 1))
    kernel.reset()
    assert not g.buffers["recv"].any()
    assert "waited on rank 1 of the tensor-parallel step, saw 3 of 4" in str(MegakernelTimeout(0, 0, "all_reduce#0",
                                                                                               -3, 3, 4))


def test_the_standalone_embedding_takes_a_vocabulary_share():
    from mk.tasks import embedding

    table = torch.randn(4, 48)
    ids = torch.tensor([1, 5, 7, 4, 0], dtype=torch.int32)
    want = torch.zeros(5, 48)
    want[1], want[2], want[3] = table[1], table[3], table[0]
    assert torch.equal(embedding(ids, table, vocab_start=4), want)
    with pytest.raises(ValueError, match="holds -1"):
        embedding(torch.tensor([-1, 2]), table, vocab_start=4)


def test_a_rank_s_step_build_reports_the_time_its_shared_buffers_took():
    _, config, tp = CASES["llama-tp2"]
    weights = random_weights(config, seed=1)
    model = Llama(config, shard_weights(weights, tp_slices(config, tp, 0)), device="cpu", dtype=torch.float32,
                  max_batch_size=1, max_seq_len=S, tp=tp, rank=0)
    first = model.prepare(1, S)
    assert set(first) == {"plan_s", "lower_s", "compile_s", "share_s"} and first["share_s"] >= 0
    assert model.prepare(1, S) == dict.fromkeys(first, 0.0)  # built before: nothing paid
    one = Llama(config, weights, device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=S)
    assert set(one.prepare(1, S)) == {"plan_s", "lower_s", "compile_s"}


@pytest.mark.parametrize("M,run,tma,split", [(3, 1, 0, 1), (1, 3, 2, 1), (2, 1, 0, 2)],
                         ids=["rows-tile", "tma-run-of-3", "split-k-reduce"])
def test_a_projection_sums_its_columns_over_the_ranks_in_its_own_tiles(M, run, tma, split):
    from mk.persistent.graph import TaskGraph
    from mk.persistent.runtime import Megakernel, MegakernelTimeout
    from mk.tasks import make_op, op_tiles

    # Rank 0's O projection whose tiles (split-K: whose reduce tiles) also all-reduce
    # (all_reduce=2), run by the interpreter, as the step's fourth all-reduce (hop 3, tag
    # 4 in launch 0); rank 1 has pushed its partial into rank 0's receive buffer (two CPU
    # "workspaces"), and a stale word of the hop before stands in one slot until then.
    N, K = 80, 32
    g = TaskGraph()
    if split == 1:
        op = make_op("linear", M=M, N=N, K=K, block_n=16, block_k=16, tma_stages=tma, tiles_per_task=run,
                     all_reduce=2, dtype=torch.float32)
        first, inputs = None, dict(x="x", w="w")
    else:
        first = make_op("linear_partial", M=M, N=N, K=K, split_k=split, block_n=16, block_k=16, dtype=torch.float32)
        op = make_op("linear_reduce", M=M, N=N, K=K, split_k=split, block_n=16, block_k=16, all_reduce=2,
                     dtype=torch.float32)
        g.buffer("ws", torch.full((split, M, first.constexprs["WS_N"]), torch.nan))
        inputs = dict(ws="ws")
    recv = [torch.zeros(2, M, N, dtype=torch.int64) for _ in range(2)]
    x, w = [torch.randn(M, K) for _ in range(2)], [torch.randn(N, K) for _ in range(2)]
    parts = [x[q] @ w[q].T for q in range(2)]
    recv[0][1] = _words(parts[1], 4)
    res = torch.randn(M, N)
    for name, t in (("x", x[0]), ("w", w[0]), ("out", torch.full((M, N), torch.nan)), ("res", res),
                    ("total", torch.full((M, N), torch.nan)), ("recv", recv[0]),
                    ("peers", torch.tensor([r.data_ptr() for r in recv], dtype=torch.int64))):
        g.buffer(name, t)
    if first is not None:
        for a in op_tiles(first):
            g.add(first, x="x", w="w", ws="ws", **a)
    for a in op_tiles(op):
        g.add(op, **inputs, out="out", res="res", total="total", recv="recv", peers="peers", rank=0, hop=3, **a)
    Megakernel(lower(g, num_workers=1)).run()
    mine = g.buffers["out"]
    assert rel_err(mine, parts[0]) < 1e-5
    assert torch.equal(g.buffers["total"], (res + mine) + parts[1])  # rank order: every rank's bits
    for q in range(2):  # its words, as it stored its partial, in its slot of both ranks' buffers
        assert torch.equal(recv[q][0], _words(mine, 4)), q
    # The hop before's words (tag 3) do not pass for this one's: the tile waits them out.
    recv[0][1] = _words(parts[1], 3)
    g.buffers["total"].fill_(torch.nan)
    kernel = Megakernel(lower(g, num_workers=1), interpret_polls=50)
    with pytest.raises(MegakernelTimeout, match="waited on rank 1 of the tensor-parallel step, saw 3 of 4"):
        kernel.run()


def test_a_tensor_parallel_model_refuses_sampling_before_any_work():
    _, config, tp = CASES["llama-tp2"]
    model = Llama(config, shard_weights(random_weights(config, seed=1), tp_slices(config, tp, 0)), device="cpu",
                  dtype=torch.float32, max_batch_size=1, max_seq_len=S, tp=tp, rank=0)
    for kw in (dict(temperature=0.7), dict(temperature=0.7, top_k=5)):
        with pytest.raises(ValueError, match="tensor-parallel model \\(tp=2\\) decodes greedily"):
            model.generate([[1, 2, 3]], max_new_tokens=2, **kw)
        with pytest.raises(ValueError, match="decodes greedily"):
            model.prepare(1, S, **kw)
    assert not model.steps.built and model.last_decoder is None


def test_measured_planning_over_ranks_is_refused_on_the_cpu_naming_why():
    _, config, tp = CASES["llama-tp2"]
    weights = shard_weights(random_weights(config, seed=1), tp_slices(config, tp, 0))
    with pytest.raises(ValueError, match="plan_mode='measure' under tensor parallelism times the plans on the "
                                         "ranks' GPUs together"):
        Llama(config, weights, device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=S, tp=tp, rank=0,
              plan_mode="measure")
    # One rank alone on the CPU still measures (the interpreter times its step).
    Llama(config, shard_weights(random_weights(config, seed=1), tp_slices(config, 1, 0)), device="cpu",
          dtype=torch.float32, max_batch_size=1, max_seq_len=S, plan_mode="measure")


def test_a_rank_left_out_of_step_with_its_peers_refuses_every_later_prompt():
    _, config, tp = CASES["llama-tp2"]
    model = Llama(config, shard_weights(random_weights(config, seed=1), tp_slices(config, tp, 0)), device="cpu",
                  dtype=torch.float32, max_batch_size=1, max_seq_len=S, tp=tp, rank=0)
    # (What a failed replay of a captured prefill chunk leaves on a GPU: its peers may still
    # wait in one of its sums.)
    model.ranks.out_of_step = "replaying a captured prefill chunk failed on rank 0: boom"
    for work in (lambda: model.generate([[1, 2, 3]], max_new_tokens=2), lambda: model.logits([[1, 2, 3]]),
                 lambda: model.prepare(1, 8)):
        with pytest.raises(RuntimeError, match=r"ranks are out of step \(replaying .* boom\); start the processes "
                                               r"again"):
            work()
    assert model.last_decoder is None and not model.steps.built
