"""Probe (GPU): a CUDA-graph wrapper planned the way the vLLM backend plans (a padded int32 block table on the
device, device lengths, the query offsets on the host), at 128 heads, pages of 16, ~1024-token requests, FP8 e4m3.
Scenario per subprocess (an illegal memory access ends the CUDA context): capture after a first plan, re-plan
with other rows (padding rows without queries or with length 0; longer lengths), replay, compare the rows with
queries against float64. Prints which backend each plan chose."""
import subprocess
import sys

import torch

SCENARIOS = ["same", "pad_q0_after", "pad_q0_first", "pad_len0_after", "grow_after"]


def run(scenario: str) -> None:
    import math
    import fp8mla
    from fp8mla.layout import PagedLayout
    from fp8mla.reference import mla_reference
    from fp8mla.testing import capture_then_replay, compare
    dev, H, page, Bmax, W = "cuda", 128, 16, 8, 80
    g = torch.Generator(device="cpu").manual_seed(0)
    P = Bmax * W + 4
    pool = (torch.randn(P, page, 576, generator=g)).to(torch.float8_e4m3fn).to(dev)
    table = torch.randperm(P, generator=g)[: Bmax * W].view(Bmax, W).to(torch.int32).to(dev)
    attn = fp8mla.MLAPagedAttention(None, use_cuda_graph=True, backend="auto", max_batch_size=Bmax, max_qo_len=1,
                                    max_kv_indices=Bmax * W)
    q_nope = torch.randn(Bmax, H, 512, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(Bmax, H, 64, device=dev, dtype=torch.bfloat16)
    out = torch.empty(Bmax, H, 512, device=dev, dtype=torch.bfloat16)

    def plan(lens, qo):
        B = len(lens)
        qo_indptr = torch.tensor([0] + list(torch.tensor(qo).cumsum(0).tolist()), dtype=torch.int32)
        lay = PagedLayout.from_block_table(table[:B], torch.tensor(lens, dtype=torch.int32, device=dev), page,
                                           qo_indptr=qo_indptr)
        attn.plan_layout(lay, H, 512, 64, True, 1 / math.sqrt(192), torch.bfloat16, torch.float8_e4m3fn)
        return qo_indptr

    def check(lens, qo, qo_indptr, what):
        n = int(qo_indptr[-1])
        ref, _ = mla_reference(q_nope[:n], q_pe[:n], pool[..., :512], pool[..., 512:], qo_indptr.to(dev),
                               torch.arange(len(lens) + 1, dtype=torch.int32, device=dev) * W, table.view(-1),
                               torch.tensor(lens, dtype=torch.int32, device=dev), sm_scale=1 / math.sqrt(192),
                               causal=True)
        print(f"  {what}: backend {attn._plan.backend} {compare(out[:n], ref)}", flush=True)

    first = {"pad_q0_first": ([1030, 1027, 1025, 0], [1, 1, 1, 0])}.get(scenario, ([1030, 1027, 1025, 1024], [1] * 4))
    later = {"same": ([1031, 1028, 1026, 1025], [1] * 4),
             "pad_q0_after": ([1031, 1028, 1026, 0], [1, 1, 1, 0]),
             "pad_q0_first": ([1031, 1028, 1026, 1025], [1] * 4),
             "pad_len0_after": ([1031, 1028, 1026, 0], [1] * 4),
             "grow_after": ([1270, 1100, 1026, 1200], [1] * 4)}[scenario]
    qi = plan(*first)
    n = int(qi[-1])
    graph = capture_then_replay(lambda: attn.run(q_nope[:n], q_pe[:n], pool[..., :512], pool[..., 512:],
                                                 out=out[:n], ckv_scale=1.0, kpe_scale=1.0), out[:n])
    check(*first, qi, "first replay")
    qi = plan(*later)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(*later, qi, "replay after re-plan")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for s in SCENARIOS:
            r = subprocess.run([sys.executable, __file__, s], capture_output=True, text=True, timeout=120)
            print(f"{s}: exit {r.returncode}")
            print(r.stdout.strip())
            if r.returncode:
                print(r.stderr.strip()[-1500:])
