"""The heads-on-M build of the Gluon sm_90 decode kernel (``kernels/sm90/heads_on_m.py``: 64 heads on the MMA's M
side, 33..128 heads, one query per request, per-tensor e4m3, pages of a multiple of 64).

CPU: both named builds compile for sm_90a (no spills under triton 3.6, the prototype's 36 + 16 HGMMA per tile in
each consumer role, no byte-wise shared loads or local memory in the consumers' loops), the selector's choices and
refusals, the ``heads_on_m`` option's validation, the plan's grid and work items (host, device and CUDA-graph
schedules) and the launcher's arguments.
GPU (an sm_90 device with Gluon; skipped elsewhere): odd lengths over NaN-poisoned shuffled pools at 64, 96 and 128
heads, pages 64 and 128, B1 L32k, fp16 queries with scales 0.05 / 0.02, forced splits (the merge), host-side
schedules, bit-identical reruns, CUDA-graph replay after a re-plan, and the wide build (``heads_on_m=False``)
giving the same answer.
"""
from __future__ import annotations

import pytest
import torch

import fp8mla
from fp8mla.kernels import sm90 as k, split
from conftest import compile_report_in_child, gluon_build
from fp8mla.testing import assert_close, capture_then_replay, make_paged_batch

ON_SM90 = torch.cuda.is_available() and "gluon" in fp8mla.available_backends("cuda")
gpu = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with triton.experimental.gluon")
DEVICE = "cuda" if ON_SM90 else "cpu"
LENS = [0, 1, 63, 64, 65, 127, 1000, 4097]


# -- CPU --------------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("heads", [64, 128])
def test_compiles_for_sm90a_without_spills(heads):
    import triton
    r, _ = compile_report_in_child(page=64, heads=heads, heads_on_m=True, aligned_ints=True)
    assert not r["serialized_wgmma"], r["ptxas"]
    # no spills under triton 3.6 (the H200's); triton 3.9's ptxas keeps 8 B of one consumer's state on the stack
    # outside its tile loop (stored before it, loaded in the epilogue: the loop checks below still hold)
    limit = 0 if triton.__version__.startswith("3.6.") else 8
    assert all(st <= limit and ld <= limit for st, ld in r["spills"]), r["spills"]
    # two consumer partitions, each loop holding both roles: the owner's 36 m64n64k16 score MMAs (9 chunks x 4
    # k-steps) and the 16 P.V MMAs (4 column chunks x 4 k-steps); the two converters have none
    assert [lp["HGMMA"] for lp in r["loops"]] == [36 + 16, 36 + 16], r["loops"]
    assert all(lp["LDS.U8"] == 0 and lp["STL"] == 0 and lp["LDL"] == 0 for lp in r["loops"]), r["loops"]
    assert r["ops"].get("F2FP.F16.E4M3.UNPACK_B", 0) >= 144, r["ops"]   # the converters' packed FP8 -> fp16
    assert abs(r["smem"] - k.mh_smem_bytes()) < 1024 and r["smem"] <= k.SMEM_LIMIT, r["smem"]


def _spec(H=128, page=64, fmt="fp8_e4m3", q=torch.bfloat16, graph=False):
    from fp8mla.backends import AttentionSpec
    from fp8mla.formats import get_format
    return AttentionSpec(H, 512, 64, page, True, 192 ** -0.5, q, get_format(fmt), torch.device("cpu"), graph)


def _layout(page=64, qo_lens=(1,), lens=None, host=True):
    from fp8mla.layout import PagedLayout
    B = len(qo_lens)
    lens = list(lens or [130] * B)
    qo = torch.tensor([0] + [sum(qo_lens[: b + 1]) for b in range(B)], dtype=torch.int32)
    n = [max(1, -(-x // page)) for x in lens]
    kv = torch.tensor([0] + [sum(n[: b + 1]) for b in range(B)], dtype=torch.int32)
    lay = PagedLayout.from_csr(qo, kv, torch.arange(sum(n), dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                               page)
    if not host:   # the same tables as device-only ones (no host lengths: the device schedule)
        lay = PagedLayout(lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_len, page, torch.device("cpu"),
                          lay.qo_lens)
    return lay


@pytest.fixture
def gb(monkeypatch):
    from fp8mla.backends import gluon as gb
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)
    monkeypatch.setattr(gb, "num_sms", lambda device: 132)
    return gb


@pytest.mark.usefixtures("sm90_compile_tools")
def test_select_takes_heads_on_m_where_it_fits_and_says_why_not(gb):
    def case(H=128, page=64, qo_lens=(1,), fmt="fp8_e4m3", q=torch.bfloat16, **opts):
        return gluon_build(_spec(H, page, fmt, q), _layout(page, qo_lens), opts)

    for kw in (dict(), dict(H=33), dict(H=64), dict(H=96), dict(page=128), dict(page=256), dict(q=torch.float16),
               dict(heads_on_m=True), dict(num_stages=3)):
        b = case(**kw)
        H, page = kw.get("H", 128), kw.get("page", 64)
        assert isinstance(b, k.Sm90Build) and b == k.Sm90Build.for_heads_on_m(H, page), (kw, b)
        assert b.heads_on_m and b.nhg == -(-H // 64) and (b.stages, b.regs) == (2, 208), (kw, b)
    assert case() == k.KNOWN_BUILDS["mh128_p64"] and case(H=64) == k.KNOWN_BUILDS["mh64_p64"]
    # the plans it does not take keep their builds, unchanged
    for kw, want in ((dict(H=32), k.Sm90Build.for_plan(32, 64)), (dict(H=16), k.KNOWN_BUILDS["h16_p64"]),
                     (dict(page=1), k.KNOWN_BUILDS["h128_p1"]), (dict(page=16), k.Sm90Build.for_plan(128, 16)),
                     (dict(qo_lens=(2, 1)), k.Sm90Build.for_plan(128, 64, max_qo=2)),
                     (dict(fmt="fp8_e4m3_group"), k.KNOWN_BUILDS["group_h128"]),
                     (dict(fp8_math=True), k.Sm90Build.for_plan(128, 64, fp8_math=True)),
                     (dict(num_stages=2), k.Sm90Build.for_plan(128, 64, stages=2)),
                     (dict(heads_on_m=False), k.KNOWN_BUILDS["h128_p64"]),
                     (dict(H=64, heads_on_m=False), k.Sm90Build.for_plan(64, 64))):
        assert case(**kw) == want, kw
    # heads_on_m=True: a plan it cannot take is refused, naming why
    for kw, word in ((dict(H=32), "num_heads: the heads-on-M build takes 33..128, got 32"),
                     (dict(page=32), "page_size: the heads-on-M build takes a multiple of 64, got 32"),
                     (dict(page=1), "got 1"), (dict(qo_lens=(2, 1)), "qo_len"), (dict(fmt="fp8_e4m3_group"), "group"),
                     (dict(fp8_math=True), "fp8_math"), (dict(num_stages=4), "num_stages: "),
                     (dict(num_stages=4), "got 4")):
        why = case(heads_on_m=True, **kw)
        assert isinstance(why, str) and why.startswith("heads_on_m=True: ") and word in why, (kw, why)
    # auto takes heads-on-M wherever it takes the plan: CUDA-graph plans and device-only lengths too (its
    # longest-first schedule is made on the device then), whatever the batch
    graph = gluon_build(_spec(128, graph=True), _layout(64, (1,)), {})
    assert graph == k.KNOWN_BUILDS["mh128_p64"], graph
    assert gluon_build(_spec(128, graph=True), _layout(64, (1,)), dict(heads_on_m=False)) == k.KNOWN_BUILDS["h128_p64"]
    for n in (1, 66, 67, 200):   # fewer and more requests than the 66 schedule slots at H128
        assert case(qo_lens=(1,) * n) == k.KNOWN_BUILDS["mh128_p64"], n
    assert case(H=64, qo_lens=(1,) * 133) == k.KNOWN_BUILDS["mh64_p64"]
    spread = [64 * (1 + (i * 37) % 128) for i in range(64)]
    for host in (True, False):
        assert gluon_build(_spec(128), _layout(64, (1,) * 64, spread, host=host), {}) == k.KNOWN_BUILDS["mh128_p64"]
        assert gluon_build(_spec(128), _layout(64, (1,) * 8, [8192] * 8, host=host),
                               dict(heads_on_m=False)) == k.KNOWN_BUILDS["h128_p64"]
    # what the Gluon kernel refuses anyway is refused as before, whatever heads_on_m says
    assert "num_heads" in case(H=129, heads_on_m=True) and "kv_data_type" in case(fmt="bf16", heads_on_m=None)


def test_heads_on_m_option_is_checked():
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match=r"heads_on_m: expected True, False or None"):
            fp8mla.MLAPagedAttention(backend="gluon", heads_on_m=bad)
    for kw in (dict(backend="torch"), dict(backend="triton"), dict(strategy="gather_cast")):
        with pytest.raises(ValueError, match="heads_on_m: the heads-on-M build is a gluon kernel"):
            fp8mla.MLAPagedAttention(heads_on_m=True, **kw)
        fp8mla.MLAPagedAttention(heads_on_m=False, **kw)   # the wide build's choice: nothing to refuse
    if not ON_SM90:   # auto on a machine without Gluon: the plan would run elsewhere, so heads_on_m=True refuses it
        b = make_paged_batch([100], [1], 64, 64, "fp8_e4m3", seed=1)
        attn = fp8mla.MLAPagedAttention(backend="auto", heads_on_m=True)
        with pytest.raises(ValueError, match="heads_on_m: the heads-on-M build runs on the gluon kernel only"):
            attn.plan(**b.plan_args)


@pytest.mark.usefixtures("sm90_compile_tools")
def test_plans_launch_one_cta_per_item_and_head_group(gb, monkeypatch):
    """gluon.build / GluonPlan.run of heads-on-M plans on CPU tensors (the kernel never runs): host lengths give the
    host schedule's real item count, device-only tables (heads-on-M also there by default) the cap slots + B and
    the same items, CUDA graphs slots + max_batch; the
    schedule is the request-aligned one where it fits (H128 B64 L8k: 64 whole requests on 66 slots, no partial)."""
    calls = []
    monkeypatch.setattr(k, "launch_heads_on_m", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(k, "mh_kv_descriptors", lambda ckv, kpe: ("kv", "kpe"))
    spec = _spec(128)
    p = gb.build(_layout(64, [1] * 64, [8192] * 64), spec, {})
    assert p.build == k.KNOWN_BUILDS["mh128_p64"] and p.slots == 66 and p.n_items == 64
    assert p.t["cta_ptr"][66].item() == 64 and p.t["item_t1"][:64].tolist() == [128] * 64
    assert p.t["m_ptr"].tolist() == list(range(65)) and p.t["part_o"].shape[1:] == (128, 512)
    assert gb.build(_layout(64, [1] * 64, [8192] * 64, host=False), spec, dict(heads_on_m=False)).build == k.KNOWN_BUILDS["h128_p64"]
    d = gb.build(_layout(64, [1] * 64, [8192] * 64, host=False), spec, {})
    assert d.build == k.KNOWN_BUILDS["mh128_p64"]
    assert d.n_items == 66 + 64 and d.t["cta_ptr"][66].item() == d.t["m_ptr"][64].item() == 64
    for key in ("item_req", "item_t0", "item_t1"):
        assert torch.equal(d.t[key][:64], p.t[key][:64]), key
    lens = [0, 1, 63, 64, 65, 127, 1000, 4097]
    h = gb.build(_layout(64, [1] * 8, lens), _spec(96), dict(min_chunk=64))
    assert h.n_items == len(h.t["item_req"]) == h.t["m_ptr"][8].item() and h.slots == 66
    assert max(b - a for a, b in zip(h.t["m_ptr"].tolist(), h.t["m_ptr"].tolist()[1:])) > 1   # splits: a merge
    g = gb.build(_layout(64, [1] * 8, lens), _spec(64, graph=True), dict(max_batch_size=16, heads_on_m=True))
    assert g.build == k.KNOWN_BUILDS["mh64_p64"] and g.slots == 132 and g.n_items == 132 + 16
    ckv = torch.zeros(80, 64, 512, dtype=torch.float8_e4m3fn)
    q = torch.zeros(8, 64, 512, dtype=torch.bfloat16)
    g.run(q, q[..., :64], ckv, ckv[..., :64], torch.ones(2), None, q, torch.zeros(8, 64), False)
    (args, kw), = calls
    assert args[0] is g.build and args[1:3] == ("kv", "kpe") and args[6] is g.t
    assert (kw["n_items"], kw["num_heads"]) == (148, 64) and g.n_items <= g.t["item_req"].numel()
    with pytest.raises(ValueError, match="ckv_scale_arr"):   # per-tensor scales only
        g.run(q, q[..., :64], ckv, ckv[..., :64], torch.ones(2), torch.ones(80, 64, 4), q, torch.zeros(8, 64), False)


def test_aligned_slack_is_a_parameter():
    tiles = [128] * 64
    assert split.aligned_pieces(tiles, 66, 4) is None                       # persistent builds: the contiguous cut
    assert split.aligned_pieces(tiles, 66, 4, split.UNBOUNDED_SLACK) == [1] * 64
    assert split.aligned_pieces([128] * 67, 66, 4, split.UNBOUNDED_SLACK) is None   # more requests than CTAs
    L = torch.tensor([8192] * 64, dtype=torch.int32)
    for slack in (split.ALIGNED_SLACK, split.UNBOUNDED_SLACK):
        grid, cta_ptr, items, m_ptr, _ = split.tile_items(L.tolist(), 66, 4, slack=slack)
        d = split.tile_items_device(L, 66, 4, slack=slack)
        n = int(d["m_ptr"][-1])
        assert list(zip(d["item_req"][:n].tolist(), d["item_t0"][:n].tolist(), d["item_t1"][:n].tolist())) == items
        assert (len(items) == 64) == (slack == split.UNBOUNDED_SLACK)


# -- GPU --------------------------------------------------------------------------------------------------------
def run_case(batch, backend="gluon", **opts):
    # (the build under test is asked for by name; test_host_lengths_... and the selection test check auto's pick)
    if backend == "gluon":
        opts.setdefault("heads_on_m", True)
    attn = fp8mla.MLAPagedAttention(backend=backend, **opts)
    attn.plan(**batch.plan_args)
    n, H, Dc = batch.run_args["q_nope"].shape
    out = torch.full((n, H, Dc), float("nan"), dtype=batch.plan_args["q_data_type"], device=DEVICE)
    lse = torch.full((n, H), float("nan"), dtype=torch.float32, device=DEVICE)
    attn.run(**batch.run_args, out=out, lse=lse, return_lse=True)
    return attn, out, lse


def check(batch, out, lse, tol=3e-3, lse_tol=1e-4):
    ref_o, ref_lse = batch.reference()
    assert_close(out, ref_o, tol, "out")
    assert_close(lse, ref_lse, lse_tol, "lse")


def _is_mh(attn) -> bool:
    return attn._plan.backend == "gluon" and attn._plan.impl.build.heads_on_m


@gpu
@pytest.mark.parametrize("H,page", [(64, 64), (96, 64), (128, 64), (128, 128)])
def test_odd_lengths_nan_pools(H, page):
    b = make_paged_batch(LENS, [1] * len(LENS), H, page, "fp8_e4m3", device=DEVICE, seed=H + page, extra_pages=1)
    attn, out, lse = run_case(b)
    assert _is_mh(attn)
    check(b, out, lse)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()   # kv_len 0: 0 and -inf
    if (H, page) != (128, 64):
        return
    # the wide build (heads_on_m=False) on the same batch: its own build, the same answer (one shape: each build
    # is a ~20 s compile)
    wide, o2, l2 = run_case(b, heads_on_m=False)
    assert not wide._plan.impl.build.heads_on_m
    assert_close(o2, out.float(), 3e-3, "wide vs heads-on-M")
    assert_close(l2, lse, 1e-4, "wide vs heads-on-M lse")


@gpu
@pytest.mark.parametrize("H", [64, 128])
def test_one_long_request(H):
    b = make_paged_batch([32768 - 5], [1], H, 64, "fp8_e4m3", device=DEVICE, seed=H)
    attn, out, lse = run_case(b)
    assert _is_mh(attn) and attn._plan.impl.n_items > 1   # split across CTAs, merged
    check(b, out, lse)


@gpu
@pytest.mark.parametrize("min_chunk", [64, 4096])
def test_fp16_scales_forced_splits_and_bit_identical_reruns(min_chunk):
    b = make_paged_batch([20000, 1, 4097, 0, 65], [1] * 5, 128, 64, "fp8_e4m3", q_dtype=torch.float16,
                         device=DEVICE, seed=9, ckv_scale=0.05, kpe_scale=0.02)
    attn, out, lse = run_case(b, min_chunk=min_chunk)
    assert _is_mh(attn)
    check(b, out, lse, lse_tol=2e-4)
    o2, l2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    attn.run(**b.run_args, out=o2, lse=l2, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


@gpu
@pytest.mark.parametrize("H,qmag", [(128, 300.0), (64, 1e-3)])
def test_query_magnitudes_and_an_all_empty_batch(H, qmag):
    """The per-head power of two keeps fp16 Q in range for large and tiny queries; a batch of empty requests is
    all 0 / -inf."""
    b = make_paged_batch([777, 64], [1, 1], H, 64, "fp8_e4m3", device=DEVICE, seed=int(H + qmag), ckv_scale=0.05,
                         kpe_scale=0.02)
    for key in ("q_nope", "q_pe"):
        b.run_args[key] = (b.run_args[key].float() * qmag).to(b.run_args[key].dtype)
    attn, out, lse = run_case(b)
    assert _is_mh(attn)
    # x 300: scores span ~2,400 log2 units, and the per-tensor scale folded into Q before its fp16 rounding (every
    # fp8mla fast kernel's scheme) moves them by up to ~0.7; where a head's top scores nearly tie that is the
    # error: on this batch 3.8e-3 on the H200 (2026-12-02), 3.83e-3 in the float model of the roundings
    # (the lab prototype's numerics_model: lab/many_heads/check_device.py at commit 80896ec), 4.7e-3 from the Triton kernel; 1.6e-3 from the torch
    # backend's fp32 math. The point of this case is range (no overflow, no NaN), so its budget is 1e-2.
    check(b, out, lse, tol=1e-2 if qmag > 1 else 3e-3, lse_tol=2e-4)
    e = make_paged_batch([0, 0, 0], [1, 1, 1], H, 64, "fp8_e4m3", device=DEVICE, seed=3, extra_pages=1)
    _, out, lse = run_case(e)
    assert (out == 0).all() and (lse == float("-inf")).all()


@gpu
def test_host_lengths_schedule_on_the_host():
    b = make_paged_batch(LENS, [1] * len(LENS), 128, 64, "fp8_e4m3", device=DEVICE, seed=21)
    attn = fp8mla.MLAPagedAttention(backend="gluon", min_chunk=64)
    host = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in b.plan_args.items()}
    host["kv_indices"] = b.plan_args["kv_indices"]
    attn.plan(**host)
    assert _is_mh(attn) and attn._plan.impl.n_items == len(attn._plan.impl.t["item_req"])
    out = torch.full_like(b.run_args["q_nope"], float("nan"))
    lse = torch.full(out.shape[:2], float("nan"), device=DEVICE)
    attn.run(**b.run_args, out=out, lse=lse, return_lse=True)
    check(b, out, lse)


@gpu
@pytest.mark.parametrize("H", [64, 128])
def test_cuda_graph_host_lengths_longest_first_capture_then_replan(H):
    """A CUDA-graph plan with host lengths (the longest-first schedule; m_list among the staged graph arrays),
    captured, then re-planned with other spread host lengths of the same batch size and replayed."""
    lens1 = [100, 3000, 17, 5000, 64, 900, 2600, 1]
    b1 = make_paged_batch(lens1, [1] * 8, H, 64, "fp8_e4m3", device=DEVICE, seed=H + 1, spare_pages=80)
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8, heads_on_m=True,
                                    min_chunk=64)

    def host(args):
        return {key: (v.cpu() if key in ("qo_indptr", "kv_indptr", "kv_len_arr") else v) for key, v in args.items()}

    attn.plan(**host(b1.plan_args))
    assert _is_mh(attn)
    t = attn._plan.impl.t
    n = int(t["m_ptr"][8])
    assert t["m_list"][:n].tolist() != list(range(n)), "the spread lengths did not reorder: the case tests nothing"
    q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
    out = torch.empty_like(q_nope)
    lse = torch.empty(8, H, device=DEVICE)
    kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
    assert_close(out, b1.reference()[0], 3e-3, "first replay")
    a = host(b1.plan_args)   # same pool and pages, other lengths within each request's written tokens (the
    # slots past them hold NaN: a length over them would attend to NaN), one of them empty
    a["kv_len_arr"] = torch.tensor([5000, 1, 0, 64, 3000, 17, 900, 1], dtype=torch.int32).clamp(
        max=torch.tensor(lens1, dtype=torch.int32))
    attn.plan(**a)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    from fp8mla.reference import mla_reference
    ref, ref_lse = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"].to(DEVICE),
                                 a["kv_indptr"].to(DEVICE), a["kv_indices"], a["kv_len_arr"].to(DEVICE),
                                 sm_scale=a["sm_scale"], causal=True)
    assert_close(out, ref, 3e-3, "replay after re-plan")
    assert_close(lse, ref_lse, 1e-4, "lse after re-plan")


@gpu
def test_request_without_queries_is_refused_by_gluon_and_right_on_auto():
    b = make_paged_batch([100, 300, 65], [1, 0, 1], 64, 64, "fp8_e4m3", device=DEVICE, seed=4)
    with pytest.raises(ValueError, match="qo_len"):
        run_case(b)
    _, out, lse = run_case(b, backend="auto")   # the Triton kernel takes it
    check(b, out, lse, lse_tol=5e-3)
    with pytest.raises(ValueError, match="heads_on_m"):
        run_case(b, backend="auto", heads_on_m=True)


@gpu
@pytest.mark.parametrize("H", [64, 128])
def test_cuda_graph_capture_then_replan(H):
    # (heads_on_m=True: the build under test by name, whatever auto picks)
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8, heads_on_m=True)
    b1 = make_paged_batch([100, 3000, 17], [1, 1, 1], H, 64, "fp8_e4m3", device=DEVICE, seed=H, spare_pages=60)
    attn.plan(**b1.plan_args)
    assert _is_mh(attn)
    q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
    out = torch.empty_like(q_nope)
    lse = torch.empty(3, H, device=DEVICE)
    kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
    assert_close(out, b1.reference()[0], 3e-3, "first replay")
    a = dict(b1.plan_args)   # same pool, other lengths and page lists (one empty request)
    pages = a["kv_indices"]
    a["kv_len_arr"] = torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEVICE)
    a["kv_indptr"] = torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEVICE)
    a["kv_indices"] = torch.cat([pages[3:49]] + [pages[:1]])
    attn.plan(**a)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    from fp8mla.reference import mla_reference
    ref, ref_lse = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                                 a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
    assert_close(out, ref, 3e-3, "replay after re-plan")
    assert_close(lse, ref_lse, 1e-4, "lse after re-plan")
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()
