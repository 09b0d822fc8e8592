"""forbid_pool_casts: the legacy pool casts are caught; fp8mla's run() paths, gathers and quantize-on-write pass.

To guard another path, add a builder to ``GUARDED_PATHS``: it takes ``(kv_format, device)`` and returns
``(fn, pools, expect_reads)``; ``fn()`` runs the path, ``pools`` are the KV pool tensors it reads, and
``expect_reads`` says whether ATen ops read the pool (False for paths whose only pool reads are Triton kernels,
which the dispatch mode cannot see). Every builder runs inside the guard for every format.
"""
from __future__ import annotations

import pytest
import torch

import fp8mla
from fp8mla.testing import make_paged_batch
from fp8mla.tools.sentinel import PoolCastError, forbid_pool_casts

FORMATS = list(fp8mla.FORMATS)


def run_guarded(fn, *pools, max_fraction: float = 0.5, expect_reads: bool = True):
    """``fn()`` inside ``forbid_pool_casts(*pools)``; returns ``(result, guard)``.

    With ``expect_reads`` the guard must have seen at least one op read a pool: a path that never touches the
    registered tensors proves nothing (wrong tensors registered, or the pool copied before the call).
    """
    with forbid_pool_casts(*pools, max_fraction=max_fraction) as guard:
        result = fn()
    if expect_reads:
        assert guard.ops_checked > 0, "the guarded path never read the registered pools"
    return result, guard


def _paged_run(kv_lens, qo_lens, backend="torch"):
    def build(kv_format, device):
        b = make_paged_batch(kv_lens, qo_lens, num_heads=4, page_size=16, kv_format=kv_format, device=device,
                             head_dim_ckv=128, head_dim_kpe=64, seed=7)
        attn = fp8mla.MLAPagedAttention(backend=backend)
        attn.plan(**b.plan_args)
        return (lambda: attn.run(**b.run_args)), [b.pool], backend == "torch"
    return build


def _ragged_prefix(backend="torch"):
    """The prefill of a chunk after a cached prefix (as fp8mla.models does it): gather-then-cast the prefix's
    tokens only, attention over them and over the fresh chunk (MLARaggedPrefill), merged by LSE."""
    def build(kv_format, device):
        b = make_paged_batch([40, 17], [1, 1], num_heads=4, page_size=16, kv_format=kv_format, device=device,
                             head_dim_ckv=128, head_dim_kpe=64, seed=8)
        a, r = b.plan_args, b.run_args
        g = torch.Generator().manual_seed(9)
        q = torch.randn(6, 4, 192, generator=g).to(device, torch.bfloat16)
        k_new = torch.randn(6, 1, 192, generator=g).to(device, torch.bfloat16)
        v_new = torch.randn(6, 1, 128, generator=g).to(device, torch.bfloat16)
        qo = torch.tensor([0, 3, 6], dtype=torch.int32, device=device)

        def fn():
            ckv, kpe, tok = fp8mla.gather_dequant(r["ckv_cache"], r["kpe_cache"], a["kv_indptr"], a["kv_indices"],
                                                  a["kv_len_arr"], ckv_scale=r["ckv_scale"],
                                                  kpe_scale=r["kpe_scale"], ckv_scale_arr=r["ckv_scale_arr"],
                                                  backend=backend)
            prefix = fp8mla.MLARaggedPrefill(backend=backend)
            prefix.plan(qo, tok, 4, 1, 192, 128, False, 192 ** -0.5, torch.bfloat16, torch.bfloat16)
            o1, s1 = prefix.run(q, torch.cat([ckv, kpe], -1)[:, None], ckv[:, None], return_lse=True)
            chunk = fp8mla.MLARaggedPrefill(backend=backend)
            chunk.plan(qo, qo, 4, 1, 192, 128, True, 192 ** -0.5, torch.bfloat16, torch.bfloat16)
            o2, s2 = chunk.run(q, k_new, v_new, return_lse=True)
            return fp8mla.merge_state(o1, s1, o2, s2)[0]
        return fn, [b.pool], backend == "torch"
    return build


# name -> builder(kv_format, device) -> (fn, pools, expect_reads)
GUARDED_PATHS = {}
for _backend in ("torch", "triton"):
    GUARDED_PATHS[f"{_backend}-decode"] = _paged_run([17, 97, 0, 33], [1, 1, 1, 1], _backend)
    GUARDED_PATHS[f"{_backend}-multi-token"] = _paged_run([17, 97, 1, 33], [2, 5, 1, 3], _backend)
    GUARDED_PATHS[f"{_backend}-extend"] = _paged_run([40, 64], [17, 64], _backend)   # paged prefill of a chunk
    GUARDED_PATHS[f"{_backend}-ragged-prefix"] = _ragged_prefix(_backend)

_TRITON_HERE = "triton" in fp8mla.available_backends("cuda" if torch.cuda.is_available() else "cpu")
_PATH_PARAMS = [pytest.param(name, id=name, marks=[] if not name.startswith("triton") else [pytest.mark.triton] + (
    [] if _TRITON_HERE else [pytest.mark.skip(reason="the triton backend cannot run here")]))
    for name in GUARDED_PATHS]


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the Triton interpreter, on masked lanes
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("path", _PATH_PARAMS)
def test_run_paths_do_not_cast_the_pool(path, kv_format, device):
    fn, pools, expect_reads = GUARDED_PATHS[path](kv_format, device)
    out, _ = run_guarded(fn, *pools, expect_reads=expect_reads)
    assert torch.isfinite(out).all()


def _pool(device, pages=64, dtype=torch.float8_e4m3fn):
    return torch.randn(pages, 16, 576, device=device).to(dtype)


@pytest.mark.parametrize("cast", [
    pytest.param(lambda p, q: p.to(torch.bfloat16), id="to-bf16"),
    pytest.param(lambda p, q: p.to(q.dtype), id="to-q-dtype"),
    pytest.param(lambda p, q: p.float(), id="float"),
    pytest.param(lambda p, q: p.type_as(q), id="type_as"),
    pytest.param(lambda p, q: p[..., :512].to(torch.bfloat16), id="ckv-view"),
    pytest.param(lambda p, q: torch.empty(p.shape, dtype=q.dtype, device=p.device).copy_(p), id="copy-into-bf16"),
])
def test_legacy_pool_cast_is_caught(cast, device):
    pool = _pool(device)
    q = torch.randn(2, 16, 576, device=device, dtype=torch.bfloat16)
    with pytest.raises(PoolCastError) as e:
        with forbid_pool_casts(pool):
            cast(pool, q)
    msg = str(e.value)
    assert "aten." in msg and "KV pool #0" in msg and "[64, 16, 576]" in msg and "torch.float8_e4m3fn" in msg


def test_per_layer_cast_of_a_cache_is_caught(device):
    """A cache registers each layer's pool: a per-layer cast moves 1/L of the whole pool and must still count."""
    cache = fp8mla.PagedMLACache(num_layers=4, num_pages=16, page_size=16, kv_format="fp8_e4m3", device=device)
    with pytest.raises(PoolCastError, match="_to_copy"):
        with forbid_pool_casts(cache):
            cache.pool[2].to(torch.bfloat16)


def test_gather_then_cast_and_writes_pass(device):
    pool = _pool(device)
    idx = torch.tensor([3, 9, 41], device=device)
    with forbid_pool_casts(pool, max_fraction=0.5) as guard:
        a = pool[idx].to(torch.bfloat16)                  # gather first: 3 of 64 pages
        b = pool.flatten(0, 1).index_select(0, idx).float()
        c = pool[:8].to(torch.bfloat16)                   # a small slice: 1/8 of the pool
        d = pool.view(torch.uint8)                        # reinterpretation, nothing moves
        torch.empty_like(pool, dtype=torch.bfloat16)      # allocations shaped like the pool read nothing
        pool.new_zeros(pool.shape, dtype=torch.float32)
        pool[5] = torch.randn(16, 576, device=device).to(pool.dtype)   # quantize-on-write
    assert guard.ops_checked >= 5
    assert a.shape == (3, 16, 576) and b.dtype == torch.float32 and c.shape[0] == 8 and d.dtype == torch.uint8


def test_gather_through_a_reinterpreting_view_passes(device):
    """An engine's FP8 pool kept as uint8 (SGLang) and read as e4m3 through ``.view``: a gather of most of it moves
    bytes and converts nothing, so it passes at any size; a cast after that view is still a cast."""
    pool = _pool(device).view(torch.uint8)
    rows = torch.arange(0, 40, device=device)             # 40 of 64 pages: over the 50% limit
    with forbid_pool_casts(pool) as guard:
        g = pool.view(torch.float8_e4m3fn).index_select(0, rows)
    assert guard.ops_checked >= 1 and g.dtype == torch.float8_e4m3fn
    with pytest.raises(PoolCastError, match="torch.bfloat16"):
        with forbid_pool_casts(pool):
            pool.view(torch.float8_e4m3fn)[:40].to(torch.bfloat16)


def test_cache_append_passes(device):
    cache = fp8mla.PagedMLACache(num_layers=2, num_pages=8, page_size=16, kv_format="fp8_e4m3_group",
                                 device=device)
    s = cache.add_sequence(num_tokens=20)
    run_guarded(lambda: cache.append(1, [s], torch.randn(20, 512, device=device),
                                     torch.randn(20, 64, device=device)), cache)


def test_max_fraction_is_the_limit(device):
    pool = _pool(device, pages=10)
    with forbid_pool_casts(pool, max_fraction=0.3):
        pool[:3].float()                                  # 30%: at the limit, allowed
    with pytest.raises(PoolCastError, match="40%"):
        with forbid_pool_casts(pool, max_fraction=0.3):
            pool[:4].float()


def test_other_tensors_are_not_checked(device):
    pool = _pool(device)
    other = torch.randn(64, 16, 576, device=device)
    with forbid_pool_casts(pool) as guard:
        other.to(torch.bfloat16)
    assert guard.ops_checked == 0


@pytest.mark.parametrize("args, kwargs, err", [
    ((), {}, ValueError),
    (("not a tensor",), {}, TypeError),
    ((torch.zeros(2),), {"max_fraction": -1.0}, ValueError),
])
def test_bad_arguments(args, kwargs, err):
    with pytest.raises(err):
        forbid_pool_casts(*args, **kwargs)
