"""Which build each plan runs on: a table of plans -> the chosen build, for the dense and the sparse API, on the
device kinds that change the answer (an sm_90 GPU with Gluon, another CUDA GPU, the CPU). CPU only: the device is
described to the selector, nothing is launched. A row changes only where a choice is meant to change."""
from __future__ import annotations

import pytest
import torch

import fp8mla
import fp8mla.runtime as rt
from fp8mla.formats import get_format
from fp8mla.layout import PagedLayout

pytest.importorskip("triton")
k = pytest.importorskip("fp8mla.kernels.sm90")


def _describe(name, build) -> str:
    """A build in words: the backend, and for the Gluon builds the named variant's fields that differ."""
    if name != "gluon":
        return name
    if build.heads_on_m:
        return f"gluon heads_on_m nhg{build.nhg} p{build.page_size}"
    extra = "".join((f" mtp{build.mtp}" if build.mtp else "", " group" if build.group else "",
                     " fp8_math" if build.fp8_math else ""))
    return f"gluon wide hpw{build.hpw} nhg{build.nhg} p{build.page_size} st{build.stages}{extra}"


def _layout(page, qo_lens, host=True):
    B = len(qo_lens)
    qo = torch.tensor([0] + [sum(qo_lens[: b + 1]) for b in range(B)], dtype=torch.int32)
    n = 130 // page + 1
    lay = PagedLayout.from_csr(qo, torch.arange(B + 1, dtype=torch.int32) * n, torch.arange(n * B, dtype=torch.int32),
                               torch.full((B,), 130, dtype=torch.int32), page)
    if not host:
        lay = PagedLayout(lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_len, page, torch.device("cpu"), None)
    return lay


@pytest.fixture
def device_kind(monkeypatch):
    """Describe the plan's device to the selector: "sm90" (Hopper with Gluon), "cuda" (another GPU), "cpu"."""
    def use(kind):
        monkeypatch.setattr(rt, "gluon_usable", lambda device: kind == "sm90")
        monkeypatch.setattr(rt, "triton_usable", lambda device: True)
        return torch.device("cpu" if kind == "cpu" else "cuda")
    return use


def _dense_choice(device, requested, H, page, fmt, q, dims, qo_lens, host, graph, opts):
    """(backend, build) that MLAPagedAttention's plan picks (its backends.build replaced by a recorder)."""
    from fp8mla.backends import AttentionSpec
    attn = fp8mla.MLAPagedAttention(backend=requested, use_cuda_graph=graph, **opts)
    spec = AttentionSpec(H, dims[0], dims[1], page, True, 0.1, q, get_format(fmt), device, graph)
    choice = attn._select(_layout(page, qo_lens, host), spec)
    return choice.backend, choice.build


DENSE = [
    # (device, requested, dict(plan), expected)
    ("sm90", "auto", dict(), "gluon wide hpw16 nhg1 p64 st4"),
    ("sm90", "auto", dict(H=128), "gluon heads_on_m nhg2 p64"),
    ("sm90", "auto", dict(H=33), "gluon heads_on_m nhg1 p64"),
    ("sm90", "auto", dict(H=64, page=128), "gluon heads_on_m nhg1 p128"),
    ("sm90", "auto", dict(H=128, heads_on_m=False), "gluon wide hpw32 nhg2 p64 st3"),
    ("sm90", "auto", dict(H=128, page=1), "gluon wide hpw32 nhg2 p1 st3"),
    ("sm90", "auto", dict(H=64, page=16), "gluon wide hpw32 nhg1 p16 st3"),
    ("sm90", "auto", dict(H=32), "gluon wide hpw16 nhg1 p64 st3"),
    ("sm90", "auto", dict(H=1, page=32), "gluon wide hpw16 nhg1 p32 st4"),
    ("sm90", "auto", dict(q=torch.float16), "gluon wide hpw16 nhg1 p64 st4"),
    ("sm90", "auto", dict(fmt="fp8_e4m3_group", H=128), "gluon wide hpw16 nhg4 p64 st3 group"),
    ("sm90", "auto", dict(fmt="fp8_e4m3_group"), "gluon wide hpw16 nhg1 p64 st3 group"),
    ("sm90", "auto", dict(qo_lens=(2, 1)), "gluon wide hpw16 nhg1 p64 st3 mtp1"),
    ("sm90", "auto", dict(H=128, qo_lens=(2, 1)), "gluon wide hpw32 nhg4 p64 st3 mtp1"),
    ("sm90", "auto", dict(qo_lens=(8,)), "gluon wide hpw32 nhg2 p64 st3 mtp1"),
    ("sm90", "auto", dict(fp8_math=True), "gluon wide hpw16 nhg1 p64 st3 fp8_math"),
    ("sm90", "auto", dict(H=128, fp8_math=True), "gluon wide hpw32 nhg2 p64 st3 fp8_math"),
    ("sm90", "auto", dict(H=128, num_stages=2), "gluon wide hpw32 nhg2 p64 st2"),
    ("sm90", "auto", dict(H=128, num_stages=3), "gluon heads_on_m nhg2 p64"),
    ("sm90", "auto", dict(num_stages=4, fmt="fp8_e4m3_group"), "gluon wide hpw16 nhg1 p64 st3 group"),
    ("sm90", "auto", dict(H=128, graph=True), "gluon heads_on_m nhg2 p64"),
    ("sm90", "auto", dict(H=128, host=False), "triton"),
    ("sm90", "auto", dict(H=129), "triton"),
    ("sm90", "auto", dict(page=8), "triton"),
    ("sm90", "auto", dict(page=48), "triton"),
    ("sm90", "auto", dict(fmt="bf16"), "triton"),
    ("sm90", "auto", dict(fmt="fp8_e5m2"), "triton"),
    ("sm90", "auto", dict(dims=(256, 64)), "triton"),
    ("sm90", "auto", dict(dims=(96, 32)), "torch"),
    ("sm90", "auto", dict(dims=(512, 0)), "torch"),
    ("sm90", "auto", dict(qo_lens=(9,)), "triton"),
    ("sm90", "auto", dict(H=128, qo_lens=(5, 1)), "triton"),
    ("sm90", "auto", dict(qo_lens=(2, 0)), "triton"),
    ("sm90", "auto", dict(batch_invariant=True), "triton"),
    ("sm90", "auto", dict(H=128, batch_invariant=True), "triton"),
    ("sm90", "triton", dict(H=128), "triton"),
    ("sm90", "torch", dict(H=128), "torch"),
    ("sm90", "gluon", dict(H=128), "gluon heads_on_m nhg2 p64"),
    ("sm90", "gluon", dict(H=128, heads_on_m=True), "gluon heads_on_m nhg2 p64"),
    ("sm90", "gluon", dict(H=16), "gluon wide hpw16 nhg1 p64 st4"),
    ("cuda", "auto", dict(H=128), "triton"),
    ("cuda", "auto", dict(), "triton"),
    ("cuda", "auto", dict(dims=(96, 32)), "torch"),
    ("cuda", "triton", dict(), "triton"),
    ("cpu", "auto", dict(H=128), "torch"),
    ("cpu", "auto", dict(fmt="bf16"), "torch"),
    ("cpu", "triton", dict(), "triton"),
]

DENSE_REFUSED = [
    ("sm90", "gluon", dict(H=129), ValueError, "backend: 'gluon' does not support this plan: .*num_heads"),
    ("sm90", "gluon", dict(fmt="bf16"), ValueError, "backend: 'gluon' does not support this plan: .*bf16"),
    ("cuda", "gluon", dict(), RuntimeError, "backend: 'gluon' cannot run on cuda"),
    ("cpu", "gluon", dict(), RuntimeError, "backend: 'gluon' cannot run on cpu"),
    ("sm90", "auto", dict(H=32, heads_on_m=True), ValueError, "heads_on_m: .*num_heads.*got 32"),
    ("sm90", "auto", dict(fmt="fp8_e4m3_group", fp8_math=True), ValueError, "fp8_math: .*group"),
    ("cuda", "auto", dict(fp8_math=True), ValueError, "fp8_math: .*gluon kernel only.*'triton'"),
    ("cpu", "auto", dict(H=128, heads_on_m=True), ValueError, "heads_on_m: .*gluon kernel only.*'torch'"),
]


def _dense_args(kw):
    kw = dict(kw)
    plan = dict(H=kw.pop("H", 16), page=kw.pop("page", 64), fmt=kw.pop("fmt", "fp8_e4m3"),
                q=kw.pop("q", torch.bfloat16), dims=kw.pop("dims", (512, 64)), qo_lens=kw.pop("qo_lens", (1,)),
                host=kw.pop("host", True), graph=kw.pop("graph", False))
    return plan, kw


@pytest.mark.parametrize("kind, requested, kw, want", DENSE)
def test_dense_choice(device_kind, kind, requested, kw, want):
    plan, opts = _dense_args(kw)
    name, build = _dense_choice(device_kind(kind), requested, **plan, opts=opts)
    assert _describe(name, build) == want


@pytest.mark.parametrize("kind, requested, kw, error, match", DENSE_REFUSED)
def test_dense_refusal(device_kind, kind, requested, kw, error, match):
    plan, opts = _dense_args(kw)
    with pytest.raises(error, match=match):
        _dense_choice(device_kind(kind), requested, **plan, opts=opts)


def _sparse_choice(device, requested, H=16, topk=2048, fmt="fp8_ds_mla", q=torch.bfloat16, invariant=False):
    """The backend MLASparseAttention's plan picks."""
    attn = fp8mla.MLASparseAttention(backend=requested, batch_invariant=invariant)
    return attn._select(H, topk, get_format(fmt, sparse_ok=True), q, device).backend


SPARSE = [
    ("sm90", "auto", dict(), "gluon"),
    ("sm90", "auto", dict(H=128), "gluon"),
    ("sm90", "auto", dict(H=8, topk=37), "gluon"),
    ("sm90", "auto", dict(H=129), "triton"),
    ("sm90", "auto", dict(q=torch.float16), "triton"),
    ("sm90", "auto", dict(fmt="fp8_e4m3"), "triton"),
    ("sm90", "auto", dict(fmt="bf16"), "triton"),
    ("sm90", "auto", dict(invariant=True), "triton"),
    ("sm90", "triton", dict(), "triton"),
    ("sm90", "torch", dict(topk=37), "torch"),
    ("sm90", "gluon", dict(topk=37), "gluon"),
    ("cuda", "auto", dict(), "triton"),
    ("cuda", "auto", dict(H=128, fmt="fp8_e4m3_group"), "triton"),
    ("cpu", "auto", dict(), "torch"),
    ("cpu", "auto", dict(topk=37), "torch"),
    ("cpu", "triton", dict(), "triton"),
]

SPARSE_REFUSED = [
    ("sm90", "auto", dict(fmt="fp8_e4m3", topk=37), "topk: the triton sparse kernel needs a multiple of 64"),
    ("cuda", "auto", dict(topk=100), "topk: the triton sparse kernel needs a multiple of 64"),
    ("cpu", "triton", dict(topk=37), "topk: the triton sparse kernel needs a multiple of 64"),
    ("sm90", "gluon", dict(fmt="fp8_e4m3"), "kv_data_type: the gluon sparse build reads fp8_ds_mla"),
    ("sm90", "gluon", dict(q=torch.float16), "q_data_type: the gluon sparse build takes bfloat16"),
    ("sm90", "gluon", dict(H=129), "num_heads: the gluon sparse build takes 1..128"),
    ("cuda", "gluon", dict(), "backend: 'gluon' cannot run on cuda"),
]


@pytest.mark.parametrize("kind, requested, kw, want", SPARSE)
def test_sparse_choice(device_kind, kind, requested, kw, want):
    assert _sparse_choice(device_kind(kind), requested, **kw) == want


@pytest.mark.parametrize("kind, requested, kw, match", SPARSE_REFUSED)
def test_sparse_refusal(device_kind, kind, requested, kw, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        _sparse_choice(device_kind(kind), requested, **kw)


def test_records_agree_with_the_kernels():
    """The records are data; the numbers they hold are the kernels' own."""
    from fp8mla.backends import capabilities as c
    from fp8mla.backends.gluon import DEFAULTS
    from fp8mla.kernels.sm90 import sparse as sm90_sparse
    from fp8mla.sparse import INDEX_BLOCK
    assert c.GLUON_WIDE.heads == (1, k.MAX_WIDE_HEADS) and c.GLUON_HEADS_ON_M.heads == (k.MH_MIN_HEADS,
                                                                                        k.MAX_WIDE_HEADS)
    assert (c.GLUON_WIDE.max_qo, c.GLUON_WIDE.max_rows) == (k.MAX_MTP_QO, k.MAX_MTP_ROWS)
    assert c.GLUON_WIDE.head_dims == c.GLUON_HEADS_ON_M.head_dims == ((k.DC, k.DK),)
    assert c.GLUON_WIDE.page_multiple == c.GLUON_HEADS_ON_M.page_multiple == k.TILE
    assert c.GLUON_SPARSE.heads == (1, sm90_sparse.MAX_HEADS) and c.TRITON_SPARSE.topk_multiple == INDEX_BLOCK
    assert DEFAULTS["num_stages"] == c.DEFAULT_STAGES


def test_every_record_names_a_backend_module():
    import importlib
    from fp8mla.backends.capabilities import BUILDS
    for api, caps in BUILDS.items():
        assert len({cap.name for cap in caps}) == len(caps)
        for cap in caps:
            assert cap.api == api
            mod = importlib.import_module(f"fp8mla.backends.{cap.module}")
            assert callable(getattr(mod, "build" if api != "v4" else "run")), cap
            if cap.finish:
                module, fn = cap.finish.split(":")
                assert callable(getattr(importlib.import_module(f"fp8mla.backends.{module}"), fn)), cap


@pytest.mark.parametrize("kind, requested, want", [("sm90", "auto", "gluon"), ("cuda", "auto", "triton"),
                                                   ("cpu", "auto", "torch"), ("cpu", "triton", "triton"),
                                                   ("cuda", "torch", "torch")])
def test_v4_choice(device_kind, kind, requested, want):
    from fp8mla.backends.select import select, v4_question
    from fp8mla.formats_v4 import get_v4_format
    q = v4_question(64, get_v4_format("fp8_v4"), torch.bfloat16, device_kind(kind), 128)
    assert select(q, requested).backend == want
