"""Read the SASS of kernels compiled without a GPU, and keep the sm_90 decode builds' golden record.

ptxas and cuobjdump come with the triton wheel (``triton/backends/nvidia/bin``). The reader gives registers,
spills, shared memory, MMA counts (HGMMA / QGMMA / HMMA), byte-wise shared loads (``LDS.U8``) and a SHA-256 of the
instruction stream with addresses, branch targets, labels and function names stripped (``stream_hash``), plus a
second hash with the constant-bank parameter offsets (``c[0x0][...]``) normalized too, which stays the same when a
kernel parameter is removed and the others move, and a third with the register numbers normalized
(``sha256_regs``: every opcode and every other operand kept), which the guard requires instead of the first two for
the builds ``REGISTER_RENUMBERING`` names: where this triton's ptxas numbers their registers differently from one
compile of the same PTX to the next.

    python -m devtools.sass record            # compile every named sm_90 build, write tests/golden/sm90_triton-<v>.json
    python -m devtools.sass record --only mh64_p64   # (re-)record these builds only, every other entry kept as is
    python -m devtools.sass check             # compare them with the golden file of this triton
    python -m devtools.sass check --only sparse_split   # compile and compare these builds only
    python -m devtools.sass show h16_p64      # one build's summary (and --sass FILE: its SASS)

The golden file is per triton version (the SASS of one source differs between triton releases): record it once
with each triton the project checks under (CI pins one, the H200 runs another) on the tree it must guard.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")


# ---------------------------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------------------------
def bin_dir() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def tools_present() -> bool:
    try:
        d = bin_dir()
    except ImportError:
        return False
    return all(os.path.exists(os.path.join(d, t)) for t in ("ptxas", "cuobjdump"))


def gluon_import_error() -> str | None:
    """None when triton's Gluon imports (with the Hopper modules the sm_90 kernel uses), else why not."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import tma  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import problem means "no Gluon here"
        return f"{type(e).__name__}: {e}"
    return None


def compile_tools_missing(gluon: bool = True) -> str | None:
    """None when kernels can be compiled here (triton with ptxas and cuobjdump in its wheel; ``gluon``: and Gluon
    imports), else why not. Tests skip on it, except under ``CI=true``, where it is a failure
    (``require_compile_tools``)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"triton does not import: {type(e).__name__}: {e}"
    why = gluon_import_error() if gluon else None
    if why is None and not tools_present():
        why = f"ptxas / cuobjdump not in the triton wheel ({bin_dir()})"
    return why


def require_compile_tools(gluon: bool = True) -> None:
    """Skip the calling test when the compile tools are missing; fail it under ``CI=true`` (CI pins the triton
    that has them, so a missing tool there means the pin broke, not "nothing to check")."""
    import pytest
    why = compile_tools_missing(gluon)
    if why is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and the compile tools are missing: {why}")
    pytest.skip(f"compile tools missing: {why}")


def dump_sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([os.path.join(bin_dir(), "cuobjdump"), "--dump-sass", path], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.remove(path)


def resource_usage(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([os.path.join(bin_dir(), "cuobjdump"), "--dump-resource-usage", path],
                              capture_output=True, text=True).stdout
    finally:
        os.remove(path)


def ptxas_verbose(ptx: str, arch: str = "sm_90a") -> str:
    """ptxas -v's report of a PTX text (registers and spill bytes per function). Later wheels ship an older
    ``ptxas`` beside the one they use (``ptxas-blackwell``): the first that assembles it answers."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = ""
        for exe in ("ptxas", "ptxas-blackwell"):
            path = os.path.join(bin_dir(), exe)
            if not os.path.exists(path):
                continue
            res = subprocess.run([path, f"-arch={arch}", "-v", src, "-o", src + ".cubin"], capture_output=True,
                                 text=True)
            out = res.stderr
            if res.returncode == 0:
                break
        return out


# ---------------------------------------------------------------------------------------------------------------
# Reading SASS
# ---------------------------------------------------------------------------------------------------------------
# an instruction line: /*addr*/ [@!P0] OPCODE operands ;   (addresses have 4 or more hex digits)
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_OPCODE = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
_FUNCTION = re.compile(r"^\s*Function\s*:")
_CONTROL = ("BRA", "BRX", "BSSY", "CALL", "JMP", "JMX", "RET", "BREAK", "SSY", "PBK", "WARPSYNC")
_HEX = re.compile(r"0x[0-9a-f]+")
_NAME = re.compile(r"`\([^)]*\)")          # `(label or function name)
_CBANK = re.compile(r"c\[0x0\]\[[^\]]*\]")   # kernel parameters and driver constants in bank 0
# a numbered register operand: R, UR (uniform), P, UP (predicates), B (convergence barriers); RZ, URZ, PT, UPT
# carry no number and stay
_REG = re.compile(r"\b(U?R|U?P|B)\d+\b")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without its address) of every SASS instruction, in order; a function boundary
    is the entry (-1, "FUNCTION")."""
    out = []
    for line in sass.splitlines():
        if _FUNCTION.match(line):
            out.append((-1, "FUNCTION"))
            continue
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), " ".join(m.group(2).split())))
    return out


def opcode(text: str) -> str:
    m = _OPCODE.match(text)
    return m.group(1) if m else text.split()[0]


def _strip_register_numbers(text: str) -> str:
    """``R24`` -> ``R``, ``UR5`` -> ``UR``, ``@!P0`` -> ``@!P`` ...; the opcode itself is left alone (``.B32``
    and such are types, not registers)."""
    m = _OPCODE.match(text)
    if not m:
        return _REG.sub(r"\1", text)
    s, e = m.span(1)
    return _REG.sub(r"\1", text[:s]) + text[s:e] + _REG.sub(r"\1", text[e:])


def normalized_stream(sass: str, params: bool = False, regs: bool = False) -> list[str]:
    """The instruction stream with what moves without the code changing stripped: addresses, branch and call
    targets (hex or named), labels and function names. ``params``: also every ``c[0x0][...]`` operand (kernel
    parameter offsets move when a parameter is added or removed). ``regs``: also every register number (ptxas's
    allocation; the opcodes, immediates, memory offsets and constant-bank operands stay)."""
    out = []
    for _, text in instructions(sass):
        text = _NAME.sub("`()", text)
        if opcode(text).split(".")[0] in _CONTROL:
            text = _HEX.sub("ADDR", text)
        if params:
            text = _CBANK.sub("c[0x0][P]", text)
        if regs:
            text = _strip_register_numbers(text)
        out.append(text)
    return out


def stream_hash(sass: str, params: bool = False, regs: bool = False) -> str:
    return hashlib.sha256("\n".join(normalized_stream(sass, params, regs)).encode()).hexdigest()


def op_counts(sass: str) -> collections.Counter:
    return collections.Counter(opcode(t) for a, t in instructions(sass) if a >= 0)


def loop_bodies(sass: str) -> list[list[str]]:
    """SASS lines of every loop: from the target of a backward branch to the branch (cuobjdump prints branch
    targets as addresses). The end-of-kernel ``BRA`` to itself is not a loop."""
    body = [(a, t) for a, t in instructions(sass) if a >= 0]
    loops = []
    for addr, text in body:
        if opcode(text).split(".")[0] != "BRA":
            continue
        targets = _HEX.findall(text)
        if targets and int(targets[-1], 16) < addr:
            lo = int(targets[-1], 16)
            loops.append([t for a, t in body if lo <= a <= addr])
    return loops


def mma_counts(ops: dict) -> dict:
    fam = collections.Counter()
    for op, n in ops.items():
        for name in ("HGMMA", "QGMMA", "HMMA", "QMMA"):
            if op.startswith(name + ".") or op == name:
                fam[name] += n
    return {name: fam.get(name, 0) for name in ("HGMMA", "QGMMA", "HMMA")}


def summary(sass: str, ptxas_v: str, smem: int) -> dict:
    """What the golden record keeps of one compiled kernel."""
    ops = op_counts(sass)
    spills = [list(map(int, x)) for x in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_v)]
    return {"regs": [int(r) for r in re.findall(r"Used (\d+) registers", ptxas_v)], "spills": spills,
            "smem": int(smem), "mma": mma_counts(ops), "lds_u8": ops.get("LDS.U8", 0),
            "instructions": sum(ops.values()), "sha256": stream_hash(sass),
            "sha256_params": stream_hash(sass, params=True), "sha256_regs": stream_hash(sass, regs=True)}


def analyse(k) -> dict:
    """Resource usage (cuobjdump --dump-resource-usage: REG, STACK = the spill frame) and SASS counts of a kernel
    compiled by ``triton.compile``; spills show as STACK > 0 and STL/LDL instructions (the Triton kernels' check,
    scripts/compile_kernels.py)."""
    res = resource_usage(k.asm["cubin"])
    sass = dump_sass(k.asm["cubin"])
    get = lambda key: int(m.group(1)) if (m := re.search(rf"\b{key}:(\d+)", res)) else -1  # noqa: E731
    ops = op_counts(sass)
    base = collections.Counter()
    for op, n in ops.items():
        base[op.split(".")[0]] += n
    loops = loop_bodies(sass)
    in_loops = sum(sum(opcode(t) == "LDS.U8" for t in body) for body in loops)
    return dict(regs=get("REG"), local=get("LOCAL"), stack=get("STACK"), smem=k.metadata.shared,
                spill_ops=base["STL"] + base["LDL"], lds_u8=ops["LDS.U8"], lds_u8_in_loops=in_loops,
                loops=len(loops), ops=base, sass=sass)


# ---------------------------------------------------------------------------------------------------------------
# Compiling the sm_90 decode kernel (Gluon) without a GPU
# ---------------------------------------------------------------------------------------------------------------
# The kernel's argument types in a real launch (bf16 queries; compile_report substitutes the query dtype and the
# page's box rows)
KERNEL_SIGNATURE = {
    "kv_desc": "tensordesc<fp8e4nv[64, 128],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)>",
    "kpe_desc": "tensordesc<fp8e4nv[64, 64],NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)>",
    "ckv_ptr": "*fp8e4nv", "kpe_ptr": "*fp8e4nv", "stride_kv_row": "i32", "stride_kpe_row": "i32",
    "num_rows": "i32",
    "q_nope": "*bf16", "q_pe": "*bf16", "scales": "*fp32", "qo_indptr": "*i32", "kv_indptr": "*i32",
    "kv_indices": "*i32", "kv_len": "*i32", "cta_ptr": "*i32", "item_req": "*i32", "item_t0": "*i32",
    "item_t1": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "OUT": "*bf16", "LSE_OUT": "*fp32",
    "sm_scale_log2": "fp32", "H": "i32", "stride_o_t": "i32", "stride_o_h": "i32", "stride_lse_t": "i32",
    "stride_qn_t": "i32", "stride_qn_h": "i32", "stride_qp_t": "i32", "stride_qp_h": "i32",
    "stride_po_i": "i32", "stride_po_r": "i32", "stride_pl_i": "i32",
    # group scales (compile_report(group=True)); sc_desc and sc_rows None otherwise
    "sc_desc": "tensordesc<fp32[64, 4],NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)>",
    "sc_ptr": "*fp32", "stride_sc_row": "i32"}


# The decode kernel's bundles: {parameter: its tuple's leaves, in the order the kernel unpacks them}; the other
# parameters are leaves of their own (KERNEL_SIGNATURE names every leaf)
KERNEL_BUNDLES = {
    "pool_rows": ("ckv_ptr", "kpe_ptr", "stride_kv_row", "stride_kpe_row", "num_rows"),
    "requests": ("q_nope", "q_pe", "scales", "qo_indptr"),
    "pages": ("kv_indptr", "kv_indices", "kv_len"),
    "work": ("cta_ptr", "item_req", "item_t0", "item_t1"),
    "results": ("part_o", "part_lse", "OUT", "LSE_OUT"),
    "scalars": ("sm_scale_log2", "H", "stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_po_i",
                "stride_po_r", "stride_pl_i", "stride_o_t", "stride_o_h", "stride_lse_t"),
    "sc_rows": ("sc_ptr", "stride_sc_row")}


# The heads-on-M kernel's (``heads_on_m_kernel``): 64 x 64-byte boxes for both pools
MH_KERNEL_SIGNATURE = {
    "kv_desc": "tensordesc<fp8e4nv[64, 64],NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)>",
    "kpe_desc": "tensordesc<fp8e4nv[64, 64],NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)>",
    "q_nope": "*bf16", "q_pe": "*bf16", "scales": "*fp32", "qo_indptr": "*i32", "kv_indptr": "*i32",
    "kv_indices": "*i32", "kv_len": "*i32", "m_ptr": "*i32", "batch_size": "*i32", "item_req": "*i32",
    "item_t0": "*i32", "item_t1": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "OUT": "*bf16", "LSE_OUT": "*fp32",
    "sm_scale_log2": "fp32", "H": "i32",
    "stride_qn_t": "i32", "stride_qn_h": "i32", "stride_qp_t": "i32", "stride_qp_h": "i32",
    "stride_po_i": "i32", "stride_po_r": "i32", "stride_pl_i": "i32", "stride_o_t": "i32", "stride_o_h": "i32",
    "stride_lse_t": "i32"}
# its bundles: the decode kernel's (KERNEL_BUNDLES; no pool_rows, no sc_rows among its parameters) with its own work
MH_KERNEL_BUNDLES = dict(
    KERNEL_BUNDLES, work=("m_ptr", "batch_size", "item_req", "item_t0", "item_t1"))


# The sparse kernel's (``sparse_partitions.sparse_mla_kernel``): contiguous bf16 [n, H, 512] / [n, H, 64] queries,
# the record pool's three views, int32 index rows; every other argument an i32 but the two float scales.
SPARSE_POINTERS = {"q_nope": "*bf16", "q_pe": "*bf16", "ckv_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "kpe_ptr": "*bf16",
                   "indices": "*i32", "out": "*bf16", "lse_out": "*fp32", "part_o": "*fp32", "part_lse": "*fp32"}
SPARSE_FLOATS = ("sm_scale_log2", "lse_scale")
# Ints a launch sees divisible by 16 (topk as 2048; the lse rows at H = 8 and the partial-lse rows are not);
# stride_lse_h is 1, which triton makes a constant.
SPARSE_DIV16 = ("topk", "chunk", "stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_idx_t",
                "stride_o_t", "stride_o_h", "stride_po_i", "stride_po_h")
# its bundles (as KERNEL_BUNDLES)
SPARSE_BUNDLES = {
    "inputs": ("q_nope", "q_pe", "ckv_ptr", "sa_ptr", "kpe_ptr", "indices"),
    "results": ("out", "lse_out", "part_o", "part_lse"),
    "sizes": ("sm_scale_log2", "lse_scale", "H", "num_slots", "topk", "chunk", "num_splits", "num_groups"),
    "strides": ("stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_idx_t", "stride_o_t",
                "stride_o_h", "stride_lse_t", "stride_lse_h", "stride_po_i", "stride_po_h", "stride_pl_i")}
# The sparse builds the golden record keeps beside the dense ones: {name: SPLIT}
SPARSE_BUILDS = {"sparse_split": True, "sparse_nosplit": False}


# The V4 kernel's (``v4_partitions.v4_attention_kernel``): contiguous bf16 [n, H, 512] queries and outputs, each
# pool's three typed views, int32 index rows and lengths, fp32 sinks; every other argument an i32 but the two
# float scales. Ints a launch sees divisible by 16: the window topk (V4: 128) and the row strides.
V4_POINTERS = {"q": "*bf16", "out": "*bf16", "lse_out": "*fp32", "part_o": "*fp32", "part_lse": "*fp32",
               "sinks": "*fp32", "w8": "*fp8e4nv", "w16": "*bf16", "w32": "*i32", "c8": "*fp8e4nv", "c16": "*bf16",
               "c32": "*i32", "w_idx": "*i32", "c_idx": "*i32", "w_len": "*i32", "c_len": "*i32"}
V4_DIV16 = ("w_topk", "w_sidx", "c_topk", "c_sidx", "stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h",
            "stride_po_i", "stride_po_h")
# The kernel's runtime parameters are bundles (tuples from the host, v4.py): {parameter: its leaves in order}
V4_BUNDLES = {"tensors": ("q", "out", "lse_out", "part_o", "part_lse", "sinks"),
              "window": ("w8", "w16", "w32", "w_stride", "w_page", "w_slots", "w_idx", "w_sidx", "w_topk", "w_len"),
              "compressed": ("c8", "c16", "c32", "c_stride", "c_page", "c_slots", "c_idx", "c_sidx", "c_topk",
                             "c_len"),
              "scalars": ("sm_scale_log2", "lse_scale", "H", "chunk", "num_splits", "num_parts", "num_groups",
                          "w_tiles", "total_tiles"),
              "strides": ("stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h", "stride_lse_t", "stride_lse_h",
                          "stride_po_i", "stride_po_h", "stride_pl_i")}
# The V4 builds the golden record keeps: {name: (format kind, SPLIT)}, each with sinks and both segments' lengths
V4_BUILDS = {"v4_fp8_split": (1, True), "v4_fp8_nosplit": (1, False), "v41_fp8_nosplit": (2, False),
             "v4_bf16_nosplit": (0, False)}


# Integer arguments the JIT sees divisible by 16 in a real launch with contiguous [tokens, H, dim] tensors and
# H % 16 == 0 (triton specializes such ints): the strides and H itself.
_INT_DIV16 = ("H", "stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_po_i", "stride_po_r",
              "stride_pl_i", "stride_o_t", "stride_o_h", "stride_lse_t")


def bundled_source(fn, signature: dict, bundles: dict, consts: dict, aligned):
    """The ``GluonASTSource`` a launch of Gluon kernel ``fn`` compiles: ``signature`` types every leaf by name,
    ``bundles`` gives the leaves of each tuple parameter ({parameter: leaf names}), ``consts`` the constexprs (a
    parameter or a leaf, by name; a parameter named there is a constexpr as a whole, None included), ``aligned``
    the int leaves a launch sees divisible by 16. As the JIT specializes a launch: a tuple's signature is the
    tuple of its leaves' types, a constexpr or attribute of a leaf is keyed by its path (parameter, index), and
    every pointer and every aligned int gets tt.divisibility 16."""
    from triton.experimental.gluon._runtime import GluonASTSource
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        whole = name in consts or name not in bundles
        leaves = [((i,), name)] if whole else [((i, j), leaf) for j, leaf in enumerate(bundles[name])]
        types = []
        for path, leaf in leaves:
            if leaf in consts:
                types.append("constexpr")
                constexprs[path] = consts[leaf]
                continue
            types.append(signature[leaf])
            if signature[leaf].startswith("*") or leaf in aligned:
                attrs[path] = [["tt.divisibility", 16]]
        sig[name] = types[0] if whole else tuple(types)
    return GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)


def compile_report(page: int = 64, ns: int = 4, regs: int = 240, q_dtype: str = "bf16", sass_path=None,
                   heads: int = 16, aligned_ints: bool = False, max_qo: int = 1, causal: bool = True,
                   group: bool = False, fp8_math: bool = False, heads_on_m: bool = False) -> dict:
    """``compile_build`` of the build a plan of these sizes gets (``Sm90Build.for_plan``; ``heads_on_m``: the
    heads-on-M build of ``heads`` and ``page``, ``Sm90Build.for_heads_on_m``, its own stages and registers, ``ns``
    and ``regs`` not applied): ``heads`` picks the
    variant (16 -> the H16 kernel, 32 -> wide HPW 16, 128 -> wide HPW 32; with ``group``, HPW 16 at every H);
    ``max_qo`` >= 2: the multi-token variant, causal or not; ``group``: per-token group scales; ``fp8_math``: the
    e4m3 build."""
    from fp8mla.kernels import sm90
    if heads_on_m:
        return compile_build(sm90.Sm90Build.for_heads_on_m(heads, page), q_dtype=q_dtype, aligned_ints=aligned_ints,
                             sass_path=sass_path)
    b = sm90.Sm90Build.for_plan(heads, page, max_qo, causal, group, fp8_math, ns)
    if regs != b.regs:
        import dataclasses
        b = dataclasses.replace(b, regs=regs)
    return compile_build(b, q_dtype=q_dtype, aligned_ints=aligned_ints, sass_path=sass_path)


def compile_build(build, q_dtype: str = "bf16", aligned_ints: bool = True, sass_path=None) -> dict:
    """Compile one ``sm90.Sm90Build`` of the decode kernel for sm_90a with triton's own ptxas (no GPU needed) and
    count SASS ops (``sass_report``). ``aligned_ints``: mark the strides and H divisible by 16, as the JIT
    specializes them at H = 16/32/64/128 with contiguous tensors (then Q is read with 16-byte loads); False
    compiles the unspecialized worst case."""
    from fp8mla.kernels import sm90
    if sm90.gluon is None:
        raise RuntimeError(f"gluon is not importable: {sm90.GLUON_IMPORT_ERROR}")
    if getattr(build, "heads_on_m", False):
        return _compile_heads_on_m(build, q_dtype, aligned_ints, sass_path)
    sig = dict(KERNEL_SIGNATURE, q_nope=f"*{q_dtype}", q_pe=f"*{q_dtype}", OUT=f"*{q_dtype}")
    rows = min(64, build.page_size)
    sig["kv_desc"] = sig["kv_desc"].replace("[64, 128]", f"[{rows}, 128]")
    sig["kpe_desc"] = sig["kpe_desc"].replace("[64, 64]", f"[{rows}, 64]")
    sig["sc_desc"] = sig["sc_desc"].replace("[64, 4]", f"[{rows}, 4]")
    # the constexprs as a launch passes them (every one, in the BUILD tuple); without group scales the launch
    # passes sc_desc and sc_rows as None
    consts = build.kernel_constexprs()
    if not build.group:
        consts.update(sc_desc=None, sc_rows=None)
    aligned = ("stride_kv_row", "stride_kpe_row") + (_INT_DIV16 if aligned_ints else ())
    src = bundled_source(sm90.mla_decode_sm90_kernel, sig, KERNEL_BUNDLES, consts, aligned)
    return sass_report(src, sass_path)


def _compile_heads_on_m(build, q_dtype: str, aligned_ints: bool, sass_path) -> dict:
    """``compile_build`` of a heads-on-M build (``heads_on_m_kernel``, its own signature)."""
    from fp8mla.kernels import sm90
    sig = dict(MH_KERNEL_SIGNATURE, q_nope=f"*{q_dtype}", q_pe=f"*{q_dtype}", OUT=f"*{q_dtype}")
    src = bundled_source(sm90.heads_on_m_kernel, sig, MH_KERNEL_BUNDLES, build.kernel_constexprs(),
                         _INT_DIV16 if aligned_ints else ())
    return sass_report(src, sass_path)


def sparse_source(split: bool):
    """The ``GluonASTSource`` of the Hopper sparse kernel as a launch with ``SPLIT=split`` compiles it (bf16
    queries, ``sparse_partitions.REGS``)."""
    from fp8mla.kernels.sm90 import sparse_partitions as mod
    if mod.gluon is None:
        raise RuntimeError(f"gluon is not importable: {mod.GLUON_IMPORT_ERROR}")
    consts = dict(SPLIT=split, REGS=mod.REGS, stride_lse_h=1)
    leaves = [leaf for group in SPARSE_BUNDLES.values() for leaf in group]
    sig = {n: SPARSE_POINTERS.get(n, "fp32" if n in SPARSE_FLOATS else "i32") for n in leaves}
    return bundled_source(mod.sparse_mla_kernel, sig, SPARSE_BUNDLES, consts, SPARSE_DIV16)


def compile_sparse(split: bool, sass_path=None) -> dict:
    """``sass_report`` of the Hopper sparse kernel (``sparse_source``), launched with ``NUM_WARPS`` warps."""
    from fp8mla.kernels.sm90.sparse_partitions import NUM_WARPS
    return sass_report(sparse_source(split), sass_path, num_warps=NUM_WARPS)


def v4_source(fmt: int, split: bool):
    """The ``GluonASTSource`` of the Hopper V4 kernel as a launch of pool format ``fmt`` (0 bf16, 1 fp8_v4,
    2 fp8_v41) with sinks and both segments' lengths compiles it (``SPLIT=split``, ``v4_partitions.REGS``): each
    bundle's leaves typed and specialized one by one, as triton's launcher does (``V4_BUNDLES``)."""
    from fp8mla.kernels.sm90 import v4_partitions as mod
    if mod.gluon is None:
        raise RuntimeError(f"gluon is not importable: {mod.GLUON_IMPORT_ERROR}")
    fn = mod.v4_attention_kernel
    consts = dict(FMT=fmt, HAS_W_LEN=True, HAS_C_LEN=True, HAS_SINK=True, SPLIT=split, REGS=mod.REGS)
    if sorted(fn.arg_names) != sorted([*V4_BUNDLES, *consts]):
        raise RuntimeError(f"v4_attention_kernel's parameters {fn.arg_names} are not V4_BUNDLES + {sorted(consts)}")
    leaves = [leaf for group in V4_BUNDLES.values() for leaf in group]
    sig = {n: V4_POINTERS.get(n, "fp32" if n in ("sm_scale_log2", "lse_scale") else "i32") for n in leaves}
    # lse [n, H] contiguous: triton makes the int leaf stride_lse_h of 1 a constant
    return bundled_source(fn, sig, V4_BUNDLES, dict(consts, stride_lse_h=1), V4_DIV16)


def compile_v4(fmt: int, split: bool, sass_path=None) -> dict:
    """``sass_report`` of the Hopper V4 kernel (``v4_source``), launched with ``NUM_WARPS`` warps."""
    from fp8mla.kernels.sm90.v4_partitions import NUM_WARPS
    return sass_report(v4_source(fmt, split), sass_path, num_warps=NUM_WARPS)


def sass_report(src, sass_path=None, num_warps: int = 4) -> dict:
    """Compile a Gluon kernel source (``GluonASTSource``) for sm_90a with triton's own ptxas (no GPU) and read its
    SASS: ``regs``, ``spills`` ((store, load) bytes per function), ``smem``, ``ptxas`` (its -v output), ``ops``
    (SASS op counts), ``loops`` (per warp-specialized partition, the HGMMA, STL, LDL and LDS.U8 between its first
    and last HGMMA: the tile loop) and ``serialized_wgmma`` (ptxas C7512); ``sass_path``: also write the SASS
    there."""
    import collections
    import os
    import re
    import subprocess
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(k.asm["ptx"])
        for exe in ("ptxas", "ptxas-blackwell"):   # later wheels ship an older "ptxas" beside the one they use
            res = subprocess.run([os.path.join(bindir, exe), "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"],
                                 capture_output=True, text=True)
            v = res.stderr
            if res.returncode == 0:
                break
        cub = os.path.join(d, "k.cubin")
        open(cub, "wb").write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-sass", cub],
                              capture_output=True, text=True).stdout
    if sass_path:
        open(sass_path, "w").write(sass)
    ops = collections.Counter()
    seq = []
    # (addresses have 4 or more hex digits: the kernel is past 0x10000 bytes, so {4} alone missed the 2nd consumer)
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass):
        ops[m.group(1)] += 1
        seq.append(m.group(1))
    # the tile loops: from the first to the last HGMMA of each partition (partitions start at USETMAXREG)
    loops, cur = [], []
    for op in seq + ["USETMAXREG"]:
        if op.startswith("USETMAXREG"):
            h = [i for i, o in enumerate(cur) if o.startswith("HGMMA")]
            if h:
                body = cur[h[0]:h[-1] + 1]
                loops.append({"HGMMA": len(h), "STL": sum(o.startswith("STL") for o in body),
                              "LDL": sum(o.startswith("LDL") for o in body),
                              "LDS.U8": sum(o == "LDS.U8" for o in body)})
            cur = []
        cur.append(op)
    spills = [tuple(map(int, x)) for x in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v)]
    return {"regs": [int(r) for r in re.findall(r"Used (\d+) registers", v)], "spills": spills,
            "smem": k.metadata.shared, "ptxas": v, "ops": dict(ops), "loops": loops,
            "serialized_wgmma": "C7512" in v or "serialized" in v.lower()}


# ---------------------------------------------------------------------------------------------------------------
# The sm_90 decode builds and their golden record
# ---------------------------------------------------------------------------------------------------------------
def sm90_builds() -> dict:
    """The named builds the golden record keeps: the dense ``fp8mla.kernels.sm90.KNOWN_BUILDS`` (bf16 queries,
    contiguous tensors: the strides and H specialized divisible by 16, as a launch with H 16 or 128 has them) and
    the sparse ``SPARSE_BUILDS`` (split and not, ``sparse_source``) and the DeepSeek V4 ``V4_BUILDS``
    (``v4_source``)."""
    from fp8mla.kernels.sm90.config import KNOWN_BUILDS
    return {**KNOWN_BUILDS, **SPARSE_BUILDS, **V4_BUILDS}


def compile_sm90(name: str) -> tuple[dict, str]:
    """(summary, SASS text) of one named build compiled for sm_90a."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: nothing compiles in this process (run it in one without)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.sass")
        if name in SPARSE_BUILDS:
            r = compile_sparse(SPARSE_BUILDS[name], sass_path=path)
        elif name in V4_BUILDS:
            r = compile_v4(*V4_BUILDS[name], sass_path=path)
        else:
            r = compile_build(sm90_builds()[name], aligned_ints=True, sass_path=path)
        with open(path) as f:
            sass = f.read()
    return summary(sass, r["ptxas"], r["smem"]), sass


def compile_many(names: list[str], workers: int = 2, timeout: int = 1200) -> dict:
    """``compile_sm90`` of each name, in ``workers`` child processes without TRITON_INTERPRET (the test suite
    sets it): {name: summary or {"error": ...}}."""
    names = list(names)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "src")] + [p for p in sys.path if p]
                                        + [env.get("PYTHONPATH", "")])
    parts = [names[i::workers] for i in range(workers) if names[i::workers]]
    procs = [subprocess.Popen([sys.executable, "-m", "devtools.sass", "json", *part], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in parts]
    out = {}
    for part, p in zip(parts, procs):
        so, se = p.communicate(timeout=timeout)
        if p.returncode != 0:
            for n in part:
                out[n] = {"error": f"exit {p.returncode}: {se[-3000:]}"}
            continue
        out.update(json.loads(so.splitlines()[-1]))
    return out


def triton_version() -> str:
    import triton
    return triton.__version__


def golden_path(version: str | None = None) -> str:
    return os.path.join(GOLDEN_DIR, f"sm90_triton-{version or triton_version()}.json")


# Builds whose register numbers this triton's ptxas does not reproduce: {triton version: {build: why}}. For them the
# guard compares sha256_regs (and every count) instead of sha256 and sha256_params; every other build keeps the
# strict hashes. Only where it was seen, with the evidence: a build is named here after two compiles of the same
# tree differ.
REGISTER_RENUMBERING = {
    "3.6.0": {
        name: "triton 3.6.0's ptxas gives a different cubin from the same PTX from one fresh compile to the next "
              "(group_h16: three fresh compiles of one tree, byte-identical PTX, three SASS hashes; group_h128: "
              "three compiles of one tree, on the H200 and on a CPU, three hashes; fp8_math_h16: two fresh compiles, "
              "at 4542871 and at 8cf2646, and the record's, three hashes); the streams differ only in register "
              "numbers (group: which of R192..R201 a value gets), opcodes, counts, spills and every other operand "
              "the same"
        for name in ("group_h16", "group_h128", "fp8_math_h16")},
}
_STRICT = ("sha256", "sha256_params")


def renumbering(name: str, version: str | None = None) -> str | None:
    """Why build ``name``'s register numbers are not reproducible under this triton, or None (strict)."""
    return REGISTER_RENUMBERING.get(version or triton_version(), {}).get(name)


def diff(want: dict, got: dict, renumbered: bool = False) -> list[str]:
    """The fields where one build's summary differs from its golden one; ``renumbered``: not the strict hashes
    (``REGISTER_RENUMBERING``), which then keeps sha256_regs required."""
    keys = sorted(set(want) | set(got))
    if renumbered:
        keys = [k for k in keys if k not in _STRICT]
    return [f"{key}: golden {want.get(key)!r}, now {got.get(key)!r}" for key in keys
            if want.get(key) != got.get(key)]


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="compile every named sm_90 build and write the golden file")
    rec.add_argument("--out", default=None, help="file to write (default tests/golden/sm90_triton-<v>.json)")
    rec.add_argument("--only", nargs="+", default=None, choices=sorted(sm90_builds()),
                     help="compile and (re-)record these builds only; the file's other entries and its commit stay")
    chk = sub.add_parser("check", help="compare every named build with the golden file of this triton")
    chk.add_argument("--only", nargs="+", default=None, choices=sorted(sm90_builds()),
                     help="compile and compare these builds only")
    show = sub.add_parser("show", help="one build's summary")
    show.add_argument("name", choices=sorted(sm90_builds()))
    show.add_argument("--sass", default=None, help="also write its SASS here")
    js = sub.add_parser("json", help=argparse.SUPPRESS)   # compile_many's child: JSON summaries on stdout
    js.add_argument("names", nargs="+")
    a = p.parse_args(argv)
    if a.cmd == "json":
        res = {}
        for n in a.names:
            try:
                res[n] = compile_sm90(n)[0]
            except Exception as e:  # noqa: BLE001 - reported to the caller
                res[n] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print(json.dumps(res))
        return 0
    if a.cmd == "show":
        s, sass = compile_sm90(a.name)
        print(json.dumps(s, indent=1))
        if a.sass:
            with open(a.sass, "w") as f:
                f.write(sass)
        return 0
    only = getattr(a, "only", None)
    res = compile_many(sorted(only or sm90_builds()))
    bad = {n: r["error"] for n, r in res.items() if "error" in r}
    if bad:
        for n, e in bad.items():
            print(f"{n}: {e}", file=sys.stderr)
        return 1
    if a.cmd == "record":
        path = a.out or golden_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        doc = {"triton": triton_version(), "commit": _commit(), "arch": "sm_90a", "builds": res}
        if only:   # the other builds' entries (and the commit they were recorded at) stay as they are
            with open(golden_path()) as f:
                doc = json.load(f)
            doc["builds"].update(res)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {path} ({len(res)} builds, triton {doc['triton']}, commit {doc['commit'][:10]})")
        return 0
    with open(golden_path()) as f:
        golden = json.load(f)["builds"]
    failed = 0
    for n in sorted(res):
        why = renumbering(n)
        d = diff(golden.get(n, {}), res[n], renumbered=why is not None)
        note = " (registers renumbered: sha256_regs, not the strict hashes)" if why else ""
        print(f"{n}: {'same' if not d else 'DIFFERS'}{note}")
        for line in d:
            print("   ", line)
        failed += bool(d)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
