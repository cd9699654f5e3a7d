"""GPU probe: which GEMV tile shapes stream bf16 weights fastest (M=1).

Standalone on purpose (no mk imports): it explores the design space before the linear
task fixes its defaults. Times CUDA-graph replays over rotating weight copies (so L2
holds none of them) and prints each config's fraction of the device-to-device copy
bandwidth measured in the same run.
"""
import itertools, json, os
import torch, triton, triton.language as tl


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_ptrs = w_ptr + offs_n[:, None] * stride_w + offs_k[None, :]
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            x = tl.load(x_ptr + k + offs_k)
        else:
            mk_ = (k + offs_k) < K
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mk_[None, :], other=0.0)
            x = tl.load(x_ptr + k + offs_k, mask=mk_, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def gemv_splitk_kernel(x_ptr, w_ptr, part_ptr, N, K, stride_w, K_PER_SPLIT,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k0 = pid_k * K_PER_SPLIT
    w_ptrs = w_ptr + offs_n[:, None] * stride_w + k0 + offs_k[None, :]
    for k in range(k0, k0 + K_PER_SPLIT, BLOCK_K):
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        x = tl.load(x_ptr + k + offs_k)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    tl.store(part_ptr + pid_k * N + offs_n, tl.sum(acc, axis=1), mask=mask_n)


def graph_time_us(fn_list, reps=20):
    """Per-call µs of fn_list (one call each) captured in a CUDA graph, median of reps."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list: f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list: f()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / len(fn_list))
    ts.sort()
    return ts[len(ts) // 2]


def copy_bw():
    n = 1 << 29  # 1 GiB bf16
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    us = graph_time_us([lambda: b.copy_(a)] * 4)
    return 2 * a.numel() * 2 / (us * 1e-6)


def main():
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    bw = copy_bw()
    out["copy_TBps"] = bw / 1e12
    print(f"copy {bw/1e12:.3f} TB/s", flush=True)
    shapes = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 8192), (2048, 2048)]
    rows = []
    for K, N in shapes:
        nbytes = N * K * 2
        copies = max(2, int(-(-400e6 // nbytes)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(N, device="cuda", dtype=torch.bfloat16)
        ref = (ws[0].float() @ x.float())
        calls = 40
        us = graph_time_us([lambda w=ws[i % copies]: torch.mv(w, x, out=y) for i in range(calls)])
        r = dict(K=K, N=N, impl="torch.mv", us=us, frac=nbytes / (us * 1e-6) / bw)
        rows.append(r); print(r, flush=True)
        for BN, BK, nw, ns in itertools.product([4, 8, 16, 32], [256, 512, 1024], [4, 8], [1, 3]):
            if BN * BK > 16384 or BN * BK < 2048: continue
            grid = (triton.cdiv(N, BN),)
            try:
                f = lambda w: gemv_kernel[grid](x, w, y, N, K, K, BLOCK_N=BN, BLOCK_K=BK, EVEN_K=K % BK == 0, num_warps=nw, num_stages=ns)
                f(ws[0]); torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                us = graph_time_us([lambda w=ws[i % copies]: f(w) for i in range(calls)])
            except Exception as e:
                print("fail", BN, BK, nw, ns, repr(e)[:100]); continue
            r = dict(K=K, N=N, impl="gemv", BN=BN, BK=BK, warps=nw, stages=ns, us=us, frac=nbytes / (us * 1e-6) / bw, err=err)
            rows.append(r)
        best = sorted([r for r in rows if r["K"] == K and r["N"] == N and r["impl"] == "gemv"], key=lambda r: r["us"])[:6]
        for r in best: print("  best", r, flush=True)
        # split-K variants for the best few tile shapes
        for BN, BK, nw, ns in {(r["BN"], r["BK"], r["warps"], r["stages"]) for r in best[:3]}:
            for S in [2, 4, 8]:
                if K % (S * BK): continue
                part = torch.empty(S, N, device="cuda", dtype=torch.float32)
                grid = (triton.cdiv(N, BN), S)
                def f(w, S=S, part=part, grid=grid, BN=BN, BK=BK, nw=nw, ns=ns):
                    gemv_splitk_kernel[grid](x, w, part, N, K, K, K // S, BLOCK_N=BN, BLOCK_K=BK, num_warps=nw, num_stages=ns)
                    torch.sum(part, 0, out=y)
                us = graph_time_us([lambda w=ws[i % copies]: f(w) for i in range(calls)])
                r = dict(K=K, N=N, impl="splitk", S=S, BN=BN, BK=BK, warps=nw, stages=ns, us=us, frac=nbytes / (us * 1e-6) / bw)
                rows.append(r); print("  ", r, flush=True)
        del ws
        torch.cuda.empty_cache()
    out["rows"] = rows
    path = os.path.join(os.environ.get("OUT", "."), "gemv_probe.json")
    json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
