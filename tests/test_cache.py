"""PagedMLACache: quantize-on-write round trip, views, memory budget, plan inputs, fork, and allocator properties."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from conftest import DEVICE
from fp8mla import FORMATS, MLAPagedAttention, OutOfPagesError, PagedMLACache
from fp8mla.formats import expand_group_scales
from fp8mla.reference import gather_sequence_kv, mla_reference
from fp8mla.testing import assert_close

FORMAT_NAMES = list(FORMATS)
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float8_e4m3fn: 2.0 ** -4,
     torch.float8_e5m2: 2.0 ** -3}  # unit roundoff of each storage dtype
TINY = {torch.bfloat16: 0.0, torch.float16: 2.0 ** -24, torch.float8_e4m3fn: 2.0 ** -9,
        torch.float8_e5m2: 2.0 ** -16}  # smallest subnormal


def _read(cache: PagedMLACache, layer: int, seq_id):
    """A sequence's tokens of one layer, dequantized in float64: (c_kv [L, Dc], k_pe [L, Dk])."""
    pages = torch.tensor(cache.pages(seq_id), dtype=torch.int64)
    return gather_sequence_kv(cache.ckv_cache(layer), cache.kpe_cache(layer), pages, cache.seq_len(seq_id),
                              ckv_scale=cache.ckv_scale, kpe_scale=cache.kpe_scale,
                              ckv_scale_arr=cache.ckv_scale_arr(layer))


def _scales(kv_format, ckv_scale, kpe_scale) -> dict:
    """The per-tensor scales ``kv_format`` takes (the cache refuses the others, see test_unused_scale_is_refused)."""
    fmt = FORMATS[kv_format]
    return dict(ckv_scale=ckv_scale if fmt.scale_kind == "tensor" else 1.0,
                kpe_scale=kpe_scale if fmt.is_fp8 else 1.0)


def _expected(fmt, x: torch.Tensor, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """What reading ``x`` back may give: (saturated x, allowed abs error) for stored = x / scale."""
    m = fmt.max_value * scale
    sat = x.double().clamp(-m, m)
    return sat, U[fmt.storage_dtype] * sat.abs() + TINY[fmt.storage_dtype] / 2 * scale


# -- round trip ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_append_read_back(kv_format, page_size):
    fmt = FORMATS[kv_format]
    cache = PagedMLACache(2, 64, page_size, kv_format, device=DEVICE, **_scales(kv_format, 0.5, 0.25))
    g = torch.Generator().manual_seed(7)
    lens = [5, 17, 1]
    ids = [cache.add_sequence() for _ in lens]
    data = {i: {layer: ([], []) for layer in range(2)} for i in ids}  # original c_kv / k_pe rows
    # A prefill of each sequence, then three decode steps of all of them at once.
    steps = [(ids[k:k + 1], [lens[k]]) for k in range(3)] + [(ids, [1, 1, 1])] * 3
    for step, (seqs, counts) in enumerate(steps):
        cache.reserve(seqs, counts)
        T = sum(counts)
        for layer in range(2):
            c = torch.randn(T, 512, generator=g, dtype=torch.float64) * 3
            k = torch.randn(T, 64, generator=g, dtype=torch.float64)
            if step == 1:  # values far past the FP8 (and fp16) range, and +-inf: they saturate
                c[0, :4] = torch.tensor([1e6, -1e6, math.inf, -math.inf])
                k[0, :2] = torch.tensor([1e5, -math.inf])
            cache.append(layer, seqs, c.to(DEVICE), k.to(DEVICE))
            start = 0
            for s, n in zip(seqs, counts):
                data[s][layer][0].append(c[start:start + n])
                data[s][layer][1].append(k[start:start + n])
                start += n
    for s in ids:
        for layer in range(2):
            ckv, kpe = (v.cpu() for v in _read(cache, layer, s))
            c, k = torch.cat(data[s][layer][0]), torch.cat(data[s][layer][1])
            if fmt.scale_kind == "group":
                amax = torch.where(torch.isfinite(c), c, 0).abs().reshape(-1, 4, 128).amax(-1)
                # each group: scale = amax of its finite values / 448; +-inf saturates to +-amax
                cs = expand_group_scales(amax / fmt.max_value, 512)
                top = expand_group_scales(amax, 512)
                want_c = torch.maximum(torch.minimum(c, top), -top)
                tol_c = U[fmt.storage_dtype] * want_c.abs() + cs * TINY[fmt.storage_dtype]
            else:
                want_c, tol_c = _expected(fmt, c, cache.ckv_scale)
            want_k, tol_k = _expected(fmt, k, cache.kpe_scale)
            assert ckv.shape == c.shape and kpe.shape == k.shape
            assert torch.isfinite(ckv).all() and torch.isfinite(kpe).all(), "saturation must not make inf/NaN"
            assert ((ckv - want_c).abs() <= tol_c).all(), (s, layer, (ckv - want_c).abs().max())
            assert ((kpe - want_k).abs() <= tol_k).all(), (s, layer, (kpe - want_k).abs().max())


@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
def test_scales_of_the_cache(kv_format):
    """Per-tensor scales only where the format has them; group scales per token and 128 channels."""
    fmt = FORMATS[kv_format]
    cache = PagedMLACache(1, 4, 16, kv_format, device=DEVICE, **_scales(kv_format, 0.5, 0.25))
    assert cache.ckv_scale == (0.5 if fmt.scale_kind == "tensor" else 1.0)
    assert cache.kpe_scale == (0.25 if fmt.is_fp8 else 1.0)
    assert cache.bytes_per_token == fmt.bytes_per_token()
    if fmt.scale_kind == "group":
        assert cache.ckv_scale_arr(0).shape == (4, 16, 4) and cache.ckv_scale_arr(0).dtype == torch.float32
        s = cache.add_sequence(num_tokens=2)
        c = torch.zeros(2, 512, device=DEVICE)
        c[0, 0], c[0, 200], c[1, 511] = 448.0 * 3, -448.0 * 0.5, 448.0 * 2
        cache.append(0, [s], c, torch.zeros(2, 64, device=DEVICE))
        p = cache.pages(s)[0]
        torch.testing.assert_close(cache.ckv_scale_arr(0)[p, :2].cpu(),
                                   torch.tensor([[3.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 2.0]]))
        assert cache.run_inputs(0)["ckv_scale_arr"].data_ptr() == cache.scale_arr.data_ptr()
    else:
        assert cache.ckv_scale_arr(0) is None and cache.run_inputs(0)["ckv_scale_arr"] is None


# -- views -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "bf16", "fp8_e4m3_group"])
def test_views_are_views(kv_format):
    cache = PagedMLACache(3, 5, 16, kv_format, device=DEVICE)
    pool = cache.pool
    base, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    row = pool.shape[-1] * pool.element_size()
    for layer in range(3):
        ckv, kpe = cache.ckv_cache(layer), cache.kpe_cache(layer)
        assert ckv.shape == (5, 16, 512) and kpe.shape == (5, 16, 64)
        assert ckv.dtype == kpe.dtype == FORMATS[kv_format].storage_dtype
        assert ckv.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()  # the same memory
        assert kpe.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
        layer_start = base + layer * 5 * 16 * row
        assert ckv.data_ptr() == layer_start and kpe.data_ptr() == layer_start + 512 * pool.element_size()
        assert base <= ckv.data_ptr() < end and base <= kpe.data_ptr() < end
        assert ckv.stride() == (16 * 576, 576, 1) and kpe.stride() == (16 * 576, 576, 1)
        if cache.scale_arr is not None:
            sa = cache.ckv_scale_arr(layer)
            assert sa.untyped_storage().data_ptr() == cache.scale_arr.untyped_storage().data_ptr()
    # Writing through the view changes the pool (and the other way round).
    cache.ckv_cache(1)[2, 3, 7] = 1.0
    assert float(pool[1, 2, 3, 7]) == 1.0
    pool[2, 4, 0, 512 + 5] = 2.0
    assert float(cache.kpe_cache(2)[4, 0, 5]) == 2.0
    ri = cache.run_inputs(1)
    assert ri["ckv_cache"].data_ptr() == cache.ckv_cache(1).data_ptr()
    assert ri["kpe_cache"].data_ptr() == cache.kpe_cache(1).data_ptr()


# -- memory budget -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
def test_from_memory_budget(kv_format):
    fmt = FORMATS[kv_format]
    per_page = 2 * 16 * fmt.bytes_per_token()  # 2 layers x 16 tokens
    for budget, pages in ((per_page * 7, 7), (per_page * 7 - 1, 6), (per_page * 7 + per_page - 1, 7),
                          (per_page, 1)):
        cache = PagedMLACache.from_memory_budget(budget, num_layers=2, page_size=16, kv_format=kv_format,
                                                 device=DEVICE)
        assert cache.num_pages == pages and cache.num_free_pages == pages
        assert cache.memory_bytes() == pages * per_page <= budget
        assert cache.format is fmt and cache.num_layers == 2 and cache.page_size == 16
    small = PagedMLACache.from_memory_budget(10_000, 1, 1, kv_format, head_dim_ckv=128, head_dim_kpe=16,
                                             device=DEVICE)
    assert small.num_pages == 10_000 // fmt.bytes_per_token(128, 16)
    assert small.pool.shape == (1, small.num_pages, 1, 144)


# -- plan_inputs -> MLAPagedAttention --------------------------------------------------------------------------
# Measured 4.5e-3 (bf16), 3.4e-3 (fp16), 4.9e-2 (e4m3, per-tensor and group), 9.6e-2 (e5m2): 3 and 2 mantissa bits.
ORIGINAL_REL_L2 = {"bf16": 1e-2, "fp16": 1e-2, "fp8_e4m3": 8e-2, "fp8_e4m3_group": 8e-2, "fp8_e5m2": 1.6e-1}


@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_plan_inputs_drive_attention(backend, kv_format, page_size, case_seed):
    g = torch.Generator().manual_seed(case_seed)
    H = 16
    cache = PagedMLACache(2, 96, page_size, kv_format, device=DEVICE, **_scales(kv_format, 0.02, 0.01))
    lens = [33, 0, 17, 1]
    ids = [cache.add_sequence() for _ in lens]
    orig = {}
    for s, n in zip(ids, lens):   # prefill, one sequence at a time
        cache.reserve(s, n)
        c, k = torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g) * 0.5
        for layer in range(2):
            cache.append(layer, [s], (c * (layer + 1)).to(DEVICE), (k * (layer + 1)).to(DEVICE))
        orig[s] = (c, k)
    cache.reserve(ids, 3)          # then a 3-token step for the batch
    c, k = torch.randn(12, 512, generator=g), torch.randn(12, 64, generator=g) * 0.5
    for layer in range(2):
        cache.append(layer, ids, (c * (layer + 1)).to(DEVICE), (k * (layer + 1)).to(DEVICE))
    for j, s in enumerate(ids):
        orig[s] = (torch.cat([orig[s][0], c[3 * j:3 * j + 3]]), torch.cat([orig[s][1], k[3 * j:3 * j + 3]]))

    qo_lens = [3, 1, 3, 2]
    pi = cache.plan_inputs(ids, qo_lens)
    assert pi["kv_len_arr"].tolist() == [n + 3 for n in lens]
    assert pi["qo_indptr"].tolist() == [0, 3, 4, 7, 9]
    assert pi["kv_indices"].tolist() == sum((cache.pages(s) for s in ids), [])
    assert pi["kv_data_type"] == kv_format and pi["page_size"] == page_size
    assert all(pi[n].dtype == torch.int32 for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"))
    attn = MLAPagedAttention(backend=backend)
    attn.plan(**pi, num_heads=H, causal=True, sm_scale=192 ** -0.5, q_data_type=torch.bfloat16)
    n = sum(qo_lens)
    q_nope = torch.randn(n, H, 512, generator=g).to(DEVICE, torch.bfloat16)
    q_pe = torch.randn(n, H, 64, generator=g).to(DEVICE, torch.bfloat16)
    for layer in range(2):
        ri = cache.run_inputs(layer)
        out, lse = attn.run(q_nope, q_pe, **ri, return_lse=True)
        ref, ref_lse = mla_reference(q_nope, q_pe, ri["ckv_cache"], ri["kpe_cache"], pi["qo_indptr"],
                                     pi["kv_indptr"], pi["kv_indices"], pi["kv_len_arr"], sm_scale=192 ** -0.5,
                                     causal=True, ckv_scale=ri["ckv_scale"], kpe_scale=ri["kpe_scale"],
                                     ckv_scale_arr=ri["ckv_scale_arr"])
        assert_close(out, ref, 1e-2, what=f"layer {layer} vs reference on the dequantized cache")
        assert_close(lse, ref_lse, 1e-3, what=f"layer {layer} lse")
        # Against the original (unquantized) values: bounds the quantization error of the format.
        ckv_o = torch.zeros(96 * page_size, 512, dtype=torch.float64)
        kpe_o = torch.zeros(96 * page_size, 64, dtype=torch.float64)
        for s in ids:
            pages = cache.pages(s)
            slots = [pages[t // page_size] * page_size + t % page_size for t in range(cache.seq_len(s))]
            ckv_o[slots] = orig[s][0].double() * (layer + 1)
            kpe_o[slots] = orig[s][1].double() * (layer + 1)
        ref_o, _ = mla_reference(q_nope.cpu(), q_pe.cpu(), ckv_o.view(96, page_size, 512),
                                 kpe_o.view(96, page_size, 64), pi["qo_indptr"].cpu(), pi["kv_indptr"].cpu(),
                                 pi["kv_indices"].cpu(), pi["kv_len_arr"].cpu(), sm_scale=192 ** -0.5,
                                 causal=True)
        assert_close(out, ref_o, ORIGINAL_REL_L2[kv_format], what=f"layer {layer} vs the original values")


def test_plan_inputs_default_decode():
    cache = PagedMLACache(1, 8, 4, device=DEVICE)
    a, b = cache.add_sequence(num_tokens=9), cache.add_sequence(num_tokens=4)
    pi = cache.plan_inputs([b, a])
    assert pi["qo_indptr"].tolist() == [0, 1, 2]
    assert pi["kv_indptr"].tolist() == [0, 1, 4]
    assert pi["kv_len_arr"].tolist() == [4, 9]
    assert pi["kv_indices"].tolist() == cache.pages(b) + cache.pages(a)
    assert pi["kv_indices"].device == cache.pool.device


# -- fork --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format", ["fp16", "fp8_e4m3_group"])
def test_fork_copy_on_write(kv_format):
    page = 16
    cache = PagedMLACache(2, 8, page, kv_format, device=DEVICE)
    g = torch.Generator().manual_seed(11)

    def write(seq, n):
        cache.reserve(seq, n)
        rows = [torch.randn(n, 512, generator=g).to(DEVICE) for _ in range(2)]
        for layer in range(2):
            cache.append(layer, [seq], rows[layer], torch.randn(n, 64, generator=g).to(DEVICE))

    a = cache.add_sequence()
    write(a, 20)                                   # pages: one full, one with 4 tokens
    before = [_read(cache, layer, a) for layer in range(2)]
    b = cache.fork(a)
    assert cache.pages(b) == cache.pages(a) and cache.seq_len(b) == 20
    assert cache.num_free_pages == 6               # forking takes no page
    write(b, 1)                                    # b's partial last page is copied before its write
    assert cache.pages(b)[0] == cache.pages(a)[0]  # the full prefix page stays shared
    assert cache.pages(b)[1] != cache.pages(a)[1]
    assert cache.num_free_pages == 5
    for layer in range(2):
        ca, ka = _read(cache, layer, a)
        assert torch.equal(ca, before[layer][0]) and torch.equal(ka, before[layer][1]), "b's write changed a"
        cb, kb = _read(cache, layer, b)
        assert torch.equal(cb[:20], ca) and torch.equal(kb[:20], ka), "the copy lost the shared prefix"
    b_before = [_read(cache, layer, b) for layer in range(2)]
    write(a, 1)                                    # a is now the only owner of its page: written in place
    assert cache.num_free_pages == 5
    for layer in range(2):
        cb, kb = _read(cache, layer, b)
        assert torch.equal(cb, b_before[layer][0]) and torch.equal(kb, b_before[layer][1]), "a's write changed b"
        ca, _ = _read(cache, layer, a)
        assert not torch.equal(ca[20], cb[20])
    # A fork at a page boundary shares every page and copies nothing.
    c = cache.fork(b)
    write(b, 11)                                   # b fills its page to 32 tokens
    d = cache.fork(b)
    write(d, 1)
    assert cache.pages(d)[:2] == cache.pages(b) and len(cache.pages(d)) == 3
    # Freeing returns a page only when no sequence holds it any more.
    shared = cache.pages(a)[0]
    for s in (a, b, c):
        cache.free(s)
        assert shared not in cache._free
    cache.free(d)
    assert cache.num_free_pages == 8 and sorted(cache._free) == list(range(8))


def test_fork_then_append_of_the_source_is_refused():
    """Appending the source's old pending tokens after a fork would write pages the fork reads."""
    cache = PagedMLACache(1, 4, 16, "fp16", device=DEVICE)
    a = cache.add_sequence(num_tokens=5)
    cache.append(0, [a], torch.ones(5, 512, device=DEVICE), torch.ones(5, 64, device=DEVICE))
    b = cache.fork(a)
    with pytest.raises(ValueError, match="c_kv"):
        cache.append(0, [a], torch.full((5, 512), 2.0, device=DEVICE), torch.ones(5, 64, device=DEVICE))
    assert (_read(cache, 0, b)[0] == 1).all()


def test_full_pool_leaves_state_unchanged_with_fork():
    """A partly filled shared page needs a copy: counted before anything changes."""
    cache = PagedMLACache(1, 3, 4, "fp16", device=DEVICE)
    a = cache.add_sequence(num_tokens=6)      # 2 pages, the second half full
    b = cache.fork(a)
    cache.add_sequence(num_tokens=4)          # the last free page
    state = (cache.pages(a), cache.pages(b), cache.seq_len(a), cache.seq_len(b), list(cache._refs))
    with pytest.raises(OutOfPagesError):
        cache.reserve(b, 1)                    # needs a copy of the shared page
    assert (cache.pages(a), cache.pages(b), cache.seq_len(a), cache.seq_len(b), list(cache._refs)) == state
    assert cache.num_free_pages == 0
    cache.reserve(b, 0)                        # nothing to write: no copy, no error
    cache.free(a)
    cache.reserve(b, 2)                        # b is the last owner now: writes in place
    assert cache.pages(b) == state[1] and cache.num_free_pages == 0


# -- allocator properties ------------------------------------------------------------------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """Random add / extend / fork / free against a model of each sequence's token values.

    Every written token gets a distinct value (its c_kv row all equal to the value, its k_pe row its negation),
    so reading every sequence back after every step shows any write that landed in another sequence's slot.
    """

    FORMAT = "fp16"

    @initialize(page_size=st.sampled_from([1, 3, 8]), num_pages=st.integers(1, 16))
    def setup(self, page_size, num_pages):
        # kpe_scale 8: token values up to 3584 fit e4m3's range in the group machine (fp16 takes no scale)
        self.cache = PagedMLACache(1, num_pages, page_size, self.FORMAT, head_dim_ckv=128, head_dim_kpe=16,
                                   device=DEVICE, **_scales(self.FORMAT, 1.0, 8.0))
        self.model: dict = {}     # seq id -> list of token values
        self.next_value = 1.0

    # -- helpers --
    def _pages_needed(self, seq, n, copies: dict) -> int:
        ps, L = self.cache.page_size, len(self.model[seq])
        need = -(-(L + n) // ps) - -(-L // ps)
        if n and L % ps:
            last = self.cache.pages(seq)[-1]
            owners = sum(last in self.cache.pages(s) for s in self.model) - copies.get(last, 0)
            if owners > 1:
                copies[last] = copies.get(last, 0) + 1
                need += 1
        return need

    def _snapshot(self):
        c = self.cache
        return ({s: (c.pages(s), c.seq_len(s)) for s in self.model}, c.num_free_pages, list(c._refs),
                c.pool.view(torch.uint8).clone(), None if c.scale_arr is None else c.scale_arr.clone())

    def _write(self, seqs, counts):
        values = []
        for s, n in zip(seqs, counts):
            vals = [self.next_value + i for i in range(n)]
            self.next_value += n
            values += vals
            self.model[s] += vals
        v = torch.tensor(values, dtype=torch.float32, device=DEVICE)
        self.cache.append(0, seqs, v[:, None].expand(-1, 128).contiguous(), -v[:, None].expand(-1, 16).contiguous())

    def _reserve(self, seqs, counts, fresh=None):
        copies = {}
        need = sum(self._pages_needed(s, n, copies) for s, n in zip(seqs, counts))
        if fresh is not None:
            need += -(-fresh // self.cache.page_size)
        before = self._snapshot()
        if need > self.cache.num_free_pages:
            with pytest.raises(OutOfPagesError):
                if fresh is not None:
                    self.cache.add_sequence(num_tokens=fresh)
                else:
                    self.cache.reserve(seqs, counts)
            after = self._snapshot()
            assert after[:3] == before[:3], "a refused request changed the allocator"
            assert torch.equal(after[3], before[3]), "a refused request changed the pool"
            assert before[4] is None or torch.equal(after[4], before[4]), "a refused request changed the scales"
            return None
        if fresh is not None:
            s = self.cache.add_sequence(num_tokens=fresh)
            assert s not in self.model
            self.model[s] = []
            seqs = [s]
        else:
            self.cache.reserve(seqs, counts)
        assert self.cache.num_free_pages == before[1] - need, "allocated other than the pages needed"
        return seqs

    # -- rules --
    @rule(n=st.integers(0, 12))
    def add(self, n):
        seqs = self._reserve([], [], fresh=n)
        if seqs:
            self._write(seqs, [n])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def extend(self, data):
        live = sorted(self.model)
        seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        counts = data.draw(st.lists(st.integers(0, 5), min_size=len(seqs), max_size=len(seqs)))
        if self._reserve(seqs, counts) is not None:
            self._write(seqs, counts)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.model)))
        free = self.cache.num_free_pages
        new = self.cache.fork(src)
        assert new not in self.model and self.cache.num_free_pages == free
        self.model[new] = list(self.model[src])
        if data.draw(st.booleans(), label="write after fork"):  # copy-on-write of a shared partial page
            seqs = data.draw(st.sampled_from([[src], [new], [src, new], [new, src]]))
            counts = data.draw(st.lists(st.integers(1, 4), min_size=len(seqs), max_size=len(seqs)))
            if self._reserve(seqs, counts) is not None:
                self._write(seqs, counts)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        pages = self.cache.pages(s)
        others = {p for o in self.model if o != s for p in self.cache.pages(o)}
        free = self.cache.num_free_pages
        self.cache.free(s)
        del self.model[s]
        assert self.cache.num_free_pages == free + len(set(pages) - others), "free must return unshared pages"
        assert s not in self.cache.sequences

    # -- invariants --
    @invariant()
    def pages_and_refcounts(self):
        c = self.cache
        if not hasattr(self, "model"):
            return
        assert sorted(c.sequences) == sorted(self.model)
        owners: dict = {}
        for s in self.model:
            pages = c.pages(s)
            assert c.seq_len(s) == len(self.model[s])
            assert len(pages) == -(-len(self.model[s]) // c.page_size), "pages beyond the tokens"
            assert len(set(pages)) == len(pages), "a page twice in one sequence"
            for i, p in enumerate(pages):
                owners.setdefault(p, []).append((s, i))
        free = list(c._free)
        assert len(set(free)) == len(free), "a page twice in the free list"
        assert not set(free) & set(owners), "a free page is still owned"
        assert set(free) | set(owners) == set(range(c.num_pages)), "a page got lost"
        assert c.num_free_pages == len(free)
        for p in range(c.num_pages):
            assert c._refs[p] == len(owners.get(p, [])), f"refcount of page {p}"
        # A page held by several sequences holds the same tokens for each: a shared prefix, at the same place.
        for p, held in owners.items():
            if len(held) > 1:
                assert len({i for _, i in held}) == 1, f"page {p} shared at different positions"
                i = held[0][1]
                sl = slice(i * c.page_size, (i + 1) * c.page_size)
                assert len({tuple(self.model[s][sl]) for s, _ in held}) == 1, f"page {p} shared by different data"

    @invariant()
    def every_token_reads_back(self):
        if not hasattr(self, "model"):
            return
        c, ps = self.cache, self.cache.page_size
        ckv = c.ckv_cache(0).reshape(-1, 128)
        kpe = c.kpe_cache(0).reshape(-1, 16)
        sa = None if c.ckv_scale_arr(0) is None else c.ckv_scale_arr(0).reshape(-1, 1)
        for s, values in self.model.items():
            if not values:
                continue
            pages = c.pages(s)
            slots = torch.tensor([pages[t // ps] * ps + t % ps for t in range(len(values))])
            got_c = ckv[slots].float().cpu()
            if sa is not None:
                got_c = got_c * sa[slots].cpu()
            want = torch.tensor(values)
            assert torch.allclose(got_c, want[:, None].expand_as(got_c), rtol=1e-3, atol=0), \
                f"sequence {s}: c_kv read back {got_c[:, 0].tolist()} != {values}"
            assert torch.allclose(kpe[slots].float().cpu() * c.kpe_scale, -want[:, None].expand(-1, 16), rtol=0.07)


class GroupAllocatorMachine(AllocatorMachine):
    """The same with group scales, so copy-on-write must copy ``scale_arr`` with the page (values up to 2048
    are not exact in fp8, but the group scale is: stored 448 x scale amax / 448)."""

    FORMAT = "fp8_e4m3_group"


@pytest.mark.parametrize("machine", [AllocatorMachine, GroupAllocatorMachine], ids=["fp16", "fp8_e4m3_group"])
def test_allocator_properties(machine):
    run_state_machine_as_test(machine, settings=settings(max_examples=100, stateful_step_count=30))


# -- bad arguments: an error naming the argument, what was expected and what came ------------------------------
@pytest.mark.parametrize("kv_format", ["fp8_e4m3_group", "bf16", "fp16"])
def test_unused_scale_is_refused(kv_format):
    """ckv_scale used to be dropped without a word by the group and 16-bit formats (kpe_scale by the 16-bit
    ones): a caller meaning to scale the values got unscaled ones. 1.0, the identity, stays accepted."""
    fmt = FORMATS[kv_format]
    with pytest.raises(ValueError, match=rf"^ckv_scale: the {kv_format} format takes no per-tensor .* got 0.5"):
        PagedMLACache(1, 4, 16, kv_format, ckv_scale=0.5)
    with pytest.raises(ValueError, match=r"^ckv_scale: .*expected 1.0 \(the default\), got 2.0"):
        PagedMLACache.from_memory_budget(10**6, 1, 16, kv_format, ckv_scale=2.0)
    if not fmt.is_fp8:
        with pytest.raises(ValueError, match=rf"^kpe_scale: the {kv_format} format takes no per-tensor"):
            PagedMLACache(1, 4, 16, kv_format, kpe_scale=0.25)
        with pytest.raises(ValueError, match=r"^kpe_scale:"):
            PagedMLACache.from_memory_budget(10**6, 1, 16, kv_format, kpe_scale=0.25)
    cache = PagedMLACache(1, 4, 16, kv_format, ckv_scale=1.0, kpe_scale=1.0)
    assert cache.ckv_scale == cache.kpe_scale == 1.0


def test_reserve_returns_the_new_slots_and_extend_is_gone():
    """``reserve`` gives the reserved slots in order (a sequence's own pages first, then new pages); the old alias
    ``extend`` no longer exists (one name for one operation)."""
    cache = PagedMLACache(1, 8, 4)
    s, t = cache.add_sequence(), cache.add_sequence(num_tokens=3)
    assert cache.reserve([s, t], [5, 2]).tolist() == [4, 5, 6, 7, 8, 3, 12]  # t holds page 0
    assert cache.reserve(s, 1).tolist() == [9]
    assert not hasattr(cache, "extend")


@pytest.mark.parametrize("ids, what", [({0, 1}, "set"), (frozenset([0]), "frozenset"), ({0: 1}, "dict")])
def test_seq_ids_without_an_order_are_refused(ids, what):
    """A set used to reach the sequence table as one unhashable id (``unhashable type: 'set'``)."""
    cache = PagedMLACache(1, 8, 4)
    cache.add_sequence(), cache.add_sequence()
    for call in (lambda: cache.reserve(ids, 1), lambda: cache.plan_inputs(ids),
                 lambda: cache.pending_slots(ids)):
        with pytest.raises(TypeError, match=rf"^seq_ids: expected one id or a list or tuple of ids .* got a {what}$"):
            call()
    with pytest.raises(TypeError, match=r"^seq_id: expected a hashable id .* got a list: \[0\]"):
        cache.reserve([[0], 1], 1)
    with pytest.raises(TypeError, match=r"^seq_id: expected a hashable id"):
        cache.add_sequence([3])
    assert cache.seq_len(0) == cache.seq_len(1) == 0 and cache.num_free_pages == 8


def test_plan_inputs_takes_one_id_like_the_other_methods():
    cache = PagedMLACache(1, 8, 4)
    a = cache.add_sequence(num_tokens=6)
    one, listed = cache.plan_inputs(a), cache.plan_inputs([a])
    assert one.keys() == listed.keys()
    for k in one:
        assert (torch.equal(one[k], listed[k]) if isinstance(one[k], torch.Tensor) else one[k] == listed[k]), k
    assert cache.plan_inputs(torch.tensor(a))["kv_len_arr"].tolist() == [6]
    b = cache.add_sequence(num_tokens=2)
    for ordered in (torch.tensor([b, a]), (i for i in (b, a)), {b: 0, a: 0}.keys(), range(b, a - 1, -1)):
        assert cache.plan_inputs(ordered)["kv_len_arr"].tolist() == [2, 6]
    assert cache.plan_inputs([a], 3)["qo_indptr"].tolist() == [0, 3]
    with pytest.raises(ValueError, match=r"^qo_lens: expected non-negative ints, got -1"):
        cache.plan_inputs([a], [-1])
    with pytest.raises(TypeError, match=r"^qo_lens: expected an int or a list"):
        cache.plan_inputs([a], "1")


@pytest.mark.parametrize("budget, exc, msg", [
    (math.nan, ValueError, "expected a positive finite number of bytes, got nan"),
    (math.inf, ValueError, "expected a positive finite number of bytes, got inf"),
    (-5, ValueError, "expected a positive finite number of bytes, got -5"),
    ("1GB", TypeError, r"expected a number of bytes .* got '1GB' \(str\)"),
    (None, TypeError, r"expected a number of bytes .* got None"),
    (True, TypeError, r"expected a number of bytes .* got True"),
    (10**18, ValueError, r"1e\+18 B is more than the memory of cpu"),
])
def test_from_memory_budget_refuses_bad_budgets(budget, exc, msg):
    """NaN and "1GB" used to fail inside int() with no argument named; 10**18 tried to build a free list of
    ~10**12 pages."""
    with pytest.raises(exc, match=rf"^budget_bytes: {msg}"):
        PagedMLACache.from_memory_budget(budget, num_layers=1, page_size=16)


def test_from_memory_budget_takes_a_float():
    per_page = 16 * FORMATS["fp8_e4m3"].bytes_per_token()
    assert PagedMLACache.from_memory_budget(2.5 * per_page, 1, 16).num_pages == 2
    np = pytest.importorskip("numpy")
    assert PagedMLACache.from_memory_budget(np.int64(3 * per_page), 1, 16).num_pages == 3


@pytest.mark.parametrize("device, msg", [
    ("cuda", r"^device: 'cuda' asked for, but torch sees no CUDA device"),
    ("cuda:1", r"^device: 'cuda:1' asked for, but torch sees no CUDA device"),
    ("tpu9", r"^device: expected a torch device such as 'cpu', 'cuda' or 'cuda:1', got 'tpu9'"),
    (3.5, r"^device: expected a torch device"),
])
def test_unavailable_device_is_named(device, msg, monkeypatch):
    """``device="cuda"`` without CUDA used to end in torch's AssertionError about how torch was compiled."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=msg):
        PagedMLACache(1, 4, 16, device=device)
    with pytest.raises(ValueError, match=msg):
        PagedMLACache.from_memory_budget(10**6, 1, 16, device=device)
