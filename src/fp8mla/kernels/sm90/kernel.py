"""The Hopper decode kernel: shared memory, barriers, the warp-specialized partitions (one producer, two consumers)
and ``launch`` (kernel + split merge), with the TMA descriptors it reads through."""
from __future__ import annotations

from .config import DC, DK, GROUPS, HP, LOG2E, SMEM_LIMIT, Sm90Build, gluon
from .merge import launch_merge

if gluon is not None:
    from .config import GROUPS_C, fence_async_shared, gl, mbarrier
    from .consumer import _consumer
    from .producer import _producer

    @gluon.jit
    def mla_decode_sm90_kernel(kv_desc, kpe_desc, pool_rows, requests, pages, work, results, scalars,
                               BUILD: gl.constexpr, sc_desc=None, sc_rows=None):
        # Runtime values come in bundles (``launch`` builds them), leaves in the order of the PTX parameters the SASS
        # record holds (devtools.sass.KERNEL_BUNDLES): triton flattens a tuple argument leaf by leaf into the PTX
        # parameters and specializes each leaf as it would a parameter (pointers and ints divisible by 16, ints equal to
        # 1, None as constexpr), so the kernel compiles as with flat parameters. The TMA descriptors (kv_desc, kpe_desc,
        # sc_desc) stay parameters of their own: triton 3.6's launcher converts a descriptor into its CUtensorMap only
        # at the top level, not inside a tuple. sc_desc / sc_rows (sc_ptr, stride_sc_row) are None without group scales.
        ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows = pool_rows
        q_nope, q_pe, scales, qo_indptr = requests
        kv_indptr, kv_indices, kv_len = pages
        cta_ptr, item_req, item_t0, item_t1 = work
        part_o, part_lse, OUT, LSE_OUT = results
        (sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
         stride_o_t, stride_o_h, stride_lse_t) = scalars
        # BUILD: the build's constexprs (``Sm90Build.kernel_constexprs``, in ``DECODE_CONSTEXPRS`` order), read
        # back into annotated names (a plain assignment would make them runtime values)
        PAGE: gl.constexpr = BUILD[0]
        NS: gl.constexpr = BUILD[1]
        REGS: gl.constexpr = BUILD[2]
        HPW: gl.constexpr = BUILD[3]
        WIDE: gl.constexpr = BUILD[4]
        NHG: gl.constexpr = BUILD[5]
        MTP: gl.constexpr = BUILD[6]
        QK8: gl.constexpr = BUILD[7]
        QKC: gl.constexpr = BUILD[8]
        GROUP: gl.constexpr = BUILD[9]
        PV8: gl.constexpr = BUILD[10]
        # WIDE: launched with NHG CTAs per schedule slot (head groups of 2 * HPW heads; slot = pid // NHG), so the
        # CTAs that read the same tiles are adjacent in the grid and the later reads hit L2.
        kv_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        kbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS * 4, 64, 128], kv_l)
        pbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS, 64, 64], kpe_l)
        if QK8:   # Q^T as QK8 e4m3 terms per consumer (the fp16 copies stay, one chunk each: unused)
            q8_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
            q8_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * QK8 * 4, HPW, 128], q8_l)
            qpe8_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * QK8, HPW, 64], kpe_l)
            q_smem = gl.allocate_shared_memory(gl.float16, [2, HPW, 128], q_l)
        else:
            q_smem = gl.allocate_shared_memory(gl.float16, [8, HPW, 128], q_l)
        qpe_smem = gl.allocate_shared_memory(gl.float16, [2, HPW, 64], q_l)
        if not QK8:   # placeholders (never read: the partitions' argument lists take no None)
            q8_smem = q_smem
            qpe8_smem = qpe_smem
        if GROUP:   # four P^T tiles per consumer (one per scale group)
            pT_smem = gl.allocate_shared_memory(gl.float16, [2 * GROUPS_C, HPW, 64], q_l)
        elif PV8:   # fp8_math: P^T in e4m3 (64-byte rows, k-major for the e4m3 wgmma)
            pT_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, HPW, 64], kpe_l)
        else:
            pT_smem = gl.allocate_shared_memory(gl.float16, [2, HPW, 64], q_l)
        # ready: one barrier per stage, or (an odd ring of the alternating kernel) one per stage and consumer
        RB: gl.constexpr = 2 * NS if NS % 2 == 1 and not WIDE else NS
        ready = gl.allocate_shared_memory(gl.int64, [RB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        # consumer 1 hands its (o, m, l) of each item to consumer 0 through these (full / empty barriers);
        # WIDE has no exchange (a token allocation keeps one argument list)
        x_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        XR: gl.constexpr = 64 if WIDE else 8 * 64
        xo = gl.allocate_shared_memory(gl.float32, [XR, HPW], x_l)
        xml = gl.allocate_shared_memory(gl.float32, [2 * HPW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        xbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ECNT: gl.constexpr = 2 if WIDE else 1     # WIDE: a stage is free once both consumers are done with it
        RCNT: gl.constexpr = 128 if PAGE == 1 else 1   # page 1: one cp.async arrival per producer thread
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=RCNT)
            mbarrier.init(empty.index(i), count=ECNT)
            if RB != NS:
                mbarrier.init(ready.index(NS + i), count=RCNT)
        mbarrier.init(xbar.index(0), count=1)
        mbarrier.init(xbar.index(1), count=1)
        if GROUP:   # each ring stage's [64 tokens, 4] fp32 group scales (TMA boxes of 16-byte rows, or cp.async)
            sc_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            sbuf = gl.allocate_shared_memory(gl.float32, [NS, 64, GROUPS_C], sc_sl)
        fence_async_shared()
        # The partitions take their runtime values in bundles (tuples, unpacked inside) and their constexprs on
        # their own: a tuple assigned to a plain variable turns its constexprs into runtime values, while HPW, WIDE
        # and the others must stay constexpr (layouts, static branches); the consumers' ``variant`` is a tuple of
        # constexprs only, bound as a constexpr and read back into annotated names.
        # NS reaches the consumers as a runtime value: the timed H16 build is compiled that way, and a constexpr NS
        # would be another kernel (its SASS and speed to be checked on their own).
        zero = gl.program_id(0) * 0   # (not gl.to_tensor: keep to APIs triton 3.6 has for sure)
        ns_t = zero + NS
        if GROUP:
            sc_ptr, stride_sc_row = sc_rows
        else:   # placeholders (never read): a partition's argument list takes no None
            sbuf = pbuf
            sc_desc = kpe_desc
            sc_ptr = kpe_ptr
            stride_sc_row = stride_kpe_row
        pool = (kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, sc_desc, sc_ptr,
                stride_sc_row)
        pages = (kv_indptr, kv_indices, kv_len)
        work = (cta_ptr, item_req, item_t0, item_t1)
        ring = (kbuf, pbuf, sbuf, ready, empty)
        qbufs = (q_smem, qpe_smem, pT_smem, q8_smem, qpe8_smem)
        xch = (xo, xml, xbar)
        queries = (q_nope, q_pe, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h)
        outputs = (OUT, LSE_OUT, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r,
                   stride_pl_i)
        problem = (H, sm_scale_log2, scales, qo_indptr, ns_t)
        variant: gl.constexpr = (NHG, HPW, WIDE, MTP, QK8, QKC, GROUP, PV8)
        gl.warp_specialize([
            (_producer, (pool, pages, work, ring, NHG, NS, PAGE, WIDE, GROUP)),
            (_consumer, (0, ring, qbufs, xch, queries, outputs, pages, work, problem, variant)),
            (_consumer, (1, ring, qbufs, xch, queries, outputs, pages, work, problem, variant)),
        ], [4, 4], [REGS, REGS])


def kv_descriptors(ckv_cache, kpe_cache):
    """TMA descriptors over the pool rows: c_kv boxes [64 x 128 B], k_pe boxes [64 x 64 B]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    P, page, _ = ckv_cache.shape
    kv_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    kpe_l = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    rows = min(64, page)   # pages of 16/32 tokens: one box per page
    kv = TensorDescriptor(ckv_cache, [P * page, DC], [ckv_cache.stride(1), 1], [rows, 128], kv_l)
    kpe = TensorDescriptor(kpe_cache, [P * page, DK], [kpe_cache.stride(1), 1], [rows, 64], kpe_l)
    return kv, kpe


def scale_descriptor(ckv_scale_arr):
    """TMA descriptor over the per-token group scales ``[P, page, 4]`` fp32 (fmt ``fp8_e4m3_group``), as rows of
    16 bytes (one per pool row, like the c_kv boxes): boxes [min(64, page) x 4]. The rows must be one pool with
    16-byte aligned strides (``scale_rows_ok``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    P, page, g = ckv_scale_arr.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(ckv_scale_arr, [P * page, g], [ckv_scale_arr.stride(1), 1], [min(64, page), g], layout)


def scale_rows_ok(ckv_scale_arr) -> bool:
    """The group scales as TMA reads them: [P, page, 4] fp32, a contiguous last dimension, rows of one pool (page
    stride = page x row stride) with 16-byte aligned row stride and base."""
    import torch
    a = ckv_scale_arr
    return (a.dim() == 3 and a.shape[2] == GROUPS and a.dtype == torch.float32 and a.stride(2) == 1
            and a.stride(0) == a.shape[1] * a.stride(1) and a.stride(1) % 4 == 0 and a.data_ptr() % 16 == 0)


def launch(build: Sm90Build, kv_desc, kpe_desc, q_nope, q_pe, scales, t: dict, out, lse, *, grid: int,
           grid_batch: int, max_rows: int, num_heads: int, sm_scale: float, merge_p: int = 32, merge_c: int = 128,
           scale_desc=None):
    """Decode kernel + merge of one named build (``Sm90Build``: page size, rows per consumer, head groups, wide,
    multi-token, group scales, fp8_math, ring depth). ``t``: the plan's device arrays (qo_indptr, kv_indptr,
    kv_indices, kv_len, cta_ptr, item_req, item_t0, item_t1, part_o [items, padded_heads(H), 512] fp32, part_lse
    [items, padded_heads(H)], m_ptr, m_list, batch_size [1]). ``lse`` is written base 2. ``grid``: CTAs launched;
    for the wide variant it is slots x nhg, the schedule (``cta_ptr``) having ``grid // nhg`` slots. Multi-token
    builds read each request's qo_len from qo_indptr on the device (causal aligns its queries to the end);
    ``max_rows`` is then max_qo x num_heads.

    ``build.stages``: the ring depth, any; at an odd depth the alternating-tile kernel (H <= 16) has one ready
    barrier per stage and consumer (``ring.ready_slot``).

    ``build.group`` takes ``scale_desc`` (``scale_descriptor``; ``scales`` then holds (1, kpe_scale)): the producer
    brings each tile's [64, 4] scales with its rows, the scores are one fp32 product per 128-column group times the
    tokens' scales, and P.V takes P x scale / the group's tile maximum per group (the Triton kernel's KV_GROUP
    numerics).

    ``build.fp8_math`` (opt-in): S = K.Q^T and O^T += V^T.P^T as e4m3 x e4m3 wgmma: Q as ``FP8_MATH_TERMS`` e4m3
    terms, K and V^T's bytes straight from the stage (no conversion), P x 2^8 rounded to e4m3 (``P8_SCALE``), the
    row sums kept from the unrounded P. Error budget rel L2 <= 2e-2, not the default 3e-3. Per-tensor scales
    only."""
    b = build
    if grid % b.nhg:
        raise ValueError(f"grid: {b.nhg} head groups need a multiple of {b.nhg} CTAs, got {grid}")
    if b.fp8_math and (b.group or scale_desc is not None):
        raise ValueError("fp8_math: the e4m3 math runs with per-tensor scales (no group scales, no scale_desc)")
    if b.group != (scale_desc is not None):
        raise ValueError(f"scale_desc: the build {'has' if b.group else 'has no'} group scales; got "
                         f"{'None' if scale_desc is None else 'a descriptor'}")
    if b.smem() > SMEM_LIMIT:
        what = "group scales" if b.group else ("fp8_math's Q terms" if b.fp8_math else "the ring")
        raise ValueError(f"build: {what} at {num_heads} heads and {b.stages} stages need {b.smem()} B of shared "
                         f"memory, above {SMEM_LIMIT}")
    if scale_desc is not None and scale_desc.block_shape != [min(64, b.page_size), GROUPS]:
        raise ValueError(f"scale_desc: expected boxes [{min(64, b.page_size)}, {GROUPS}] (scale_descriptor of a "
                         f"[P, {b.page_size}, {GROUPS}] array), got {scale_desc.block_shape}")
    po, pl = t["part_o"], t["part_lse"]
    rows = 2 * b.hpw * b.nhg if b.wide else HP
    if po.shape[1] < rows or pl.shape[1] < rows:
        raise ValueError(f"part_o/part_lse: need {rows} head rows per item, got "
                         f"{po.shape[1]}/{pl.shape[1]}")
    # the kernel's bundles (mla_decode_sm90_kernel: the order of each tuple is the order its unpacking reads);
    # page 1 copies rows with cp.async from the pools the descriptors cover (rows of page_size 1: row = page id)
    pool_rows = (kv_desc.base, kpe_desc.base, kv_desc.strides[0], kpe_desc.strides[0], kv_desc.shape[0])
    requests = (q_nope, q_pe, scales, t["qo_indptr"])
    pages = (t["kv_indptr"], t["kv_indices"], t["kv_len"])
    work = (t["cta_ptr"], t["item_req"], t["item_t0"], t["item_t1"])
    results = (po, pl, out, lse)
    scalars = (sm_scale * LOG2E, num_heads, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
               po.stride(0), po.stride(1), pl.stride(0), out.stride(0), out.stride(1), lse.stride(0))
    sc_rows = None if scale_desc is None else (scale_desc.base, scale_desc.strides[0])
    mla_decode_sm90_kernel[(grid,)](kv_desc, kpe_desc, pool_rows, requests, pages, work, results, scalars,
                                    **b.kernel_constexprs(), sc_desc=scale_desc, sc_rows=sc_rows, num_warps=4)
    launch_merge(out, lse, t, grid_batch=grid_batch, max_rows=max_rows, num_heads=num_heads, merge_p=merge_p,
                 merge_c=merge_c)
