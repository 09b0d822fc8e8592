"""Probe of the heads-on-M CUDA-graph re-plan with host lengths (GPU): which requests' lse differ from float64
after a re-plan, and the staged work items behind them."""
import torch
import fp8mla
from fp8mla.testing import make_paged_batch, capture_then_replay, compare
from fp8mla.reference import mla_reference

DEVICE = "cuda"


def host(args):
    return {k: (v.cpu() if k in ("qo_indptr", "kv_indptr", "kv_len_arr") else v) for k, v in args.items()}


for H in (64, 128):
    lens1 = [100, 3000, 17, 5000, 64, 900, 2600, 1]
    b1 = make_paged_batch(lens1, [1] * 8, H, 64, "fp8_e4m3", device=DEVICE, seed=H + 1, spare_pages=80)
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8, heads_on_m=True,
                                    min_chunk=64)
    attn.plan(**host(b1.plan_args))
    q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
    out = torch.empty_like(q_nope)
    lse = torch.empty(8, H, device=DEVICE)
    kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
    print(H, "first replay", compare(out, b1.reference()[0]))
    for variant in ("with_empty", "no_empty"):
        a = host(b1.plan_args)
        lens2 = [5000, 1, 0, 64, 3000, 17, 900, 1] if variant == "with_empty" else [5000, 1, 5, 64, 3000, 17, 900, 1]
        a["kv_len_arr"] = torch.tensor(lens2, dtype=torch.int32).clamp(
            max=(a["kv_indptr"][1:] - a["kv_indptr"][:-1]).clamp(min=0) * 64)
        attn.plan(**a)
        t = attn._plan.impl.t
        n = int(t["m_ptr"][8])
        print(H, variant, "kv_len", a["kv_len_arr"].tolist(), "items", n)
        for key in ("item_req", "item_t0", "item_t1", "m_list"):
            print("  ", key, t[key][:n].tolist())
        print("   m_ptr", t["m_ptr"][:9].tolist(), "batch_size", t["batch_size"].tolist(), "kv_len", t["kv_len"][:8].tolist())
        for rep in range(3):
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            ref, ref_lse = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"].to(DEVICE),
                                         a["kv_indptr"].to(DEVICE), a["kv_indices"], a["kv_len_arr"].to(DEVICE),
                                         sm_scale=a["sm_scale"], causal=True)
            print("   rep", rep, "out", compare(out, ref))
            print("   rep", rep, "lse", compare(lse, ref_lse))
            for r in range(8):
                c = compare(lse[r], ref_lse[r])
                if c.nan_mismatch or c.rel_l2 > 1e-4:
                    print("     request", r, c, "got", lse[r, :4].tolist(), "ref", ref_lse[r, :4].tolist())
        # the same plan without the graph: plain launch
        plain = fp8mla.MLAPagedAttention(backend="gluon", heads_on_m=True, min_chunk=64)
        plain.plan(**a)
        o2, l2 = plain.run(q_nope, q_pe, return_lse=True, **kw)
        print("   plain host-length plan lse", compare(l2, ref_lse), "out", compare(o2, ref))
