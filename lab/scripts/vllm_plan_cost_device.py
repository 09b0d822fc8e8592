"""Probe (GPU): what one decode step of the vLLM backend costs outside the captured kernels -- the plan as
``integrations/vllm_backend._plan`` makes it (a padded int32 block table on the device, device lengths, host query
offsets), pages of 16, 128 heads, FP8 e4m3 and bf16 pools, B 1 / 8 / 64 at ~1k tokens -- beside the run() it plans
for, replayed from a CUDA graph. Prints ms per plan (host wall time, then with a device sync), the replayed run's
ms, and the backend each plan chose. vLLM 0.26 served FP8MLA's bf16 cache at 0.58x TRITON_MLA's tokens/s at batch 1
(2 layers: 1.7 ms more per step than TRITON_MLA), which a kernel of ~0.03 ms cannot explain."""
import math
import time

import torch

import fp8mla
from fp8mla.layout import PagedLayout


def step_costs(kv_dtype, B, H=128, page=16, W=128, ctx=1024, reps=50):
    dev = "cuda"
    P = B * W + 4
    pool = torch.randn(P, page, 576, device=dev).to(kv_dtype)
    table = torch.randperm(P, device=dev)[: B * W].view(B, W).to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    qo = torch.arange(B + 1, dtype=torch.int32)
    attn = fp8mla.MLAPagedAttention(None, use_cuda_graph=True, backend="auto", max_batch_size=64, max_qo_len=1,
                                    max_kv_indices=64 * W)
    q_nope = torch.randn(B, H, 512, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(B, H, 64, device=dev, dtype=torch.bfloat16)
    out = torch.empty(B, H, 512, device=dev, dtype=torch.bfloat16)

    def plan():
        lay = PagedLayout.from_block_table(table, lens, page, qo_indptr=qo)
        attn.plan_layout(lay, H, 512, 64, True, 1 / math.sqrt(192), torch.bfloat16, kv_dtype)

    def run():
        attn.run(q_nope, q_pe, pool[..., :512], pool[..., 512:], out=out, ckv_scale=1.0, kpe_scale=1.0)

    plan()
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            run()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    host = []
    for _ in range(reps):
        t = time.perf_counter()
        plan()
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    synced = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        plan()
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - t)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return med(host), med(synced), e0.elapsed_time(e1) / reps, attn._plan.backend


def profile(kv_dtype=torch.float8_e4m3fn, B=8):
    """cProfile of the plan (host) and the CUDA calls it makes."""
    import cProfile
    import pstats
    H, page, W, dev = 128, 64 if kv_dtype == torch.float8_e4m3fn else 16, 32, "cuda"
    table = torch.randperm(B * W + 4, device=dev)[: B * W].view(B, W).to(torch.int32)
    lens = torch.full((B,), 1024, dtype=torch.int32, device=dev)
    qo = torch.arange(B + 1, dtype=torch.int32)
    attn = fp8mla.MLAPagedAttention(None, use_cuda_graph=True, backend="auto", max_batch_size=64, max_qo_len=1,
                                    max_kv_indices=64 * W)

    def plan():
        lay = PagedLayout.from_block_table(table, lens, page, qo_indptr=qo)
        attn.plan_layout(lay, H, 512, 64, True, 1 / math.sqrt(192), torch.bfloat16, kv_dtype)
    for _ in range(3):
        plan()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        plan()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    from torch.profiler import ProfilerActivity, profile as tprof
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        plan()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=30))


if __name__ == "__main__" and len(__import__("sys").argv) > 1:
    profile(*([torch.float8_e4m3fn] if __import__("sys").argv[1] == "fp8" else [torch.bfloat16]))
elif __name__ == "__main__":
    print(f"{torch.cuda.get_device_name(0)} torch {torch.__version__} fp8mla {fp8mla.__version__}")
    for kv in (torch.float8_e4m3fn, torch.bfloat16):
        for B in (1, 8, 64):
            h, sy, r, be = step_costs(kv, B)
            print(f"{str(kv).replace('torch.', ''):14s} B{B:<3d} plan {h:.3f} ms host, {sy:.3f} ms with sync; "
                  f"replayed run {r:.4f} ms; backend {be}", flush=True)
