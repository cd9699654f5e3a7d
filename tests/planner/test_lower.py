"""Lowering a decode-step plan to the megakernel's task graph.

The lowered step of a small Llama-shaped model must equal the plain-torch reference's
decode step (logits, cache rows, the appended token and the advanced position) whatever
the plan: the search's top plans, and plans with split-K linears, split-KV attention, an
RMSNorm or RoPE as their own tasks (else fused into the QKV tiles), and TMA-streamed tiles. The VM runs the same descriptors with
many workers in random interleavings: it fails on any read before its producers have
signalled, so passing proves the derived dependencies exact and complete.
"""

from dataclasses import replace

import pytest
import torch

from mk.models import AutoModel, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, ReferenceLlama, random_weights
import mk.persistent.graph as graph_module
from mk.persistent.deps import drop_implied, periodic_run
from mk.persistent.graph import lower
from mk.persistent.runtime import Megakernel
from mk.persistent.vm import run_vm
from mk.planner.cost import OpChoice
from mk.planner.device import DeviceSpec
from mk.models.blocks import decode_graph
from mk.models.blocks import WEIGHT
import mk.planner.lower as lower_module
from mk.planner.lower import lower_decode_step, meta_buffers
from mk.planner.search import search
from tests.conftest import HAS_CUDA, rel_err

# Exact float32 checks of the lowering, on the interpreter; on a GPU the Llama tests and
# bench/ check the lowered steps compiled, in bfloat16.
pytestmark = pytest.mark.skipif(HAS_CUDA, reason="float32 interpreter semantics")

CONFIG = LlamaConfig.tiny(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
B, S = 2, 12
POSITIONS = [3, 7]  # each sequence's cache holds this many tokens before the step


def variants(graph, own_rope_ok: bool = True):
    """Plans to lower: the search's best two, and hand-edited ones covering every lowering path
    (``own_rope_ok`` False: RoPE stays in the QKV tiles, as a QKV bias needs)."""
    plans = search(graph, DeviceSpec.preset("h100"), top_k=2)
    best = plans[0]
    edited = dict(best.choices)
    assert "l0.rope_kv" in best.choices["l0.qkv"].fuse, "the search fuses RoPE into QKV"
    assert "argmax" in best.choices["lm_head"].fuse, "the search puts the argmax partials in the LM head"
    for name in ("l0.down", "l1.qkv", "lm_head"):
        edited[name] = replace(edited[name], split_k=2, block_k=32, tma_stages=0)
    # A split-K LM head leaves the argmax's partials to their own tasks.
    edited["lm_head"] = replace(edited["lm_head"], fuse=("final_norm",))
    edited["argmax"] = OpChoice()
    # l1's split-K QKV carries RoPE in its reduce tiles; in `own_rope`, RoPE is its own task.
    assert "l1.rope_kv" in edited["l1.qkv"].fuse
    edited["l1.attention"] = OpChoice(kv_splits=3)
    own_rope = dict(edited)
    own_rope["l1.qkv"] = replace(edited["l1.qkv"], fuse=tuple(f for f in edited["l1.qkv"].fuse if f != "l1.rope_kv"))
    own_rope["l1.rope_kv"] = OpChoice()
    # l0's attention norm as its own tasks rather than the QKV prologue (RoPE stays fused).
    edited["l0.qkv"] = replace(edited["l0.qkv"], fuse=("l0.rope_kv",))
    edited["l0.attn_norm"] = OpChoice()
    tma = {n: replace(c, tma_stages=2, block_n=16, block_k=32, split_k=1) if graph.node(n).kind == "linear" else c
           for n, c in best.choices.items()}
    # RoPE folded into both layers' attention splits (l0's writes the lengths; l1's has three
    # splits), the QKV tiles writing their plain output.
    folded = dict(edited)
    for L in (0, 1):
        qkv, rope = f"l{L}.qkv", f"l{L}.rope_kv"
        folded[qkv] = replace(edited[qkv], fuse=tuple(f for f in edited[qkv].fuse if f != rope))
        folded[f"l{L}.attention"] = replace(edited[f"l{L}.attention"], fuse=(rope,))
    own = [replace(best, choices=own_rope), replace(best, choices=folded)] if own_rope_ok else []
    return plans + [replace(best, choices=edited)] + own + [replace(best, choices=tma)]


def _setup(config):
    model = AutoModel.from_config(config, seed=11, max_batch_size=B, max_seq_len=S)
    ref = ReferenceLlama(config, random_weights(config, seed=11))
    cache = ref.new_cache(B, S)
    history = torch.randint(0, config.vocab_size, (B, S))
    for b, n in enumerate(POSITIONS):  # fill each sequence's cache with its first n tokens
        single = ref.new_cache(1, S)
        ref.forward(history[b:b + 1, :n], 0, single)
        cache.k[:, b], cache.v[:, b] = single.k[:, 0], single.v[:, 0]
    k0, v0 = cache.k.clone(), cache.v.clone()
    tokens = history[torch.arange(B), torch.tensor(POSITIONS)]
    logits = ref.forward(tokens[:, None], torch.tensor(POSITIONS), cache)[:, 0]
    return model, (k0, v0), history, logits, cache


@pytest.fixture(scope="module")
def setup():
    return _setup(CONFIG)


def run_step(model, plan, graph, setup_data, workers=None, seed=0):
    _, (k0, v0), history, _, _ = setup_data
    model.k_cache.copy_(k0), model.v_cache.copy_(v0)
    i32 = dict(dtype=torch.int32)
    state = {"ids": history[torch.arange(B), torch.tensor(POSITIONS)].to(**i32),
             "pos": torch.tensor(POSITIONS, **i32), "tokens": history.to(**i32).clone()}
    bufs = dict(model.weights, **state)
    for L in range(model.config.num_hidden_layers):
        bufs[f"l{L}.k_cache"], bufs[f"l{L}.v_cache"] = model.k_cache[L], model.v_cache[L]
    step = lower_decode_step(plan, graph, bufs, eps=model.config.rms_norm_eps)
    if workers is None:
        Megakernel(lower(step.graph, num_workers=1)).run()
    else:
        run_vm(lower(step.graph, num_workers=workers, schedule="list"), interleave="random", seed=seed)
    return step, state


def check(step, state, setup_data, model, what):
    _, _, history, want_logits, ref_cache = setup_data
    assert rel_err(step.graph.buffers["logits"], want_logits) < 1e-4, what
    nxt = want_logits.argmax(dim=1)
    assert state["ids"].tolist() == nxt.tolist(), what
    assert state["pos"].tolist() == [p + 1 for p in POSITIONS], what
    for b, p in enumerate(POSITIONS):
        assert int(state["tokens"][b, p + 1]) == int(nxt[b]), what
        assert torch.equal(state["tokens"][b, :p + 1], history[b, :p + 1].to(torch.int32)), what
        # The new K/V rows, and nothing past them.
        assert rel_err(model.k_cache[:, b, :, :p + 1], ref_cache.k[:, b, :, :p + 1]) < 1e-5, what
        assert rel_err(model.v_cache[:, b, :, :p + 1], ref_cache.v[:, b, :, :p + 1]) < 1e-5, what


def test_every_plan_lowers_to_the_reference_step(setup):
    model = setup[0]
    graph = decode_graph(CONFIG.to_model_shape(dtype_bytes=4), B, S)
    for i, plan in enumerate(variants(graph)):
        step, state = run_step(model, plan, graph, setup)
        check(step, state, setup, model, f"plan {i} on the megakernel")


@pytest.mark.parametrize("workers", [3, 16])
def test_vm_proves_the_lowered_dependencies(setup, workers):
    model = setup[0]
    graph = decode_graph(CONFIG.to_model_shape(dtype_bytes=4), B, S)
    for i, plan in enumerate(variants(graph)[2:]):  # the hand-edited plans: every kind of task
        step, state = run_step(model, plan, graph, setup, workers=workers, seed=workers + i)
        check(step, state, setup, model, f"plan {i} on the VM, {workers} workers")


#: The families' options on the same small shape: a window shorter than the cached
#: sequences, biases, per-head q/k norms (whole heads in every fused tile the plans use).
FAMILY = {"mistral-window": MistralConfig.tiny(**{**CONFIG.to_dict(), "rope_scaling": None}, sliding_window=5),
          "qwen2-bias": Qwen2Config.tiny(**{**CONFIG.to_dict(), "rope_scaling": None}),
          "qwen3-qknorm": Qwen3Config.tiny(**{**CONFIG.to_dict(), "rope_scaling": None})}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_every_family_plan_lowers_to_the_reference_step(name):
    # The VM runs every hand-edited plan's tasks (split-K QKV reduces with the bias and q/k
    # norm, split-KV attention over the window, RoPE as its own task) in random orders.
    config = FAMILY[name]
    data = _setup(config)
    model = data[0]
    graph = decode_graph(config.to_model_shape(dtype_bytes=4), B, S)
    plans = variants(graph, own_rope_ok=not config.QKV_BIAS)
    if config.QK_NORM:  # fused RoPE tiles must hold whole heads
        for p in plans:
            assert all(c.block_n % config.head_dim == 0 for n, c in p.choices.items() if "l0.rope_kv" in c.fuse
                       or "l1.rope_kv" in c.fuse), name
    step, state = run_step(model, plans[0], graph, data)
    check(step, state, data, model, f"{name}: the best plan on the megakernel")
    for i, plan in enumerate(plans[2:]):
        step, state = run_step(model, plan, graph, data, workers=5, seed=i)
        check(step, state, data, model, f"{name}: plan {i} on the VM")


def test_layers_share_their_activation_memory(setup):
    # A step holds one layer's activations, not every layer's: each l1 activation is the
    # same tensor as l0's of that role. The VM tests above run these steps and check the
    # sharing on the memory (a layer-1 write before a layer-0 read of it would fail them).
    model = setup[0]
    graph = decode_graph(CONFIG.to_model_shape(dtype_bytes=4), B, S)
    plan = variants(graph)[2]  # split-K workspaces and split-KV attention in both layers' ops
    step, _ = run_step(model, plan, graph, setup, workers=3)
    bufs = step.graph.buffers
    layer1 = [n for n in bufs if n.startswith("l1.") and not n.endswith("_cache")]
    assert {"l1.attention.o_part", "l1.attention.lse", "l1.attention.arrivals", "l1.qkv.ws"} <= set(layer1)
    for name in layer1:
        twin = "l0." + name[3:]
        if twin in bufs and bufs[twin].shape == bufs[name].shape:
            assert bufs[name] is bufs[twin], name
    assert bufs["l1.k_cache"].data_ptr() != bufs["l0.k_cache"].data_ptr()  # the caches stay the caller's
    assert bufs["x0"].data_ptr() not in {bufs[n].data_ptr() for n in layer1}


def test_missing_or_misshapen_buffers_are_named(setup):
    model = setup[0]
    graph = decode_graph(CONFIG.to_model_shape(dtype_bytes=4), B, S)
    plan = search(graph, DeviceSpec.preset("h100"), top_k=1)[0]
    bufs = dict(model.weights)
    with pytest.raises(ValueError, match="missing buffers.*ids"):
        lower_decode_step(plan, graph, bufs, eps=1e-5)
    bufs.update(ids=torch.zeros(B, dtype=torch.int32), pos=torch.zeros(B, dtype=torch.int32),
                tokens=torch.zeros(B, S, dtype=torch.int32))
    for L in range(CONFIG.num_hidden_layers):
        bufs[f"l{L}.k_cache"], bufs[f"l{L}.v_cache"] = model.k_cache[L], model.v_cache[L]
    bufs["l1.v_cache"] = model.v_cache[1, :, :, :S - 1]
    with pytest.raises(ValueError, match=r"l1.v_cache has shape"):
        lower_decode_step(plan, graph, bufs, eps=1e-5)
    bufs["l1.v_cache"] = model.v_cache[1]
    split_head = dict(plan.choices, lm_head=replace(plan.choices["lm_head"], split_k=2))
    with pytest.raises(ValueError, match="lm_head fuses the argmax with split_k=2"):
        lower_decode_step(replace(plan, choices=split_head), graph, bufs, eps=1e-5)
    unfused = dict(plan.choices)
    unfused["l0.down"] = replace(unfused["l0.down"], fuse=())
    with pytest.raises(ValueError, match="l0.mlp_residual"):
        lower_decode_step(replace(plan, choices=unfused), graph, bufs, eps=1e-5)


def test_attention_reads_positions_no_task_writes_before_it(setup):
    # The step's attention reads its length from pos before its wait (decode_length), so no
    # task may write pos until every attention task is done: its only writers must come
    # after all of them in the dependency order (append_token, at the step's end).
    model = setup[0]
    graph = decode_graph(CONFIG.to_model_shape(dtype_bytes=4), B, S)
    step, _ = run_step(model, variants(graph)[2], graph, setup, workers=3)
    g = step.graph
    attention = [t.index for t in g.tasks if t.op.name == "decode_attention"]
    assert attention and all(t.bind["pos"] == "pos" for t in g.tasks if t.op.name == "decode_attention")
    writers = [t.index for t in g.tasks if any(r.buffer == "pos" for r in t.writes())]
    assert writers and {g.tasks[i].op.name for i in writers} == {"append_token"}
    deps = g.dependencies()
    for w in writers:
        before = set(deps[w])
        frontier = list(before)
        while frontier:  # everything the writer waits for, transitively
            for d in deps[frontier.pop()]:
                if d not in before:
                    before.add(d)
                    frontier.append(d)
        assert set(attention) <= before, g.tasks[w].name


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_meta_buffers_hold_the_model_s_weight_bytes_and_lower(dtype_bytes):
    """The meta buffers of a step (no memory) have the weights' shapes and dtype: all but the
    embedding table (a step reads one row of it) add up to the bytes a step streams, and the
    step lowers on them."""
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    shape = replace(cfg.to_model_shape("tiny"), dtype_bytes=dtype_bytes)
    graph = decode_graph(shape, 2, 32)
    bufs = meta_buffers(graph, 32)
    assert all(t.device.type == "meta" for t in bufs.values())
    streamed = sum(t.numel() * t.element_size() for n, t in bufs.items()
                   if n.startswith(WEIGHT) and n != WEIGHT + "embed")
    assert streamed == shape.weight_bytes
    step = lower_decode_step(search(graph, DeviceSpec.preset("h100"))[0], graph, bufs, eps=1e-5)
    assert len(step.graph.tasks) == sum(step.tasks_per_op.values())
    with pytest.raises(ValueError, match="2 or 4"):
        meta_buffers(decode_graph(replace(shape, dtype_bytes=1), 2, 32), 32)


@pytest.mark.parametrize("name,batch", [("llama", 1), ("qwen3-qknorm", 3), ("mistral-window", 2)])
def test_a_long_step_s_dependencies_follow_from_a_few_layers(name, batch, monkeypatch, tmp_path):
    # A step of 13 layers derives its dependencies from a few of them (mk.persistent.deps.reduce_run):
    # they must equal those derived from every task, for the search's plan (layers 1-12 repeat
    # layer 1; layer 0 writes the sequence lengths) and for one whose layer 4 differs (the
    # longest run is then layers 5-12).
    monkeypatch.setenv("MK_CACHE_DIR", str(tmp_path))
    config = {"llama": CONFIG, **FAMILY}[name]
    config = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 13})
    graph = decode_graph(config.to_model_shape(dtype_bytes=4), batch, S)
    best = search(graph, DeviceSpec.preset("h100"))[0]
    odd = dict(best.choices, **{"l4.down": replace(best.choices["l4.down"], split_k=2, block_k=32, tma_stages=0)})
    for plan, layers in ((best, range(1, 13)), (replace(best, choices=odd), range(5, 13))):
        step = lower_decode_step(plan, graph, meta_buffers(graph, S), eps=1e-5)
        first = sum(n for op, n in step.phases[:next(i for i, (op, _) in enumerate(step.phases)
                                                       if op.startswith(f"l{layers[0]}."))])
        length = sum(n for op, n in step.phases if op.startswith(f"l{layers[0]}."))
        assert periodic_run(step.graph.tasks, step.graph.periods) == (first, length, len(layers))
        with monkeypatch.context() as m:  # every layer lowered, none copied from the one before
            m.setattr(lower_module, "_scope_signature", lambda *a: None)
            plain = lower_decode_step(plan, graph, meta_buffers(graph, S), eps=1e-5)
        assert [(t.op.key, t.bind, t.args, t.team_start) for t in step.graph.tasks] == [
            (t.op.key, t.bind, t.args, t.team_start) for t in plain.graph.tasks]
        assert (step.phases, step.graph.periods) == (plain.phases, plain.graph.periods)
        assert _memory(step.graph.buffers) == _memory(plain.graph.buffers)  # the same sharing
        derived = []  # how many tasks' dependencies were derived: a few layers', not all
        with monkeypatch.context() as m:
            m.setenv("MK_CACHE_DIR", str(tmp_path / f"derive{len(layers)}"))  # (the search kept its finalists')
            m.setattr(graph_module, "drop_implied", lambda deps: derived.append(len(deps)) or drop_implied(deps))
            periodic = step.graph.events()
        assert len(derived) == 1 and derived[0] < len(step.graph.tasks) - (len(layers) - 5) * length
        step.graph.periods, step.graph._deps, step.graph._events = [], None, None
        full = step.graph.events()
        assert periodic[0] == full[0] and periodic[1] == full[1], (name, batch, count)


def _memory(buffers):
    """Buffers by name, grouped by the tensor they are, with its shape and dtype."""
    groups = {}
    for name, t in buffers.items():
        groups.setdefault(id(t), (tuple(t.shape), t.dtype, []))[2].append(name)
    return sorted((shape, str(dtype), sorted(names)) for shape, dtype, names in groups.values())
