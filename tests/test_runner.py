"""The decode step's runtime: fused kernels (against the torch ops they replace, under TRITON_INTERPRET=1 on the
CPU), O(batch) step planning, the reservation undone when a step fails, the CUDA-graph runner's buckets and plan
(CPU) and its graphs against eager steps (CUDA only; skipped without it)."""
from __future__ import annotations

import os

import pytest
import torch

from fp8mla import PagedMLACache
from fp8mla.models import DeepseekMLAModel, load_config
from fp8mla.models.config import YarnRope
from fp8mla.models.deepseek import LATENT_NORM_EPS, RMSNorm
from fp8mla.models.runner import DecodeRunner, batch_buckets, bucket_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="triton cannot run here")
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")


def ulps_apart(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How many representable steps of ``dtype`` lie between a and b (both exactly representable in it)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float8_e4m3fn: torch.int8,
            torch.float8_e5m2: torch.int8, torch.float32: torch.int32}[dtype]

    def key(x):
        i = x.to(dtype).view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & ((1 << (8 * x.to(dtype).element_size() - 1)) - 1)), i)
    return (key(a) - key(b)).abs()


# -- fused kernels ------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [512, 97])
def test_rms_norm_matches_torch(dtype, D):
    from fp8mla.models.fused import rms_norm
    g = torch.Generator().manual_seed(D)
    norm = RMSNorm(D, 1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
    x = (3 * torch.randn(7, D + 5, generator=g)).to(dtype)[:, 3: 3 + D]  # strided rows
    want = norm(x)
    got = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        d = ulps_apart(got, want, dtype)
        assert d.max() <= 1 and (d > 0).float().mean() < 0.02, (d.max(), (d > 0).float().mean())


def _latents(T, cfg, dtype, g):
    kv = (2 * torch.randn(T, cfg.kv_lora_rank + cfg.qk_rope_head_dim + 3, generator=g)).to(dtype)
    return kv[:, : cfg.kv_lora_rank + cfg.qk_rope_head_dim]  # strided rows, as kv_a_proj's split view


@needs_triton
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16"])
@pytest.mark.parametrize("dtype,interleave", [(torch.bfloat16, True), (torch.float32, False)])
def test_kv_norm_rope_write_matches_torch(kv_format, dtype, interleave):
    """Fused norm + rope + quantize-on-write stores what the torch ops + cache.write store; slot -1 is skipped
    and no other slot changes (NaN elsewhere stays NaN)."""
    from fp8mla.models.fused import kv_norm_rope_write
    g = torch.Generator().manual_seed(5)
    cfg = load_config("tiny").replace(rope_interleave=interleave, kv_lora_rank=256, qk_rope_head_dim=32)
    rope = YarnRope(cfg)
    T = 9
    kv = _latents(T, cfg, dtype, g)
    norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(cfg.kv_lora_rank, generator=g))
    pos = torch.randint(0, 5000, (T,), generator=g)
    cos, sin = rope.cos_sin(pos)
    kw = dict(head_dim_ckv=cfg.kv_lora_rank, head_dim_kpe=cfg.qk_rope_head_dim)
    scales = dict(ckv_scale=0.05, kpe_scale=0.02) if kv_format.startswith("fp8") else {}
    ref = PagedMLACache(1, 6, 4, kv_format, **kw, **scales)
    got = PagedMLACache(1, 6, 4, kv_format, device=DEVICE, **kw, **scales)
    for c in (ref, got):
        c.pool.view(torch.uint8).fill_(0xFF)  # NaN in every format (0xFF, 0xFFFF)
    slots = torch.randperm(24, generator=g)[:T]
    slots[4] = -1  # a padding row
    ckv, kpe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    live = slots >= 0
    ref.write(0, slots[live], norm(ckv)[live], rope.apply(kpe, cos, sin)[live], use_triton=False)
    kv_norm_rope_write(kv.to(DEVICE), norm.weight.to(DEVICE), LATENT_NORM_EPS, cos.to(DEVICE), sin.to(DEVICE),
                       slots.to(DEVICE), got.pool[0].view(24, -1), got.format, got.ckv_scale, got.kpe_scale,
                       interleave=interleave, head_dim_ckv=cfg.kv_lora_rank)
    a, b = ref.pool.view(-1).float(), got.pool.view(-1).cpu().float()
    assert torch.equal(a.isnan(), b.isnan())  # untouched slots stay NaN, written ones are finite
    d = ulps_apart(a.nan_to_num(), b.nan_to_num(), ref.pool.dtype)
    assert d.max() <= 1 and (d > 0).float().mean() < 0.02, (d.max(), (d > 0).float().mean())


@needs_triton
@pytest.mark.parametrize("dtype,adt,interleave", [(torch.bfloat16, torch.bfloat16, True),
                                                  (torch.float32, torch.bfloat16, True),
                                                  (torch.float16, torch.float16, False)])
def test_q_rope_matches_torch(dtype, adt, interleave):
    from fp8mla.models.fused import q_rope
    g = torch.Generator().manual_seed(7)
    cfg = load_config("tiny").replace(rope_interleave=interleave)
    rope = YarnRope(cfg)
    T, H = 5, 3
    q = (2 * torch.randn(T, H * cfg.qk_head_dim, generator=g)).to(dtype).view(T, H, cfg.qk_head_dim)
    cos, sin = rope.cos_sin(torch.randint(0, 9000, (T,), generator=g))
    want = rope.apply(q[..., cfg.qk_nope_head_dim:], cos, sin).to(adt)
    got = q_rope(q.to(DEVICE), cfg.qk_nope_head_dim, cos.to(DEVICE), sin.to(DEVICE), adt,
                 interleave=interleave).cpu()
    assert got.is_contiguous() and got.dtype == adt
    d = ulps_apart(got, want, adt)
    assert d.max() <= 1 and (d > 0).float().mean() < 0.02, (d.max(), (d > 0).float().mean())


# -- step planning, reservation undo ------------------------------------------------------------------------------
def tiny_model(**kw):
    return DeepseekMLAModel.random("tiny", seed=3, dtype=torch.float32, device=DEVICE, **kw)


def cache_state(cache):
    return ({s: (cache.seq_len(s), cache.pages(s)) for s in cache.sequences}, cache.num_free_pages)


@pytest.mark.parametrize("page_size", [1, 4])
def test_begin_step_positions_rows_and_plans(page_size):
    """Mixed step: rows in seq_ids order, positions from the cache's lengths, decode rows planned over the pool."""
    m = tiny_model()
    cache = m.make_cache(64, page_size, "bf16")
    a, b, c = (cache.add_sequence() for _ in range(3))
    m(torch.randn(9, 256, device=DEVICE), m.begin_step(cache, [a, b, c], [3, 1, 5]))
    st = m.begin_step(cache, [c, a, b], [1, 4, 1])
    assert st.prefix_lens == [5, 3, 1]
    assert st.decode_rows.tolist() == [0, 5] and st.prefill_rows.tolist() == [1, 2, 3, 4]
    want_pos = torch.tensor([5, 3, 4, 5, 6, 1])
    cos, sin = m.rope.cos_sin(want_pos.to(DEVICE))
    assert torch.equal(st.cos, cos) and torch.equal(st.sin, sin)
    assert st.paged is not None and st.ragged is not None and st.ragged_prefix is not None
    assert [cache.seq_len(s) for s in (a, b, c)] == [7, 2, 6]


def test_failed_forward_gives_the_reservation_back():
    m = tiny_model()
    cache = m.make_cache(32, 4, "fp8_e4m3")
    ids = [cache.add_sequence() for _ in range(2)]
    m(torch.randn(8, 256, device=DEVICE), m.begin_step(cache, ids, [4, 4]))  # page boundary next: new pages
    before = cache_state(cache)
    st = m.begin_step(cache, ids, [1, 1])
    assert cache_state(cache) != before
    with pytest.raises(ValueError, match="x: expected shape"):
        m(torch.randn(3, 256, device=DEVICE), st)
    assert cache_state(cache) == before
    st.cancel()  # once only
    assert cache_state(cache) == before
    # a completed step keeps its tokens even if a later rerun fails
    st = m.begin_step(cache, ids, [1, 1])
    m(torch.randn(2, 256, device=DEVICE), st)
    after = cache_state(cache)
    with pytest.raises(ValueError):
        m(torch.randn(3, 256, device=DEVICE), st)
    assert cache_state(cache) == after


def test_failed_plan_gives_the_reservation_back(monkeypatch):
    from fp8mla.models import mla_step
    m = tiny_model()
    cache = m.make_cache(32, 4, "bf16")
    ids = [cache.add_sequence() for _ in range(2)]
    m(torch.randn(5, 256, device=DEVICE), m.begin_step(cache, ids, [4, 1]))
    before = cache_state(cache)

    def boom(*a, **k):
        raise RuntimeError("plan failed")
    monkeypatch.setattr(mla_step, "plan_decode", boom)
    with pytest.raises(RuntimeError, match="plan failed"):
        m.begin_step(cache, ids, [1, 1])
    assert cache_state(cache) == before


def test_cancelled_step_refuses_to_run():
    """A step whose reservation went back to the cache must not write its tokens into the returned slots (another
    sequence may own them by then): ``model(x, step)`` refuses it by name, and so does a step whose sequences lost
    the reservation another way (``cache.unreserve``, ``cache.free``)."""
    m = tiny_model()
    cache = m.make_cache(32, 4, "bf16")
    a, b = cache.add_sequence(), cache.add_sequence()
    m(torch.randn(6, 256, device=DEVICE), m.begin_step(cache, [a, b], [3, 3]))
    st = m.begin_step(cache, [a, b], [1, 1])
    st.cancel()
    c = cache.add_sequence()
    m(torch.randn(4, 256, device=DEVICE), m.begin_step(cache, [c], [4]))  # may take the slots st gave back
    pool = cache.pool.clone()
    with pytest.raises(ValueError, match="step: .*cancelled"):
        m(torch.randn(2, 256, device=DEVICE), st)
    assert torch.equal(cache.pool, pool), "a cancelled step wrote into the pool"
    # a forward pass that failed cancels its step: running it again is refused too
    st = m.begin_step(cache, [a, b], [1, 1])
    with pytest.raises(ValueError, match="x: expected shape"):
        m(torch.randn(3, 256, device=DEVICE), st)
    with pytest.raises(ValueError, match="step: .*cancelled"):
        m(torch.randn(2, 256, device=DEVICE), st)
    # the cache gave the reservation back without the step knowing
    st = m.begin_step(cache, [a, b], [1, 1])
    cache.unreserve([a, b])
    with pytest.raises(ValueError, match=r"step: sequence 0 .*reserved"):
        m(torch.randn(2, 256, device=DEVICE), st)
    st = m.begin_step(cache, [a, b], [1, 1])
    cache.free(b)
    with pytest.raises(ValueError, match=r"step: sequence 1 .*no longer in the cache"):
        m(torch.randn(2, 256, device=DEVICE), st)
    assert torch.equal(cache.pool, pool)
    # a completed step may run again (it rewrites its own tokens, in its own slots: what benchmarks time)
    st = m.begin_step(cache, [a], [1])
    y = m(torch.randn(1, 256, device=DEVICE), st)
    assert y.shape == (1, 256)
    m(torch.randn(1, 256, device=DEVICE), st)


def test_step_refuses_to_write_a_forks_pages():
    """A fork shares its source's pages; a step planned before the fork (or run again after it) would write its
    token into a page the fork holds too, changing the fork's tokens: refused by name (model and runner). A new
    begin_step unshares the page first and runs."""
    for use_runner in (False, True):
        m = tiny_model(backend="torch")
        cache = m.make_cache(32, 4, "bf16")
        a = cache.add_sequence()
        m(torch.randn(3, 256, device=DEVICE), m.begin_step(cache, [a], [3]))
        r = DecodeRunner(m, cache, max_batch=2, use_cuda_graph=False) if use_runner else None
        begin = (lambda: r.begin_step([a], [cache.seq_len(a)])) if r else (lambda: m.begin_step(cache, [a], [1]))
        run = (lambda x, st: r.forward(x, st)) if r else (lambda x, st: m(x, st))
        done = begin()
        run(torch.randn(1, 256, device=DEVICE), done)  # a: 4 tokens, its page full
        b = cache.fork(a)
        pool = cache.pool.clone()
        with pytest.raises(ValueError, match=r"step: sequence 0 shares page \d+, where this step writes"):
            run(torch.randn(1, 256, device=DEVICE), done)  # a completed step run again after the fork
        assert torch.equal(cache.pool, pool), "a step wrote into a page the fork shares"
        if r is None:  # planned before the fork, run after it
            c = cache.add_sequence()
            m(torch.randn(2, 256, device=DEVICE), m.begin_step(cache, [c], [2]))
            st = m.begin_step(cache, [c], [1])
            cache.fork(c)
            pool = cache.pool.clone()
            with pytest.raises(ValueError, match="step: sequence .* shares page"):
                m(torch.randn(1, 256, device=DEVICE), st)
            assert torch.equal(cache.pool, pool)
        run(torch.randn(1, 256, device=DEVICE), begin())  # a new step: its own page
        assert cache.seq_len(a) == 5 and cache.seq_len(b) == 4
        if r:
            r.close()


def test_begin_step_takes_one_id_as_the_cache_does():
    """``begin_step(cache, seq_id, 3)``: one id, as the cache takes one elsewhere (was "'int' object is not
    iterable"); a tuple id is refused by name."""
    m = tiny_model()
    cache = m.make_cache(16, 4, "bf16")
    s = cache.add_sequence()
    st = m.begin_step(cache, s, 3)
    assert st.seq_ids == [s] and st.num_tokens == [3]
    m(torch.randn(3, 256, device=DEVICE), st)
    st = m.begin_step(cache, s, 1)
    assert st.seq_ids == [s] and st.decode_only
    m(torch.randn(1, 256, device=DEVICE), st)
    assert cache.seq_len(s) == 4
    r = DecodeRunner(m, cache, max_batch=2, use_cuda_graph=False)
    assert r.step(s, 1, torch.randn(1, 256, device=DEVICE)).shape == (1, 256)
    r.close()
    with pytest.raises(TypeError, match="seq_id: expected an int or a str, got a tuple"):
        m.begin_step(cache, [(s, 1)], 1)


def test_runner_refuses_a_cancelled_step():
    m = tiny_model(backend="torch")
    cache = m.make_cache(32, 4, "bf16")
    r = DecodeRunner(m, cache, max_batch=4, use_cuda_graph=False)
    ids = [cache.add_sequence() for _ in range(2)]
    r.step(ids, [3, 3], torch.randn(6, 256, device=DEVICE))
    prefix = [cache.seq_len(s) for s in ids]
    st = r.begin_step(ids, prefix)
    st.cancel()
    other = cache.add_sequence()
    r.step([other], [5], torch.randn(5, 256, device=DEVICE))
    pool = cache.pool.clone()
    with pytest.raises(ValueError, match="step: .*cancelled"):
        r.forward(torch.randn(2, 256, device=DEVICE), st)
    assert torch.equal(cache.pool, pool), "a cancelled step wrote into the pool"
    r.step(ids, [1, 1], torch.randn(2, 256, device=DEVICE))  # the runner still works
    r.close()


def test_unreserve_frees_only_the_new_pages():
    cache = PagedMLACache(1, 8, 4, "bf16", head_dim_ckv=128, head_dim_kpe=16)
    s = cache.add_sequence(num_tokens=3)
    free = cache.num_free_pages
    cache.reserve([s], [6])   # 9 tokens: two more pages
    assert cache.num_free_pages == free - 2
    cache.unreserve([s])
    assert cache.seq_len(s) == 3 and len(cache.pages(s)) == 1 and cache.num_free_pages == free
    with pytest.raises(KeyError):
        cache.unreserve([s, 99])
    assert cache.seq_len(s) == 3  # all ids checked before anything changes


# -- the runner: buckets and plans (CPU), graphs (CUDA) -----------------------------------------------------------
def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(b, batch_buckets(48)) for b in (1, 3, 5, 17, 33, 48)] == [1, 4, 8, 32, 48, 48]
    with pytest.raises(ValueError, match="max_batch"):
        bucket_for(49, batch_buckets(48))
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


def run_schedule(step_fn, cache, D, seed=0):
    """Three prompts, decode steps where one leaves and one joins (its prefill runs eagerly): outputs per step."""
    g = torch.Generator().manual_seed(seed)
    ids = [cache.add_sequence() for _ in range(3)]
    outs = [step_fn(ids, [5, 2, 9], torch.randn(16, D, generator=g).to(DEVICE))]
    for t in range(7):
        if t == 2:
            cache.free(ids.pop(1))
        if t == 4:
            ids.append(cache.add_sequence())
            counts = [1, 1, 3]
        else:
            counts = [1] * len(ids)
        outs.append(step_fn(ids, counts, torch.randn(sum(counts), D, generator=g).to(DEVICE)))
    return outs, [cache.pages(i) for i in ids]


@pytest.mark.parametrize("page_size,kv_format", [(1, "fp8_e4m3"), (4, "bf16"), (3, "fp8_e4m3_group")])
def test_runner_eager_matches_model_steps(page_size, kv_format):
    """The runner's padded, pre-planned decode step (graphs off) gives the model's outputs; its block table rows
    are the cache's page tables; rows are filled once per sequence, not per step; closing frees every page."""
    m = tiny_model(backend="torch")

    def model_step(ids, counts, x):
        return m(x, m.begin_step(cache_a, ids, counts))
    cache_a = m.make_cache(96, page_size, kv_format)
    want, pages_a = run_schedule(model_step, cache_a, 256)

    cache_b = m.make_cache(96, page_size, kv_format)
    r = DecodeRunner(m, cache_b, max_batch=4, use_cuda_graph=False)
    got, _ = run_schedule(r.step, cache_b, 256)
    for i, (a, b) in enumerate(zip(got, want)):
        # bf16 attention inputs: a padded batch may round a product the other way (measured <= 6e-4)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-3, msg=f"step {i}")
    assert r.stats["graph_steps"] == 0 and r.stats["eager_steps"] == 8  # the padded path ran eagerly
    live = [s for s in cache_b.sequences if s != r.pad_id]
    for s in live:
        row, _, n = r._rows[s]
        n_pages = -(-cache_b.seq_len(s) // page_size)
        assert n == cache_b.seq_len(s)
        assert r.table[row, :n_pages].tolist() == cache_b.pages(s)[:n_pages]
    assert r.stats["row_fills"] == 4  # 3 prompts + 1 newcomer, not one per decode step
    for s in live:
        cache_b.free(s)
    r.close()
    assert cache_b.num_free_pages == cache_b.num_pages


def test_runner_failed_step_gives_the_reservation_back():
    m = tiny_model(backend="torch")
    cache = m.make_cache(32, 4, "fp8_e4m3")
    r = DecodeRunner(m, cache, max_batch=4, use_cuda_graph=False)
    ids = [cache.add_sequence() for _ in range(3)]
    r.step(ids, [4, 4, 2], torch.randn(10, 256, device=DEVICE))
    r.step(ids, [1, 1, 1], torch.randn(3, 256, device=DEVICE))
    before, fills = cache_state(cache), r.stats["row_fills"]
    with pytest.raises(ValueError, match="x: expected shape"):
        r.step(ids, [1, 1, 1], torch.randn(2, 256, device=DEVICE))
    assert cache_state(cache) == before
    r.step(ids, [1, 1, 1], torch.randn(3, 256, device=DEVICE))
    assert r.stats["row_fills"] == fills == 3  # the rows were rewound too: no refill after the failed step
    with pytest.raises(ValueError, match="max_batch"):
        DecodeRunner(m, cache, max_batch=0)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="use_cuda_graph"):
            DecodeRunner(m, cache, use_cuda_graph=True)


@needs_triton
def test_fused_decode_step_matches_torch_ops():
    """A decode step with the fused kernels (interpreter on the CPU) against the same step in torch ops."""
    outs = {}
    for fused in (False, True):
        m = tiny_model(backend="torch", fused=fused)
        cache = m.make_cache(32, 4, "fp8_e4m3")
        g = torch.Generator().manual_seed(1)
        ids = [cache.add_sequence() for _ in range(2)]
        m(torch.randn(7, 256, generator=g).to(DEVICE), m.begin_step(cache, ids, [3, 4]))
        st = m.begin_step(cache, ids, [1, 1])
        assert st.fused == fused
        outs[fused] = (m(torch.randn(2, 256, generator=g).to(DEVICE), st), cache.pool.float().clone())
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=2e-2, atol=2e-2)
    d = (outs[True][1] - outs[False][1]).abs()
    assert (d > 0).float().mean() < 0.02  # the same FP8 bytes but for a rare rounding flip


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 64])
def test_runner_graphs_match_eager_steps(page_size):
    m = DeepseekMLAModel.random("tiny", seed=3, dtype=torch.bfloat16, device="cuda")
    cache_a = m.make_cache(400, page_size, "fp8_e4m3")
    want, _ = run_schedule(lambda ids, counts, x: m(x.bfloat16(), m.begin_step(cache_a, ids, counts)),
                           cache_a, 256)
    cache_b = m.make_cache(400, page_size, "fp8_e4m3")
    r = DecodeRunner(m, cache_b, max_batch=4)
    got, _ = run_schedule(lambda ids, counts, x: r.step(ids, counts, x.bfloat16()), cache_b, 256)
    assert r.stats["graph_steps"] == 6 and r.stats["captures"] >= 2
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"step {i}")


@needs_triton
def test_runner_plans_into_graph_buffers(monkeypatch):
    """The graph path's plan on the Triton backend's fixed CUDA-graph buffers (padded buckets, re-plans with other
    lengths), run without capture (on the CPU: the interpreter): the model's outputs."""
    m = tiny_model(backend="triton")

    def model_step(ids, counts, x):
        return m(x, m.begin_step(cache_a, ids, counts))
    cache_a = m.make_cache(96, 4, "fp8_e4m3")
    want, _ = run_schedule(model_step, cache_a, 256)
    cache_b = m.make_cache(96, 4, "fp8_e4m3")
    r = DecodeRunner(m, cache_b, max_batch=4, use_cuda_graph=False)
    r.use_cuda_graph = True                              # graph-mode attention buffers...
    monkeypatch.setattr(r, "_capture", lambda g: None)   # ...but no capture: the bucket's step runs as is
    got, _ = run_schedule(r.step, cache_b, 256)
    assert all(g.attn.backend == "triton" and g.attn._use_cuda_graph for g in r._graphs.values())
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-3, msg=f"step {i}")
