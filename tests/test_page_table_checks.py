"""The vectorized host checks of a page table (``fp8mla._checks``) against a plain Python walk of it, and plan()'s
host work on host tables: one pass over the page ids for an exact table, the torch backend's gather indices only
when it runs.

A table here has rows whose listed pages exceed their kv_len (padding), rows without queries (their pages are
never read, so anything goes there), empty rows, and bad ids placed in used and in unused slots: an id a token uses
must be in range, an id no token uses is never looked at (engines leave any value there).
"""
from __future__ import annotations

import importlib
import random

import pytest
import torch

import fp8mla
from fp8mla import _checks
from fp8mla._checks import INT32_MAX, check_kv_lengths, check_page_ids
from fp8mla.layout import PagedLayout

# by name: ``fp8mla.backends.torch`` as an attribute is the torch package the backends import
torch_backend = importlib.import_module("fp8mla.backends.torch")


def _walk(kvp, idx, lens, page, active):
    """(request, page id) of every page a token uses, by a Python loop: the reference."""
    return [(b, idx[kvp[b] + j]) for b in range(len(lens)) if active[b] for j in range(-(-lens[b] // page))]


def _table(rng: random.Random, B: int, page: int, slack: bool, wide: bool):
    lens, kvp, idx, active = [], [0], [], []
    for _ in range(B):
        L = rng.choice([0, 1, page - 1, page, page + 1, 3 * page + 2, rng.randrange(0, 40)])
        need = -(-L // page)
        extra = rng.randrange(0, 3) if slack else 0
        idx += [rng.randrange(0, 500) for _ in range(need)] + [rng.choice([-7, 10**6, 2**40 if wide else -2**31])
                                                                for _ in range(extra)]
        kvp.append(len(idx))
        lens.append(L)
        active.append(not slack or rng.random() < 0.8)
    # rows without queries may carry any kv_len and any ids: make some of them nonsense
    for b in range(B):
        if not active[b]:
            lens[b] = rng.choice([lens[b], 10**6])  # past its pages: never read, so not refused
            if kvp[b + 1] > kvp[b]:
                idx[kvp[b]] = -(10**9)
    return lens, kvp, idx, active


@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("slack", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_vectorized_page_check_matches_the_walk(page, slack, dtype):
    rng = random.Random(page * 10 + slack)
    for trial in range(25):
        B = rng.randrange(1, 9)
        lens, kvp, idx, active = _table(rng, B, page, slack, dtype == torch.int64)
        # one bad id in a used slot, in a third of the tables
        used = _walk(kvp, idx, lens, page, active)
        if used and trial % 3 == 0:
            b, _ = used[rng.randrange(len(used))]
            j = rng.randrange(-(-lens[b] // page))
            idx[kvp[b] + j] = rng.choice([-1, 600, 2**31]) if dtype == torch.int64 else rng.choice([-1, 600])
            used = _walk(kvp, idx, lens, page, active)
        t = [torch.tensor(x, dtype=dtype) for x in (kvp, idx, lens)]
        act = torch.tensor(active)
        assert check_kv_lengths(t[0], t[1].numel(), t[2], page, act) == lens
        bad = [(b, p) for b, p in used if not 0 <= p < 500]
        if bad:
            with pytest.raises(ValueError, match=rf"kv_indices: request {bad[0][0]} references page {bad[0][1]}, "
                                                 r"expected page ids >= 0 and < 500"):
                check_page_ids(t[0], t[1], t[2], page, act, num_pages=500)
        else:
            top = max((p for _, p in used), default=-1)
            assert check_page_ids(t[0], t[1], t[2], page, act, num_pages=500) == top
            assert check_page_ids(t[0], t[1], t[2], page, act) == top


def test_past_int32_is_refused_without_a_pool_bound():
    kvp, lens = torch.tensor([0, 2, 3]), torch.tensor([17, 5])
    idx = torch.tensor([4, INT32_MAX + 1, 9])
    with pytest.raises(ValueError, match=r"kv_indices: request 0 references page 2147483648, expected page ids "
                                         r">= 0 and < 2\*\*31 \(int32\)"):
        check_page_ids(kvp, idx, lens, 16)
    assert check_page_ids(kvp, idx, torch.tensor([16, 5]), 16) == 9  # the id past int32 is not used


def _page1(B, L, spare=0):
    i32 = dict(dtype=torch.int32)
    need = L + spare
    ids = torch.randperm(B * L + 5, **i32)[: B * L].view(B, L)
    ids = torch.cat([ids, torch.full((B, spare), 10**6, **i32)], 1).reshape(-1).contiguous()
    return dict(qo_indptr=torch.arange(B + 1, **i32), kv_indptr=torch.arange(B + 1, **i32) * need, kv_indices=ids,
                kv_len_arr=torch.full((B,), L, **i32), num_heads=16, head_dim_ckv=512, head_dim_kpe=64,
                page_size=1, causal=True, sm_scale=192 ** -0.5, q_data_type=torch.bfloat16,
                kv_data_type=torch.float8_e4m3fn)


@pytest.mark.parametrize("backend", fp8mla.available_backends("cpu"))
def test_plan_reads_page_ids_in_one_pass_without_the_token_walk(backend, monkeypatch):
    """plan() on a valid host table bounds its page ids without the per-token scan (O(tokens) int64 temporaries:
    it took ~10 ms at B 64 x 8,192 tokens, page 1), and the torch backend builds its gather indices on the first
    run(), not in plan(). The scan still names a bad id (tests above)."""
    def no_walk(*a, **k):
        raise AssertionError("plan() walked the page ids token by token")

    def no_buckets(*a, **k):
        raise AssertionError("plan() built the torch backend's gather indices")

    monkeypatch.setattr(_checks, "used_pages", no_walk)
    monkeypatch.setattr(torch_backend, "_Bucket", no_buckets)
    for spare in (0, 2):
        a = _page1(4, 300, spare)
        attn = fp8mla.MLAPagedAttention(backend=backend)
        attn.plan(**a)
        assert attn.layout.max_page_id == int(a["kv_indices"][a["kv_indices"] < 10**6].max())
    monkeypatch.undo()
    bad = _page1(4, 300)
    bad["kv_indices"][301] = -3
    with pytest.raises(ValueError, match=r"kv_indices: request 1 references page -3"):
        fp8mla.MLAPagedAttention(backend=backend).plan(**bad)


def test_torch_backend_builds_its_buckets_on_first_run():
    from fp8mla.testing import assert_close, make_paged_batch
    pb = make_paged_batch([37, 5, 0], [1, 2, 1], 4, 16, "fp8_e4m3", seed=3)
    attn = fp8mla.MLAPagedAttention(backend="torch")
    attn.plan(**pb.plan_args)
    assert attn._plan.impl._buckets is None
    out = attn.run(**pb.run_args)
    assert attn._plan.impl._buckets is not None
    assert_close(out, pb.reference()[0], 1e-2)


def test_block_table_padding_is_not_bounded():
    """A host block table's unused tail slots hold any value; only the pages the lengths reach are checked."""
    bt = torch.tensor([[3, 1, -1, 2**31 - 1], [0, 4, 5, 10**9]], dtype=torch.int64)
    lay = PagedLayout.from_block_table(bt, torch.tensor([17, 40]), 16)
    assert lay.max_page_id == 5
    bt[0, 1] = -2
    with pytest.raises(ValueError, match=r"block_table: request 0 references page -2"):
        PagedLayout.from_block_table(bt, torch.tensor([17, 40]), 16)


def test_bench_plan_runs_on_the_cpu(capsys):
    from fp8mla.cli import main as cli
    assert cli(["bench", "plan", "--points", "3x40", "--page-size", "1", "16", "--backends", "torch",
                "--reps", "2"]) == 0
    rows = [r.split() for r in capsys.readouterr().out.splitlines() if r.startswith("torch ")]
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [(t, p, "3", "40") for t in ("csr", "padded")
                                                       for p in ("1", "16")]
    assert all(float(r[-1]) > 0 for r in rows)
