"""The Hopper Gluon kernels' entry points take their runtime values in bundles (tuples the kernel unpacks), the TMA
descriptors and constexprs beside them. Nothing here launches: a host launch's bundles are recorded and checked leaf
by leaf against the kernel's own unpacking (its source) and against the values each leaf must carry, so a launch
that passes a bundle in another order than the kernel reads it fails here, not only on the GPU. The compile
signatures of the SASS guard (``devtools.sass``) are checked against the same unpacking.
"""
from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest

from devtools import sass
from fp8mla.kernels.sm90 import config, heads_on_m, kernel, sparse, sparse_partitions

pytestmark = pytest.mark.skipif(config.gluon is None, reason="the kernels need triton.experimental.gluon")

MAX_PARAMS = 12   # the project's bound on a Gluon function's parameters (constexprs count)


def _entry(module, name):
    """(parameter names, {bundle parameter: its leaf names in unpacking order}) of kernel ``name`` in ``module``,
    read from its source: the bundles are the parameters a ``a, b, ... = param`` statement of its body unpacks."""
    tree = ast.parse(inspect.getsource(module))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    bundles = {}
    for st in ast.walk(fn):
        if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Tuple)
                and isinstance(st.value, ast.Name) and st.value.id in params):
            bundles[st.value.id] = tuple(e.id for e in st.targets[0].elts)
    return params, bundles


def _leaves(params, bundles, args, kwargs):
    """{leaf name: value} of a recorded launch: each bundle's tuple spread over its leaf names (its length checked),
    the other parameters as themselves."""
    bound = dict(zip(params, args), **{k: v for k, v in kwargs.items() if k in params})
    out = {}
    for p, v in bound.items():
        if p in bundles and v is not None:
            assert isinstance(v, tuple) and len(v) == len(bundles[p]), (p, v)
            out.update(zip(bundles[p], v))
        else:
            out[p] = v
    return out


def _same(got: dict, want: dict):
    for name, w in want.items():
        g = got[name]
        assert g is w if not isinstance(w, (int, float, str)) else g == w, f"{name}: got {g!r}, expected {w!r}"


class _Arr:
    """A stand-in tensor: a name (identity is what the checks compare), a shape and strides all distinct."""
    def __init__(self, name, shape, strides):
        self.name, self.shape, self._strides = name, shape, strides

    def stride(self, i=None):
        return self._strides if i is None else self._strides[i]

    def __repr__(self):
        return f"<{self.name}>"


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((a, kw))


@pytest.mark.parametrize("module,name,table", [(kernel, "mla_decode_sm90_kernel", sass.KERNEL_BUNDLES),
                                               (heads_on_m, "heads_on_m_kernel", sass.MH_KERNEL_BUNDLES),
                                               (sparse_partitions, "sparse_mla_kernel", sass.SPARSE_BUNDLES)])
def test_entry_points_take_bundles_the_guard_compiles_alike(module, name, table):
    params, bundles = _entry(module, name)
    assert len(params) <= MAX_PARAMS, (name, len(params))
    assert bundles and bundles == {p: table[p] for p in params if p in table}, (bundles, table)
    assert not any(p.endswith("_desc") for p in bundles), "descriptors stay top-level (triton 3.6's launcher)"


def _decode_call(monkeypatch, group: bool):
    rec = _Recorder()
    monkeypatch.setattr(kernel, "mla_decode_sm90_kernel", rec)
    monkeypatch.setattr(kernel, "launch_merge", lambda *a, **kw: None)
    H = 16
    b = config.Sm90Build.for_plan(H, 64, group=group, stages=2 if group else 4)
    kv = SimpleNamespace(base="ckv_base", strides=(101, 1), shape=(103, 512))
    kpe = SimpleNamespace(base="kpe_base", strides=(107, 1), shape=(103, 64))
    sc = SimpleNamespace(base="sc_base", strides=(109, 1), block_shape=[64, 4]) if group else None
    q_nope, q_pe = _Arr("q_nope", (1, H, 512), (211, 223, 1)), _Arr("q_pe", (1, H, 64), (227, 229, 1))
    out, lse = _Arr("out", (1, H, 512), (233, 239, 1)), _Arr("lse", (1, H), (241, 1))
    t = {n: _Arr(n, (2,), (1,)) for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len", "cta_ptr", "item_req",
                                          "item_t0", "item_t1")}
    t.update(part_o=_Arr("part_o", (1, 16, 512), (251, 257, 1)), part_lse=_Arr("part_lse", (1, 16), (263, 1)))
    kernel.launch(b, kv, kpe, q_nope, q_pe, "scales", t, out, lse, grid=132, grid_batch=1, max_rows=H, num_heads=H,
                  sm_scale=0.5, scale_desc=sc)
    (args, kw), = rec.calls
    params, bundles = _entry(kernel, "mla_decode_sm90_kernel")
    got = _leaves(params, bundles, args, kw)
    want = dict(kv_desc=kv, kpe_desc=kpe, ckv_ptr="ckv_base", kpe_ptr="kpe_base", stride_kv_row=101,
                stride_kpe_row=107, num_rows=103, q_nope=q_nope, q_pe=q_pe, scales="scales",
                sm_scale_log2=0.5 * config.LOG2E, H=H, stride_qn_t=211, stride_qn_h=223, stride_qp_t=227,
                stride_qp_h=229, stride_po_i=251, stride_po_r=257, stride_pl_i=263, stride_o_t=233, stride_o_h=239,
                stride_lse_t=241, part_o=t["part_o"], part_lse=t["part_lse"], OUT=out, LSE_OUT=lse,
                **{n: t[n] for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len", "cta_ptr", "item_req",
                                     "item_t0", "item_t1")})
    _same(got, want)
    return got, b


def test_decode_launch_passes_what_the_kernel_unpacks(monkeypatch):
    got, b = _decode_call(monkeypatch, group=False)
    assert got["sc_desc"] is None and got["sc_rows"] is None
    assert got["BUILD"] == tuple(b.constexprs()[n] for n in config.DECODE_CONSTEXPRS)
    params, _ = _entry(kernel, "mla_decode_sm90_kernel")
    src = inspect.getsource(kernel)   # the kernel reads BUILD[i] back into the name DECODE_CONSTEXPRS gives it
    for i, n in enumerate(config.DECODE_CONSTEXPRS):
        assert f"{n}: gl.constexpr = BUILD[{i}]" in src, n


def test_decode_launch_passes_the_group_scales(monkeypatch):
    got, b = _decode_call(monkeypatch, group=True)
    assert got["sc_desc"].base == "sc_base" and got["sc_ptr"] == "sc_base" and got["stride_sc_row"] == 109
    assert got["BUILD"][config.DECODE_CONSTEXPRS.index("GROUP")] is True


def test_heads_on_m_launch_passes_what_the_kernel_unpacks(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(heads_on_m, "heads_on_m_kernel", rec)
    monkeypatch.setattr(heads_on_m, "launch_merge", lambda *a, **kw: None)
    H = 128
    b = config.Sm90Build.for_heads_on_m(H, 64)
    kv = SimpleNamespace(block_shape=[64, 64])
    kpe = SimpleNamespace(block_shape=[64, 64])
    q_nope, q_pe = _Arr("q_nope", (1, H, 512), (211, 223, 1)), _Arr("q_pe", (1, H, 64), (227, 229, 1))
    out, lse = _Arr("out", (1, H, 512), (233, 239, 1)), _Arr("lse", (1, H), (241, 1))
    names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len", "m_ptr", "batch_size", "item_req", "item_t0",
             "item_t1")
    t = {n: _Arr(n, (2,), (1,)) for n in names}
    t.update(part_o=_Arr("part_o", (1, H, 512), (251, 257, 1)), part_lse=_Arr("part_lse", (1, H), (263, 1)))
    heads_on_m.launch_heads_on_m(b, kv, kpe, q_nope, q_pe, "scales", t, out, lse, n_items=3, grid_batch=1,
                                 num_heads=H, sm_scale=0.5)
    (args, kw), = rec.calls
    params, bundles = _entry(heads_on_m, "heads_on_m_kernel")
    want = dict(kv_desc=kv, kpe_desc=kpe, q_nope=q_nope, q_pe=q_pe, scales="scales", sm_scale_log2=0.5 * config.LOG2E,
                H=H, stride_qn_t=211, stride_qn_h=223, stride_qp_t=227, stride_qp_h=229, stride_po_i=251,
                stride_po_r=257, stride_pl_i=263, stride_o_t=233, stride_o_h=239, stride_lse_t=241,
                part_o=t["part_o"], part_lse=t["part_lse"], OUT=out, LSE_OUT=lse, **{n: t[n] for n in names},
                **b.constexprs())
    _same(_leaves(params, bundles, args, kw), want)


def test_sparse_launch_passes_what_the_kernel_unpacks(monkeypatch):
    from fp8mla.kernels.split import merge
    rec = _Recorder()
    monkeypatch.setattr(sparse_partitions, "sparse_mla_kernel", rec)
    monkeypatch.setattr(merge, "merge_splits", lambda *a, **kw: None)
    n, H, P, page, topk = 3, 128, 5, 64, 2048
    q_nope, q_pe = _Arr("q_nope", (n, H, 512), (211, 223, 1)), _Arr("q_pe", (n, H, 64), (227, 229, 1))
    ckv = _Arr("ckv", (P, page, 512), (page * sparse.REC_BYTES, sparse.REC_BYTES, 1))
    kpe, scale_arr = _Arr("kpe", (P, page, 64), (1, 1, 1)), _Arr("scale_arr", (P, page, 4), (1, 1, 1))
    indices = _Arr("indices", (n, topk), (2053, 1))
    out, lse = _Arr("out", (n, H, 512), (233, 239, 1)), _Arr("lse", (n, H), (241, 3))
    part_o, part_lse = _Arr("part_o", (9, H, 512), (251, 257, 1)), _Arr("part_lse", (9, H), (263, 1))
    sparse.sparse_mla(q_nope, q_pe, ckv, kpe, scale_arr, indices, out, lse, part_o, part_lse, sm_scale=0.5,
                      num_splits=3, lse_scale=0.25)
    (args, kw), = rec.calls
    params, bundles = _entry(sparse_partitions, "sparse_mla_kernel")
    want = dict(q_nope=q_nope, q_pe=q_pe, ckv_ptr=ckv, sa_ptr=scale_arr, kpe_ptr=kpe, indices=indices, out=out,
                lse_out=lse, part_o=part_o, part_lse=part_lse, sm_scale_log2=0.5 * config.LOG2E, lse_scale=0.25,
                H=H, num_slots=P * page, topk=topk, chunk=704, num_splits=3, num_groups=2, stride_qn_t=211,
                stride_qn_h=223, stride_qp_t=227, stride_qp_h=229, stride_idx_t=2053, stride_o_t=233,
                stride_o_h=239, stride_lse_t=241, stride_lse_h=3, stride_po_i=251, stride_po_h=257,
                stride_pl_i=263, SPLIT=True, REGS=sparse_partitions.REGS)
    _same(_leaves(params, bundles, args, kw), want)
