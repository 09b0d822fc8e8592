"""The Gluon decode kernel's measurement builds (``decode_sm90.launch(timeline=...)``) and experiments
(``wide_row_sums``, ``pv_in_flight=2``; kernel log 22 of docs/benchmarks.md) and the timeline's reduction.

CPU: both builds compile for sm_90a with the kernel's MMA counts unchanged (the probe adds six clock reads per
consumer and nothing to the tile loops' MMAs), and ``scripts/timeline_device.py``'s phase statistics on synthetic
stamps (a tile with a missing stamp is left out, the gap pairs consecutive tiles). GPU: none here (the scripts are
the device drivers)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from conftest import compile_report_in_child
from fp8mla.kernels import decode_sm90 as k

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _report(**kw) -> tuple[dict, str]:
    return compile_report_in_child(page=64, ns=3, aligned_ints=True, **kw)


@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("kw", [dict(heads=16, timeline_tiles=96), dict(heads=128, wide_row_sums=True),
                                dict(heads=16, pv_in_flight=2)])
def test_measurement_builds_compile(kw):
    r, sass = _report(**kw)
    if kw.get("pv_in_flight") == 2:   # 8 P.V waits per consumer leave two chunk groups in flight
        assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x2") == 16, sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x2")
        assert sum(st for st, _ in r["spills"]) <= 512, r["spills"]
    assert sum(n for op, n in r["ops"].items() if op.startswith("HGMMA")) == 136, r["ops"]
    assert not r["serialized_wgmma"], r["ptxas"]
    assert all(x["LDS.U8"] == 0 for x in r["loops"]), r["loops"]
    # 6 tile stamps per consumer, and 8 per-CTA points (4 at entry / item start / Q in smem / exit, 4 on loaded
    # values: the first item's prologue steps, kernel log 30), per consumer; triton 3.9 merges one pair of reads
    n = sass.count("SR_CLOCKLO")
    assert (2 * (6 + 7) <= n <= 2 * (6 + 8)) if "timeline_tiles" in kw else n == 0, n
    if kw.get("wide_row_sums"):   # the option is live: the wide build without it compiles to other code
        base, _ = _report(heads=128)
        assert base["ops"] != r["ops"]


_NEW_KEYS = {"QK8", "QKC", "tl_ptr", "TLT", "WLACC", "PVW", "PV8", "Q1P"}


@pytest.mark.parametrize("opts,keys", [
    ({}, set()), (dict(qk8=2), {"QK8"}), (dict(qk8=2, qk8_chunks=True), {"QK8", "QKC"}),
    (dict(timeline="T"), {"tl_ptr", "TLT"}), (dict(wide_row_sums=True), set()),
    (dict(wide_row_sums=True, num_heads=128), {"WLACC"}), (dict(pv_in_flight=2), {"PVW"}),
    (dict(q_one_pass=True), set()), (dict(q_one_pass=False), {"Q1P"}), (dict(qk8=2, pv8=True), {"QK8", "PV8"})])
def test_launch_passes_new_keywords_only_when_asked(monkeypatch, opts, keys):
    """The measured kernel's JIT key: a default launch passes none of this session's constexprs (so the kernel
    it compiles is the measured one), and each option adds exactly its own."""
    from types import SimpleNamespace
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.update(kw)

    monkeypatch.setattr(k, "mla_decode_sm90_kernel", Recorder())
    monkeypatch.setattr(k, "launch_merge", lambda *a, **kw: None)
    H = opts.pop("num_heads", 16)
    rows = k.padded_heads(H)
    grid = 132 * k.head_config(H)[1]
    if opts.get("timeline") == "T":
        opts["timeline"] = torch.zeros(grid, 2, 4, 8, dtype=torch.int64)
    q = torch.zeros(1, H, 512)
    desc = SimpleNamespace(base=None, strides=(576, 1), shape=(64, 512))
    t = {n: torch.zeros(2, dtype=torch.int32) for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len", "cta_ptr",
                                                        "item_req", "item_t0", "item_t1")}
    t.update(part_o=torch.empty(1, rows, 512), part_lse=torch.empty(1, rows))
    k.launch(desc, desc, q, q, None, t, q, torch.zeros(1, H), grid=grid, grid_batch=1, max_rows=H, num_heads=H,
             sm_scale=0.1, page_size=64, ns=2, **opts)
    assert seen, "the kernel was not launched"
    assert _NEW_KEYS & set(seen) == keys, sorted(seen)


def _timeline_module():
    spec = importlib.util.spec_from_file_location("timeline_device", os.path.join(ROOT, "scripts/timeline_device.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_timeline_phases_on_synthetic_stamps():
    t = _timeline_module()
    tl = torch.zeros(2, 2, t.T, 8, dtype=torch.int64)
    for g in range(2):
        for c in range(2):
            for n in range(5):
                b = 1000 + n * 600
                tl[g, c, n, :6] = torch.tensor([b, b + 50, b + 150, b + 250, b + 300, b + 550])
    tl[1, 1, 2, 3] = 0   # a tile with a missing stamp: left out of every phase
    st = t.phases(tl)
    assert st["ready"]["median"] == 50 and st["qk"]["median"] == 100 and st["soft"]["median"] == 100
    assert st["pstore"]["median"] == 50 and st["pv"]["median"] == 250
    assert st["gap"]["median"] == 50 and st["tile"]["median"] == 600
    assert st["ready"]["n"] == 19 and st["gap"]["n"] == 14


def test_launch_refuses_pv_in_flight_past_two():
    q = torch.zeros(1, 16, 512)
    t = dict(part_o=torch.empty(1, 16, 512), part_lse=torch.empty(1, 16))
    with pytest.raises(ValueError, match="pv_in_flight"):
        k.launch(None, None, q, q, None, t, q, None, grid=132, grid_batch=1, max_rows=16, num_heads=16,
                 sm_scale=0.1, page_size=64, pv_in_flight=3)


def test_q_one_pass_switch_routes_the_option(monkeypatch):
    """FP8MLA_GLUON_Q1P (kernel log 30; on by default, as the kernel's own default): the adapter passes
    q_one_pass=False only when the switch is off, and only to the default kernel's launch."""
    from types import SimpleNamespace
    from fp8mla.backends import gluon as gb
    calls = []
    monkeypatch.setattr(k, "kv_descriptors", lambda a, b: ("kv", "kpe"))
    monkeypatch.setattr(k, "launch", lambda *a, **kw: calls.append(kw))
    spec = SimpleNamespace(num_heads=16, sm_scale=0.1, page_size=64, causal=True)
    pool = torch.zeros(4, 64, 576, dtype=torch.uint8)
    for env, want in (("1", True), ("0", False), ("", True)):   # ("": the default, on)
        monkeypatch.setenv("FP8MLA_GLUON_Q1P", env)
        calls.clear()
        gb.GluonPlan(spec, 132, 8, 2, 256, 4, {}).run(None, None, pool[..., :512], pool[..., 512:], None, None, None,
                                                      None, base_e=False)
        assert calls[0].get("q_one_pass", True) is want


def test_pdl_merge_only_on_cuda_and_never_in_the_interpreter(monkeypatch):
    """The merge kernel is a programmatic dependent launch only on a CUDA tensor, never under TRITON_INTERPRET
    (the interpreter runs no griddepcontrol), and FP8MLA_PDL_MERGE=0 turns it off."""
    cpu = torch.zeros(1)
    assert not k.pdl_merge_enabled(cpu)
    fake_cuda = type("T", (), {"is_cuda": True})()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FP8MLA_PDL_MERGE", raising=False)
    assert k.pdl_merge_enabled(fake_cuda) == (k.PDL_MERGE and k._gdc_wait is not None)
    monkeypatch.setenv("FP8MLA_PDL_MERGE", "0")
    assert not k.pdl_merge_enabled(fake_cuda)
    monkeypatch.setenv("FP8MLA_PDL_MERGE", "1")
    assert k.pdl_merge_enabled(fake_cuda) == (k._gdc_wait is not None)   # on: the programmatic launch
    monkeypatch.delenv("FP8MLA_PDL_MERGE")
    monkeypatch.setattr(k, "PDL_MERGE", True)
    assert k.pdl_merge_enabled(fake_cuda) == (k._gdc_wait is not None)   # the module default, when set
    monkeypatch.setenv("FP8MLA_PDL_MERGE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not k.pdl_merge_enabled(fake_cuda)


@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("heads", [16, 128])
def test_q_one_pass_compiles_with_fewer_loads(heads):
    """Q in one pass: no more global loads than the two-pass build (under triton 3.6, the H200's, fewer: it loads the
    rows twice; 3.9 merges the second loads itself), the same MMAs, no wgmma serialization."""
    import triton
    a, _ = _report(heads=heads, q_one_pass=False)
    b, _ = _report(heads=heads)
    ldg = lambda r: sum(n for op, n in r["ops"].items() if op.startswith("LDG"))
    assert ldg(b) < ldg(a) if triton.__version__.startswith("3.6") else ldg(b) <= ldg(a), (ldg(a), ldg(b))
    hg = lambda r: sum(n for op, n in r["ops"].items() if op.startswith("HGMMA"))
    assert hg(a) == hg(b) == 136 and not b["serialized_wgmma"]
    assert sum(st for st, _ in b["spills"]) <= sum(st for st, _ in a["spills"]) + 64, (a["spills"], b["spills"])
