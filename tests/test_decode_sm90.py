"""The Gluon sm_90 decode kernel (backend "gluon").

GPU (an sm_90 device with triton.experimental.gluon): odd lengths (0, 1, 63, 65, 97, 514) over NaN-poisoned,
shuffled pools, poisoned outputs, page 64 and 128, padded heads, fp16 queries with scales far from 1, many
splits, bit-identical reruns, CUDA-graph replay after a re-plan, and the plans it must refuse; multi-token decode
(qo_len 2..8) with mixed qo per request, kv_len < qo_len, causal and not.
CPU: the MTP tile emulation and a compile-only check of the kernel for sm_90a with triton's ptxas
(skipped when Gluon does not import; the kernel compiles with triton 3.6, the device's, and 3.9).
"""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.kernels import sm90 as k, split
from fp8mla.backends import PlanState
from conftest import compile_report_in_child
from fp8mla.testing import assert_close, capture_then_replay, make_paged_batch

ON_SM90 = torch.cuda.is_available() and "gluon" in fp8mla.available_backends("cuda")
gpu = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with triton.experimental.gluon")
DEVICE = "cuda" if ON_SM90 else "cpu"


# -- CPU --------------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("page,heads", [(16, 16), (64, 16), (64, 32), (64, 128)])
def test_compiles_for_sm90a_without_spills_or_byte_loads(page, heads):
    r, _ = compile_report_in_child(page=page, ns=3, heads=heads)
    assert not r["serialized_wgmma"], r["ptxas"]
    # A few words, not a loop's worth. triton 3.9 / 3.6 (the H200's): H16 0 / 48 B, H32 0 / 40 B, H128 (32 heads
    # per consumer, O^T in 128 of the 240 registers) 28 / 160 B: 1 / 3 reloads per tile per consumer, the rest
    # once per work item.
    assert sum(st for st, _ in r["spills"]) <= (64 if heads <= 32 else 256), r["spills"]
    hgmma = sum(v for op, v in r["ops"].items() if op.startswith("HGMMA"))
    assert hgmma >= 36 + 32, r["ops"]                                  # QK (36 k-steps) + PV (32) per tile
    assert r["ops"].get("LDS.U8", 0) <= 2, r["ops"]                    # K and V^T come from 16-byte / ldmatrix loads
    assert r["smem"] <= k.SMEM_LIMIT


def test_ring_depth_prefers_even_and_keeps_odd_where_even_does_not_fit():
    """H <= 16: an odd request becomes the even depth above where it fits (4 for the default 3, the configuration
    timed on the H200), else stays odd (the group build's 3: 4 stages and its tiles do not fit), else the even one
    below; the wide variant (both consumers on every phase) takes any depth."""
    assert [k.ring_depth(n) for n in (2, 3, 4, 5)] == [2, 4, 4, 4]
    assert k.ring_depth(3, 16, False, group=True) == 3
    assert k.smem_bytes(4, 16, False, group=True) > k.SMEM_LIMIT >= k.smem_bytes(3, 16, False, group=True)
    assert [k.ring_depth(n, 32, True) for n in (2, 3)] == [2, 3]
    for n in (3, 5):   # an odd request never becomes a depth that does not fit (an even one is kept as asked)
        for group in (False, True):
            assert k.smem_bytes(k.ring_depth(n, group=group), group=group) <= k.SMEM_LIMIT


def _early_waits(ns: int, barrier, tiles: int = 40, trials: int = 200, seed: int = 0) -> int:
    """Random schedules of the alternating-tile ring (H <= 16): the producer issues tile g once tile g - ns was
    released, the tiles land in any order, consumer c takes the tiles g = c, c + 2, ... and waits on
    ``barrier(g, ns)`` = (barrier, parity) by parity (an mbarrier parity wait passes once the barrier's completed
    phase count has the other parity). Returns how many waits passed before their tile had landed."""
    import random
    rnd = random.Random(seed)
    early = 0
    for _ in range(trials):
        phases, landed, issued, released = {}, set(), 0, set()
        inflight, nxt = [], [0, 1]
        while min(nxt) < tiles:
            acts = []
            if issued < tiles and (issued < ns or issued - ns in released):
                acts.append("issue")
            if inflight:
                acts.append("land")
            acts += [c for c in (0, 1) if nxt[c] < tiles]
            a = rnd.choice(acts)
            if a == "issue":
                inflight.append(issued)
                issued += 1
            elif a == "land":
                t = inflight.pop(rnd.randrange(len(inflight)))
                landed.add(t)
                b = barrier(t, ns)[0]
                phases[b] = phases.get(b, 0) + 1
            else:
                g = nxt[a]
                b, parity = barrier(g, ns)
                if (phases.get(b, 0) & 1) == parity:
                    continue            # the wait blocks (it cannot know whether tile g was even issued)
                early += g not in landed
                released.add(g)         # (compute, then release the stage)
                nxt[a] += 2
    return early


@pytest.mark.parametrize("ns", [2, 3, 4, 5])
def test_ready_barriers_never_pass_early(ns):
    """The kernel's ready-barrier protocol (decode_sm90.ready_barrier) on random schedules: no wait passes before
    its tile landed, at any depth; and the test can fail: one barrier per stage passes waits early at an odd depth
    (what the H200 showed at NS 3), never at an even one."""
    assert _early_waits(ns, k.ready_barrier) == 0
    single = _early_waits(ns, lambda g, n: (g % n, (g // n) & 1))
    assert (single > 0) == (ns % 2 == 1), single


def test_head_config():
    assert k.head_config(1) == (16, 1, False) and k.head_config(16) == (16, 1, False)
    assert k.head_config(17) == (16, 1, True) and k.head_config(32) == (16, 1, True)
    assert k.head_config(33) == (32, 1, True) and k.head_config(64) == (32, 1, True)
    assert k.head_config(65) == (32, 2, True) and k.head_config(128) == (32, 2, True)
    assert [k.padded_heads(h) for h in (8, 20, 64, 100, 128)] == [16, 32, 64, 128, 128]
    for bad in (0, 129):
        with pytest.raises(ValueError, match="num_heads"):
            k.head_config(bad)
    assert k.smem_bytes(3, 32, True) <= k.SMEM_LIMIT < k.smem_bytes(4, 32, True)


# -- GPU --------------------------------------------------------------------------------------------------------
def run_case(batch, backend="gluon", **opts):
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


@gpu
@pytest.mark.parametrize("page", [16, 32, 64, 128])
def test_odd_lengths_nan_pools(page):
    b = make_paged_batch([0, 1, 63, 65, 97, 514, page - 1, page + 1, 3000], [1] * 9, 16, page, "fp8_e4m3",
                         device=DEVICE, seed=page, extra_pages=1)
    _, out, lse = run_case(b)
    check(b, out, lse)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()   # kv_len 0: 0 and -inf


@gpu
@pytest.mark.parametrize("H", [1, 8, 16])
def test_padded_heads(H):
    b = make_paged_batch([700, 33, 129], [1] * 3, H, 64, "fp8_e4m3", device=DEVICE, seed=H)
    check(b, *run_case(b)[1:])


@gpu
def test_fp16_queries_scales_far_from_one_and_base_e():
    b = make_paged_batch([777, 65, 2500], [1] * 3, 16, 64, "fp8_e4m3", q_dtype=torch.float16, device=DEVICE,
                         seed=5, ckv_scale=0.03, kpe_scale=7.0, value_scale=3.0)
    attn, out, lse = run_case(b)
    check(b, out, lse, lse_tol=2e-4)
    lse_e = torch.empty_like(lse)
    attn.run(**b.run_args, out=out, lse=lse_e, return_lse=True, return_lse_base_on_e=True)
    assert torch.allclose(lse_e, lse * 0.6931471805599453, rtol=1e-6, atol=1e-6)


@gpu
@pytest.mark.parametrize("min_chunk", [64, 256, 4096])
def test_many_splits_and_bit_identical_reruns(min_chunk):
    b = make_paged_batch([20000, 1, 4097], [1] * 3, 16, 64, "fp8_e4m3", device=DEVICE, seed=7)
    attn, out, lse = run_case(b, min_chunk=min_chunk)
    check(b, out, lse)
    o2, l2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    attn.run(**b.run_args, out=o2, lse=l2, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


@gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_ring_depths(stages):
    b = make_paged_batch([1000, 63, 5000], [1] * 3, 16, 64, "fp8_e4m3", device=DEVICE, seed=stages)
    attn, out, lse = run_case(b, num_stages=stages)
    assert attn._plan.impl.ns == {2: 2, 3: 4, 4: 4}[stages]   # the alternating-tile kernel: 3 -> 4 (fits)
    check(b, out, lse)


@gpu
def test_auto_picks_gluon_and_falls_back():
    b = make_paged_batch([100, 200], [1, 1], 16, 64, "fp8_e4m3", device=DEVICE, seed=1)
    attn, out, lse = run_case(b, backend="auto")
    assert attn.backend_name == "gluon" if hasattr(attn, "backend_name") else True
    check(b, out, lse)
    from fp8mla.backends import gluon as gb
    refused = [([100], [1], 16, 8, "fp8_e4m3"), ([100], [1], 16, 64, "bf16")]
    for kv_lens, qo, H, page, fmt in refused:
        b = make_paged_batch(kv_lens, qo, H, page, fmt, device=DEVICE, seed=2)
        _, out, lse = run_case(b, backend="auto")          # the Triton kernel takes these, correctly
        check(b, out, lse, tol=3e-3, lse_tol=5e-3)
        with pytest.raises(ValueError, match="gluon"):
            run_case(b, backend="gluon")


def _graph_replan_check(attn, H, page, seed, spare_pages, after_first=None):
    """The CUDA-graph contract of a gluon plan (GPU): plan three requests (100, 3000, 17 tokens), capture run() in a
    graph and check its replay, then re-plan into the same buffers with other lengths (2900, 5, 0) and page lists
    (page 64: other pages, page 1: a shuffled subset of the used slots), replay the same graph over a poisoned
    ``out`` and compare with the float64 reference. ``after_first(attn)`` runs between the two."""
    b1 = make_paged_batch([100, 3000, 17], [1, 1, 1], H, page, "fp8_e4m3", device=DEVICE, seed=seed,
                          spare_pages=spare_pages)
    attn.plan(**b1.plan_args)
    q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
    out = torch.empty_like(q_nope)
    lse = torch.empty(3, H, device=DEVICE)
    kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
    assert_close(out, b1.reference()[0], 3e-3, "first replay")
    if after_first is not None:
        after_first(attn)
    a = dict(b1.plan_args)   # same pool, other lengths and page lists
    pages = a["kv_indices"]
    a["kv_len_arr"] = torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEVICE)
    if page == 1:
        a["kv_indptr"] = torch.tensor([0, 2900, 2905, 2906], dtype=torch.int32, device=DEVICE)
        a["kv_indices"] = pages[torch.randperm(pages.numel(), device=DEVICE)[:2906]]
    else:
        a["kv_indptr"] = torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEVICE)
        a["kv_indices"] = torch.cat([pages[3:49]] + [pages[:1]])
    attn.plan(**a)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    from fp8mla.reference import mla_reference
    ref, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                           a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
    assert_close(out, ref, 3e-3, "replay after re-plan")


@gpu
def test_cuda_graph_capture_then_replan():
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
    _graph_replan_check(attn, 16, 64, seed=11, spare_pages=60)


# -- GPU, the wide-heads variant (17..128 heads) -----------------------------------------------------------------
@gpu
@pytest.mark.parametrize("H", [20, 32, 64, 100, 128])
@pytest.mark.parametrize("page", [16, 64])
def test_wide_odd_lengths_nan_pools(H, page):
    b = make_paged_batch([0, 1, 63, 64, 65, 514, page + 1, 3000], [1] * 8, H, page, "fp8_e4m3", device=DEVICE,
                         seed=H + page, extra_pages=1)
    # heads_on_m=False: the wide build itself (auto takes the heads-on-M build at 33..128 heads and pages of 64,
    # tests/test_decode_sm90_heads_on_m.py; the wide one stays for CUDA graphs, pages 1..32, MTP, group scales)
    _, out, lse = run_case(b, heads_on_m=False)
    check(b, out, lse)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()


@gpu
def test_wide_auto_picks_gluon():
    b = make_paged_batch([300, 65], [1, 1], 128, 64, "fp8_e4m3", device=DEVICE, seed=3)
    attn, out, lse = run_case(b, backend="auto")
    assert attn._plan.backend == "gluon"
    check(b, out, lse)


@gpu
@pytest.mark.parametrize("min_chunk", [64, 4096])
def test_wide_many_splits_and_bit_identical_reruns(min_chunk):
    b = make_paged_batch([20000, 1, 4097], [1] * 3, 128, 64, "fp8_e4m3", q_dtype=torch.float16, device=DEVICE,
                         seed=8, ckv_scale=0.05, kpe_scale=3.0)
    attn, out, lse = run_case(b, min_chunk=min_chunk, heads_on_m=False)   # the wide build (see above)
    check(b, out, lse, lse_tol=2e-4)
    o2, l2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    attn.run(**b.run_args, out=o2, lse=l2, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


@gpu
def test_wide_refuses_four_stages():
    b = make_paged_batch([100], [1], 128, 64, "fp8_e4m3", device=DEVICE, seed=4)
    with pytest.raises(ValueError, match="num_stages"):
        run_case(b, num_stages=4)


@gpu
def test_wide_cuda_graph_capture_then_replan():
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
    _graph_replan_check(attn, 128, 64, seed=12, spare_pages=60)


def test_graph_build_host_and_device_schedules_fill_the_same_buffers(monkeypatch):
    """gluon.build in CUDA-graph mode (on CPU tensors, the kernel never launched): a layout with host lengths
    (host schedule, one staged copy) and the same layout as device-only tables (device schedule) leave the same
    values in every array the kernel reads, across re-plans of different batches into the same buffers."""
    from fp8mla.backends import AttentionSpec, gluon as gb
    from fp8mla.formats import get_format
    from fp8mla.layout import PagedLayout
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)
    spec = AttentionSpec(128, 512, 64, 64, True, 192 ** -0.5, torch.bfloat16, get_format("fp8_e4m3"),
                         torch.device("cpu"), True)
    g = torch.Generator().manual_seed(3)
    opts = dict(max_batch_size=16, max_kv_indices=4096)
    st_host, st_dev = PlanState(), PlanState()
    for lens in ([97, 1, 514, 0, 4096], [8192] * 16, [1], [300, 17, 64, 65, 63]):
        B = len(lens)
        W = max(1, -(-max(lens) // 64))
        bt = torch.randint(0, 500, (B, W), generator=g, dtype=torch.int32)
        kv_len = torch.tensor(lens, dtype=torch.int32)
        host_lay = PagedLayout.from_block_table(bt, kv_len, 64)
        assert host_lay.host is not None
        dev_lay = PagedLayout(host_lay.qo_indptr, host_lay.kv_indptr, host_lay.kv_indices, host_lay.kv_len, 64,
                              torch.device("cpu"), host_lay.qo_lens)
        ph = gb.build(host_lay, spec, opts, st_host)
        pd = gb.build(dev_lay, spec, opts, st_dev)
        assert (ph.grid, ph.grid_batch) == (pd.grid, pd.grid_batch)
        n = int(pd.t["m_ptr"][B])
        for key, m in (("qo_indptr", B + 1), ("kv_indptr", B + 1), ("kv_len", B), ("kv_indices", bt.numel()),
                       ("cta_ptr", pd.grid // 2 + 1), ("item_req", n), ("item_t0", n), ("item_t1", n),
                       ("m_ptr", B + 1), ("m_list", n), ("batch_size", 1)):
            assert torch.equal(ph.t[key][:m], pd.t[key][:m]), (lens, key)


@pytest.mark.usefixtures("sm90_compile_tools")
def test_select_takes_every_built_variant_and_refuses_the_rest_by_name(monkeypatch):
    """No switch decides it: page 1, 16, 32 and multiples of 64, 1..128 heads, qo_len 1..8 with max qo_len x H <=
    512, per-tensor and group scales get a build (the measured ones among KNOWN_BUILDS); every other plan is
    refused with a reason that names what."""
    from conftest import gluon_build
    from fp8mla.backends import AttentionSpec
    from fp8mla.formats import get_format
    from fp8mla.layout import PagedLayout
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)

    def case(H=16, page=64, qo_lens=(1,), fmt="fp8_e4m3", dims=(512, 64), q=torch.bfloat16):
        spec = AttentionSpec(H, dims[0], dims[1], page, True, 192 ** -0.5, q, get_format(fmt), torch.device("cpu"))
        B = len(qo_lens)
        qo = torch.tensor([0] + [sum(qo_lens[: b + 1]) for b in range(B)], dtype=torch.int32)
        n = 130 // page + 1
        lay = PagedLayout.from_csr(qo, torch.arange(B + 1, dtype=torch.int32) * n,
                                   torch.arange(n * B, dtype=torch.int32), torch.full((B,), 130, dtype=torch.int32),
                                   page)
        b = gluon_build(spec, lay, {})
        return (False, b) if isinstance(b, str) else (True, b)

    for kw in (dict(), dict(page=1), dict(page=16), dict(page=32), dict(page=128), dict(H=1), dict(H=40),
               dict(H=128), dict(qo_lens=(2, 1, 3)), dict(qo_lens=(8,)), dict(H=128, qo_lens=(4, 2)),
               dict(H=100, qo_lens=(5, 1)), dict(fmt="fp8_e4m3_group"), dict(fmt="fp8_e4m3_group", H=128, page=1),
               dict(q=torch.float16)):
        ok, b = case(**kw)
        assert ok and isinstance(b, k.Sm90Build) and b.smem() <= k.SMEM_LIMIT, (kw, b)
    assert case()[1] == k.KNOWN_BUILDS["h16_p64"] and case(H=128, page=1)[1] == k.KNOWN_BUILDS["h128_p1"]
    assert case(fmt="fp8_e4m3_group", H=128)[1] == k.KNOWN_BUILDS["group_h128"]
    assert case(qo_lens=(2, 1))[1] == k.KNOWN_BUILDS["mtp_h16_qo2"]
    for kw, word in ((dict(H=129), "num_heads"), (dict(page=8), "page_size"), (dict(page=48), "page_size"),
                     (dict(fmt="bf16"), "kv_data_type"), (dict(dims=(256, 64)), "head_dim"),
                     (dict(q=torch.float32), "q_data_type"), (dict(qo_lens=(9,)), "qo_len"),
                     (dict(H=128, qo_lens=(5, 1)), "qo_len"), (dict(qo_lens=(2, 0)), "qo_len")):
        ok, why = case(**kw)
        assert not ok and word in why, (kw, why)


# -- page size 1 (SGLang's default): rows copied with cp.async ----------------------------------------------------
@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("heads", [16, 128])
def test_page1_compiles_to_16_byte_cp_async(heads):
    # 18 x 16-byte cp.async per thread and tile (4 boxes x 4 + k_pe 2), one cp.async mbarrier arrival (.noinc),
    # no wgmma serialization; the page-1 producer's spills stay small (24 registers: its item-loop state spills,
    # a few reloads per tile). Spill stores, triton 3.9 / 3.6: H16 28 / 104 B, H128 80 / 216 B (page 64: 0 / 48,
    # 28 / 160; the consumers' spills are the page-64 ones). Compiled in a child process, as above.
    import re
    r, text = compile_report_in_child(page=1, ns=3, heads=heads)
    assert not r["serialized_wgmma"], r["ptxas"]
    copies = re.findall(r"LDGSTS\.E\.BYPASS\.128 ", text)
    assert len(copies) == 18, len(copies)
    assert len(re.findall(r"ARRIVES\.LDGSTSBAR", text)) == 1
    assert sum(st for st, _ in r["spills"]) <= (128 if heads <= 32 else 256), r["spills"]
    assert r["smem"] <= k.SMEM_LIMIT


@gpu
@pytest.mark.parametrize("H", [16, 128])
def test_page1_odd_lengths_nan_slots(H):
    # extra_pages=1: a NaN slot listed after each request's last token; spare slots are NaN too
    b = make_paged_batch([0, 1, 63, 64, 65, 1000, 3001], [1] * 7, H, 1, "fp8_e4m3", device=DEVICE, seed=H + 1,
                         extra_pages=1)
    attn, out, lse = run_case(b)
    assert attn._plan.backend == "gluon"
    check(b, out, lse)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()


@gpu
@pytest.mark.parametrize("H", [16, 128])
def test_page1_splits_bit_identical(H):
    b = make_paged_batch([9000, 1, 4097], [1] * 3, H, 1, "fp8_e4m3", q_dtype=torch.float16, device=DEVICE,
                         seed=H + 2, ckv_scale=0.05, kpe_scale=3.0)
    attn, out, lse = run_case(b, min_chunk=64)
    check(b, out, lse, lse_tol=2e-4)
    o2, l2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    attn.run(**b.run_args, out=o2, lse=l2, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


@gpu
def test_page1_equals_page64_on_the_same_tokens():
    # the same token values laid out as page-64 pages and as shuffled single slots: both kernels agree to rounding
    b = make_paged_batch([700, 65, 3000], [1] * 3, 16, 64, "fp8_e4m3", device=DEVICE, seed=21)
    _, o64, l64 = run_case(b)
    a = dict(b.plan_args)
    P = b.pool.shape[0]
    slots = torch.randperm(P * 64, device=DEVICE)           # pool row r -> slot slots[r]
    pool1 = torch.empty((P * 64, 1, b.pool.shape[-1]), dtype=b.pool.dtype, device=DEVICE)
    pool1.view(torch.uint8).fill_(0x7F)                     # e4m3fn NaN (scatters go through byte views)
    pool1.view(torch.uint8)[slots, 0] = b.pool.view(torch.uint8).reshape(P * 64, -1)
    rows = []
    for i, L in enumerate(a["kv_len_arr"].tolist()):
        pages = a["kv_indices"][a["kv_indptr"][i]:a["kv_indptr"][i + 1]].long()
        rows.append(slots[(pages[:, None] * 64 + torch.arange(64, device=DEVICE)).reshape(-1)[:L]])
    a["kv_indices"] = torch.cat(rows).to(torch.int32)
    a["kv_indptr"] = torch.tensor([0] + torch.tensor([len(r) for r in rows]).cumsum(0).tolist(),
                                  dtype=torch.int32, device=DEVICE)
    a["page_size"] = 1
    attn = fp8mla.MLAPagedAttention(backend="gluon")
    attn.plan(**a)
    o1 = torch.full_like(o64, float("nan"))
    l1 = torch.full_like(l64, float("nan"))
    r = dict(b.run_args, ckv_cache=pool1[..., :512], kpe_cache=pool1[..., 512:])
    attn.run(**r, out=o1, lse=l1, return_lse=True)
    assert_close(o1, o64, 1e-3, "page 1 vs page 64")
    assert torch.allclose(l1, l64, atol=1e-4, rtol=0)


@gpu
@pytest.mark.parametrize("H", [16, 128])
def test_page1_cuda_graph_capture_then_replan(H):
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
    _graph_replan_check(attn, H, 1, seed=13 + H, spare_pages=64)


# -- multi-token decode (MTP / speculative, qo_len 2..8): rows = (query token, head) pairs on the wide variant -----
def test_mtp_config_and_row_mapping():
    assert k.mtp_config(16, 2) == (16, 1, True) and k.mtp_config(8, 4) == (16, 1, True)
    assert k.mtp_config(16, 4) == (32, 1, True) and k.mtp_config(16, 8) == (32, 2, True)
    assert k.mtp_config(128, 2) == (32, 4, True) and k.mtp_config(128, 4) == (32, 8, True)
    assert k.mtp_config(1, 2) == (16, 1, True) and k.mtp_config(20, 3) == (32, 1, True)   # 60 rows
    assert k.row_config(128, 1) == k.head_config(128) and k.row_config(16, 1) == (16, 1, False)
    assert [k.padded_heads(16, q) for q in (1, 2, 3, 4, 8)] == [16, 32, 64, 64, 128]
    assert k.padded_heads(128, 4) == 512 and k.padded_heads(100, 5) == 512
    for H, q in ((16, 9), (128, 5), (16, 1), (0, 2), (65, 8)):
        with pytest.raises(ValueError, match="max_qo"):
            k.mtp_config(H, q)
    # row r of a request: token r // H, head r % H; every (token, head) of qo_len x H exactly once, in the first
    # qo_len * H rows (the rest of the max_qo * H rows is padding); the merge kernel uses the same mapping
    for H, qo in ((16, 3), (128, 2), (5, 7)):
        pairs = [k.mtp_row(r, H) for r in range(qo * H)]
        assert sorted(pairs) == [(i, h) for i in range(qo) for h in range(H)]
    # causal: token i of qo_len q sees positions <= L - q + i (none when negative); the last token sees all L
    assert [k.mtp_visible(10, 3, i, True) for i in range(3)] == [8, 9, 10]
    assert [k.mtp_visible(1, 3, i, True) for i in range(3)] == [0, 0, 1]
    assert [k.mtp_visible(0, 2, i, True) for i in range(2)] == [0, 0]
    assert [k.mtp_visible(10, 3, i, False) for i in range(3)] == [10, 10, 10]
    # every variant fits shared memory at the default 3 stages
    for H, q in ((16, 2), (16, 8), (128, 4)):
        hpw, _, wide = k.mtp_config(H, q)
        assert k.smem_bytes(3, hpw, wide) <= k.SMEM_LIMIT


def _emulate_mtp(s, v, qo, L, items, causal):
    """float64 emulation of the kernel's per-item online softmax for one request's rows: scores s [rows, L], values
    v [L, C]; per item the tile loop with the row limit (``lim``: causal ``min(L - qo + i + 1, L)``), the
    "max -inf -> subtract 0" rule, the zeroed empty rows, then the log-sum-exp merge of the items' partials."""
    rows, H = s.shape[0], s.shape[0] // qo
    lim = torch.tensor([min(L - qo + r // H + 1, L) if causal else L for r in range(rows)], dtype=torch.float64)
    parts = []
    for t0, t1 in items:
        m = torch.full((rows,), -math.inf, dtype=torch.float64)
        l = torch.zeros(rows, dtype=torch.float64)
        o = torch.zeros(rows, v.shape[1], dtype=torch.float64)
        for t in range(t0, t1):
            pos = t * 64 + torch.arange(64)
            st = torch.full((rows, 64), -math.inf, dtype=torch.float64)
            ok = pos < L
            st[:, ok] = s[:, pos[ok]]
            st = torch.where(pos[None, :].double() < lim[:, None], st, -math.inf)
            m_new = torch.maximum(m, st.max(1).values)
            m_sub = torch.where(m_new == -math.inf, 0.0, m_new)
            alpha = torch.exp2(m - m_sub)
            p = torch.exp2(st - m_sub[:, None])
            vt = torch.zeros(64, v.shape[1], dtype=torch.float64)
            vt[ok] = v[pos[ok]]
            o = o * alpha[:, None] + p @ vt
            l = l * alpha + p.sum(1)
            m = m_new
        seen = l > 0
        o = torch.where(seen[:, None], o / torch.where(seen, l, 1.0)[:, None], 0.0)
        lse = torch.where(seen, torch.where(m == -math.inf, 0.0, m) + torch.log2(torch.where(seen, l, 1.0)), -math.inf)
        parts.append((o, lse))
    lse_all = torch.stack([p[1] for p in parts])
    mx = lse_all.max(0).values
    mx = torch.where(mx == -math.inf, 0.0, mx)
    w = torch.exp2(lse_all - mx)
    ws = w.sum(0)
    o = sum(w[i][:, None] * parts[i][0] for i in range(len(parts)))
    return torch.where(ws[:, None] > 0, o / torch.where(ws > 0, ws, 1.0)[:, None], 0.0), \
        torch.where(ws > 0, mx + torch.log2(torch.where(ws > 0, ws, 1.0)), -math.inf)


@pytest.mark.parametrize("causal", [True, False])
def test_mtp_tile_masking_and_splits_match_float64(causal):
    """The kernel's MTP rules on the host in float64 (the tile-level row limits, the empty-row and split handling,
    the merge) against plain masked softmax, over the schedule's real item cuts: kv_len < qo_len, a row limit on
    a tile boundary, items that start past a row's last visible token (max -inf for the whole item)."""
    g = torch.Generator().manual_seed(7 + causal)
    H, C = 3, 4
    for L, qo, ctas in ((1, 3, 1), (2, 4, 1), (64, 2, 1), (65, 2, 2), (129, 8, 3), (640, 5, 10), (200, 4, 4)):
        _, _, items, _, _ = split.tile_items([L], ctas, 1)
        cuts = [(t0, t1) for _, t0, t1 in items]
        s = torch.randn(qo * H, L, generator=g, dtype=torch.float64) * 3
        v = torch.randn(L, C, generator=g, dtype=torch.float64)
        o, lse = _emulate_mtp(s, v, qo, L, cuts, causal)
        for r in range(qo * H):
            i, _ = k.mtp_row(r, H)
            n = k.mtp_visible(L, qo, i, causal)
            if n == 0:
                assert (o[r] == 0).all() and lse[r] == -math.inf, (L, qo, r)
                continue
            p = torch.softmax(s[r, :n] * math.log(2), 0)
            torch.testing.assert_close(o[r], p @ v[:n], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse[r], torch.logsumexp(s[r, :n] * math.log(2), 0) / math.log(2),
                                       rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("heads,qo,causal", [(16, 4, True), (128, 2, False)])
def test_mtp_compiles_for_sm90a(heads, qo, causal):
    r, _ = compile_report_in_child(page=64, ns=3, heads=heads, max_qo=qo, causal=causal)
    assert not r["serialized_wgmma"], r["ptxas"]
    assert sum(st for st, _ in r["spills"]) <= 256, r["spills"]     # the wide variant's own budget (see above)
    assert sum(v for op, v in r["ops"].items() if op.startswith("HGMMA")) >= 36 + 32, r["ops"]
    assert r["ops"].get("LDS.U8", 0) <= 2, r["ops"]
    assert r["smem"] <= k.SMEM_LIMIT


@gpu
@pytest.mark.parametrize("H,qo_lens", [(16, [2, 3, 1, 4, 2, 8, 5, 2, 7]), (128, [2, 3, 1, 4, 2, 3, 4, 2, 1]),
                                        (1, [8, 2, 1, 3, 4, 5, 6, 7, 8]), (20, [3] * 9)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page", [1, 64])
def test_mtp_odd_lengths_nan_pools(monkeypatch, H, qo_lens, causal, page):
    """Mixed qo_len per request, kv_len 0 and kv_len < qo_len (causally empty rows: 0 and -inf), odd lengths over
    NaN-poisoned shuffled pools (NaN pages listed past kv_len too), page 1 (cp.async) and 64 (TMA)."""
    lens = [0, 1, 2, 63, 64, 65, 129, 514, 3001]
    b = make_paged_batch(lens, qo_lens, H, page, "fp8_e4m3", device=DEVICE, seed=H + page + causal,
                         causal=causal, extra_pages=1)
    attn, out, lse = run_case(b)
    assert attn._plan.backend == "gluon"
    check(b, out, lse)
    assert (out[: qo_lens[0]] == 0).all() and (lse[: qo_lens[0]] == float("-inf")).all()


@gpu
@pytest.mark.parametrize("H,qo", [(16, 4), (128, 2)])
@pytest.mark.parametrize("min_chunk", [64, 4096])
def test_mtp_many_splits_and_bit_identical_reruns(H, qo, min_chunk):
    b = make_paged_batch([20000, 1, 4097, 3], [qo, 1, qo, qo], H, 64, "fp8_e4m3", q_dtype=torch.float16,
                         device=DEVICE, seed=9, ckv_scale=0.05, kpe_scale=3.0)
    attn, out, lse = run_case(b, min_chunk=min_chunk)
    check(b, out, lse, lse_tol=2e-4)
    o2, l2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    attn.run(**b.run_args, out=o2, lse=l2, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


@gpu
def test_mtp_auto_picks_gluon_and_refuses_beyond_512_rows():
    b = make_paged_batch([300, 65], [2, 4], 16, 64, "fp8_e4m3", device=DEVICE, seed=5)
    attn, out, lse = run_case(b, backend="auto")
    assert attn._plan.backend == "gluon"
    check(b, out, lse)
    b = make_paged_batch([300, 65], [5, 1], 128, 64, "fp8_e4m3", device=DEVICE, seed=6)
    attn, out, lse = run_case(b, backend="auto")                   # 640 rows: the Triton kernel
    assert attn._plan.backend != "gluon"
    check(b, out, lse, lse_tol=5e-3)
    with pytest.raises(ValueError, match="gluon"):
        run_case(b, backend="gluon")


@gpu
@pytest.mark.parametrize("H", [16, 128])
def test_mtp_cuda_graph_capture_then_replan(H):
    """Captured with max qo_len 2 (H128) / 4 (H16); replayed after a re-plan with other lengths, pages and shorter
    queries (the kernel reads each request's qo_len on the device); a longer max qo_len is refused by name."""
    qo = 2 if H == 128 else 4
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
    b1 = make_paged_batch([100, 3000, 17], [qo, 1, qo], H, 64, "fp8_e4m3", device=DEVICE, seed=13, spare_pages=60)
    attn.plan(**b1.plan_args)
    q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
    n = q_nope.shape[0]
    out = torch.empty_like(q_nope)
    lse = torch.empty(n, H, device=DEVICE)
    kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
    assert_close(out, b1.reference()[0], 3e-3, "first replay")
    a = dict(b1.plan_args)   # same pool and query rows, other lengths, page lists and qo split
    pages = a["kv_indices"]
    a["qo_indptr"] = torch.tensor([0, 1, 1 + qo, n], dtype=torch.int32, device=DEVICE)
    a["kv_len_arr"] = torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEVICE)
    a["kv_indptr"] = torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEVICE)
    a["kv_indices"] = torch.cat([pages[3:49]] + [pages[:1]])
    attn.plan(**a)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    from fp8mla.reference import mla_reference
    ref, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                           a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
    assert_close(out, ref, 3e-3, "replay after re-plan")
    a["qo_indptr"] = torch.tensor([0, 1, 2, n], dtype=torch.int32, device=DEVICE)   # n - 2 > qo: longer
    with pytest.raises(ValueError, match="qo_len"):
        attn.plan(**a)


def test_mtp_graph_wrapper_keeps_its_first_variant():
    """With CUDA graphs the launch grid and the kernel variant are captured: the first plan's max qo_len fixes them,
    a later plan with shorter queries keeps that variant (the kernel reads each qo_len on the device), a longer one
    raises by name; without graphs every plan takes its own max qo_len."""
    from types import SimpleNamespace
    from fp8mla.backends import gluon as gb
    lay = lambda *q: SimpleNamespace(max_qo_len=max(q))   # noqa: E731
    graph, plain = SimpleNamespace(use_cuda_graph=True), SimpleNamespace(use_cuda_graph=False)
    state = PlanState()
    assert gb.plan_max_qo(lay(4, 1), graph, state) == 4
    assert gb.plan_max_qo(lay(2, 1), graph, state) == 4 and gb.plan_max_qo(lay(1), graph, state) == 4
    with pytest.raises(ValueError, match="qo_len 5"):
        gb.plan_max_qo(lay(5), graph, state)
    state = PlanState()
    assert gb.plan_max_qo(lay(1), graph, state) == 1
    with pytest.raises(ValueError, match="qo_len 2"):
        gb.plan_max_qo(lay(2), graph, state)
    assert [gb.plan_max_qo(lay(q), plain, PlanState()) for q in (1, 3, 8)] == [1, 3, 8]
