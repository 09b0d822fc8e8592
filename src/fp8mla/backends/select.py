"""Which build runs a plan: one ``select`` for the dense API (``MLAPagedAttention``), the sparse one
(``MLASparseAttention``) and DeepSeek V4's (``V4SparseAttention``).

Every build declares what it supports in one :class:`Capability` record (``backends/capabilities.py``); a plan is
described by a :class:`Question`. ``select(question, requested)`` walks the builds of the question's API in their
order of preference and answers with the first that takes the plan (a :class:`Choice`: its record and, for the
Gluon dense builds, the named variant), or a :class:`Refusal` that says, for every build it passed over, what is
missing. ``requested`` is the wrapper's backend: ``"auto"`` takes the first build that fits, a named backend only
its own builds (``backend="gluon"`` then raises the reason, see :func:`refusal_error`). The answer depends on the
question only: the APIs keep it per wrapper, keyed on their spec and the batch's query lengths, so a re-plan costs
one dictionary compare.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

import torch

from .. import runtime
from ._invariant import GLUON_AUTO
from .capabilities import BUILDS, DEFAULT_STAGES, NAMED, Capability

__all__ = ["Capability", "Choice", "Question", "Refusal", "dense_question", "qo_range", "refusal_error", "select",
           "sparse_question", "v4_question", "without_gluon"]

# What a device kind needs, in the words of the refusals (runtime's checks decide it)
DEVICE_NEEDS = {"sm90": "needs an sm_90 GPU and triton.experimental.gluon",
                "triton": "needs triton and a CUDA device, or TRITON_INTERPRET=1 on the CPU",
                "cuda": "auto runs the Triton kernels on CUDA devices (the CPU interpreter only by name)"}


@dataclass(frozen=True)
class Question:
    """A plan as the selector sees it. ``qo_range``: the batch's shortest and longest query count per request
    (None when the query lengths are device-only); ``max_qo``: the query tokens per request the build is made for
    (the longest, or what a CUDA-graph wrapper's first plan fixed); ``topk``: index entries per row (sparse)."""

    api: str
    device: torch.device
    tags: frozenset
    num_heads: int
    head_dims: tuple
    page_size: int
    q_dtype: torch.dtype
    kv_format: str
    causal: bool = True
    qo_range: tuple | None = (1, 1)
    max_qo: int = 1
    topk: int = 0
    batch_invariant: bool = False
    fp8_math: bool = False
    heads_on_m: bool | None = None
    num_stages: int | None = None   # None: the default ring (only another depth asks for the wide build)


@dataclass(frozen=True)
class Choice:
    """The build that runs a plan."""

    capability: Capability
    build: object = None      # the named variant (``sm90.Sm90Build``) of a build with a ``finish``
    passed_over: tuple = ()   # (build name, why) of the builds before it that did not take the plan

    @property
    def backend(self) -> str:
        return self.capability.backend

    @property
    def module(self) -> str:
        return self.capability.module


@dataclass(frozen=True)
class Refusal:
    """No build takes the plan (among those ``requested`` allows): each considered build with its reason."""

    requested: str
    reasons: tuple        # (capability, why, device_fits) for every build considered
    device: torch.device

    @property
    def reason(self) -> str:
        """What is missing: the last build whose device fits (the one a user is told about), else the last."""
        fits = [why for _, why, ok in self.reasons if ok]
        return fits[-1] if fits else (self.reasons[-1][1] if self.reasons else "no build")

    @property
    def device_fits(self) -> bool:
        return any(ok for _, _, ok in self.reasons)


def qo_range(layout) -> tuple | None:
    """(shortest, longest) query count per request of a layout (O(batch)); None when they are device-only."""
    qo = layout.qo_lens
    if qo is None:
        return None
    return (min(qo), max(qo)) if qo else (1, 1)


def dense_question(spec, qo: tuple | None, options: dict, max_qo: int | None = None) -> Question:
    """The question of a dense plan (``AttentionSpec``, the batch's ``qo_range``, the wrapper's kernel options)."""
    ns = options.get("num_stages")
    return Question("dense", spec.device, runtime.device_tags(spec.device), spec.num_heads,
                    (spec.head_dim_ckv, spec.head_dim_kpe), spec.page_size, spec.q_dtype, spec.kv_format.name,
                    spec.causal, qo, max_qo or max(1, qo[1] if qo else 1), 0, bool(options.get("batch_invariant")),
                    bool(options.get("fp8_math")), options.get("heads_on_m"),
                    None if ns in (None, DEFAULT_STAGES) else int(ns))


def sparse_question(num_heads: int, topk: int, fmt, q_dtype, device, batch_invariant: bool) -> Question:
    """The question of a sparse plan (the latent widths are checked before: 512 + 64)."""
    device = torch.device(device)
    return Question("sparse", device, runtime.device_tags(device), num_heads, (512, 64), 0, q_dtype, fmt.name,
                    topk=topk, batch_invariant=batch_invariant)


def v4_question(num_heads: int, fmt, q_dtype, device, topk: int, batch_invariant: bool = False) -> Question:
    """The question of a V4 plan (``V4SparseAttention``: 512-wide K = V rows, ``topk`` = window + compressed)."""
    device = torch.device(device)
    return Question("v4", device, runtime.device_tags(device), num_heads, (512, 0), 0, q_dtype, fmt.name,
                    topk=topk, batch_invariant=batch_invariant)


def select(q: Question, requested: str = "auto"):
    """The first build of ``q.api`` (in ``BUILDS`` order) that takes ``q``, among the builds ``requested`` allows:
    a :class:`Choice`, or a :class:`Refusal` naming what each one misses. ``heads_on_m`` True asks for that build
    only, False never takes it; ``fp8_math`` only the builds that run it. Under ``auto`` a build marked
    ``falls_back=False`` whose device fits ends the walk with its reason (the Triton sparse kernel: the torch code
    is never a quiet fallback on a GPU)."""
    auto = requested == "auto"
    seen = []
    for cap in BUILDS[q.api]:
        if not (auto or cap.backend == requested) or (auto and not cap.auto):
            continue
        asked = getattr(q, cap.option) if cap.option else None   # an option that asks for (or excludes) this build
        if asked is False or (q.heads_on_m and cap.option != "heads_on_m"):
            continue
        if q.fp8_math and not cap.fp8_math_formats and not asked:
            continue
        device_ok = _device_fits(cap, q, auto)
        if not device_ok:
            why = _device_refusal(cap, q, auto)
        elif auto and q.batch_invariant and cap.batch_invariant == NAMED:
            why = GLUON_AUTO   # (a build that takes the mode only when named)
        else:
            why = refusal(cap, q)
        build = None
        if not why and cap.finish is not None:
            build = _finish(cap, q)
            why = build if isinstance(build, str) else ""
        if not why:
            return Choice(cap, build, tuple((c.name, w) for c, w, _ in seen))
        if asked and device_ok:
            why = f"{cap.option}=True: {cap.title} does not take this plan: {why}"
        seen.append((cap, why, device_ok))
        if auto and device_ok and not cap.falls_back:
            break
    return Refusal(requested, tuple(seen), q.device)


def refusal_error(r: Refusal, error=ValueError) -> Exception:
    """The exception a refused plan raises: a backend that cannot run on the device a RuntimeError (as
    ``runtime.choose_backend``), a plan gluon does not take ``backend: 'gluon' does not support this plan: why``,
    any other ``error(why)``."""
    if r.requested != "auto" and not r.device_fits:
        kind = r.reasons[-1][0].device if r.reasons else "any"
        return RuntimeError(f"backend: {r.requested!r} cannot run on {r.device} here ({DEVICE_NEEDS.get(kind, kind)})")
    if r.requested == "gluon":
        return ValueError(f"backend: 'gluon' does not support this plan: {r.reason}; use backend='triton'")
    return error(r.reason)


def without_gluon(q: Question) -> Question:
    """``q`` on its device without the Gluon builds and their options (``fp8_math``, ``heads_on_m``): where
    ``auto`` sends a plan that gluon does not take."""
    return replace(q, tags=q.tags - {"sm90"}, fp8_math=False, heads_on_m=None)


# -- the checks of one record ------------------------------------------------------------------------------------
def _device_fits(cap: Capability, q: Question, auto: bool) -> bool:
    return (cap.device == "any" or cap.device in q.tags) and \
        (not auto or cap.auto_device == "any" or cap.auto_device in q.tags)


def _device_refusal(cap: Capability, q: Question, auto: bool) -> str:
    kind = cap.device if cap.device != "any" and cap.device not in q.tags else cap.auto_device
    return f"{cap.title} runs on no {q.device} here ({DEVICE_NEEDS.get(kind, kind)})"


def _finish(cap: Capability, q: Question):
    module, name = cap.finish.split(":")
    try:
        fn = getattr(importlib.import_module(f".{module}", __package__), name)
    except Exception as e:   # noqa: BLE001 - not built on this install, or Gluon missing
        return f"the {cap.backend} backend is not available ({type(e).__name__}: {e})"
    return fn(q)


def refusal(cap: Capability, q: Question) -> str:
    """Why ``cap`` does not take ``q`` ("" when it does), its device aside. Each message names the argument, what
    the build takes and what came."""
    t = cap.title
    if q.batch_invariant and not cap.batch_invariant:
        return f"batch_invariant: {t} has no batch-invariant mode"
    if cap.formats is not None and q.kv_format not in cap.formats:
        return f"kv_data_type: {t} reads {' or '.join(sorted(cap.formats))}, got {q.kv_format!r}"
    if cap.q_dtypes is not None and q.q_dtype not in cap.q_dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in cap.q_dtypes)
        return f"q_data_type: {t} takes {names}, got {str(q.q_dtype).removeprefix('torch.')}"
    lo, hi = cap.heads
    if not lo <= q.num_heads <= hi:
        return f"num_heads: {t} takes {lo}..{hi}, got {q.num_heads}"
    if cap.head_dims is not None and q.head_dims not in cap.head_dims:
        want = " or ".join(f"{c} + {k}" for c, k in cap.head_dims)
        return f"head_dim_ckv/head_dim_kpe: {t} is built for {want}, got {q.head_dims[0]} + {q.head_dims[1]}"
    if cap.pow2_dims:
        for name, d in zip(("head_dim_ckv", "head_dim_kpe"), q.head_dims):
            if d < 16 or d & (d - 1):
                return f"{name}: {t} needs a power of two >= 16, got {d}; use backend='torch'"
    if q.page_size not in cap.page_sizes and q.page_size % cap.page_multiple:
        pages = ", ".join(map(str, cap.page_sizes))
        return f"page_size: {t} takes {pages + ' or ' if pages else ''}a multiple of {cap.page_multiple}, " \
               f"got {q.page_size}"
    why = _qo_refusal(cap, q)
    if why:
        return why
    if q.topk % cap.topk_multiple:
        return f"topk: {t} needs a multiple of {cap.topk_multiple} (pad the index rows with -1, or plan " \
               f"backend='torch'), got {q.topk}"
    if q.fp8_math and not cap.fp8_math_formats:
        return f"fp8_math: {t} runs the default 16-bit MMAs"
    if q.fp8_math and q.kv_format not in cap.fp8_math_formats:
        return f"fp8_math: FP8 tensor-core math takes per-tensor scales (kv format fp8_e4m3); this plan has " \
               f"per-token group scales ({q.kv_format}, or ckv_scale_arr at run())"
    if q.num_stages is not None and not cap.num_stages:
        return f"num_stages: {t}'s ring has its own depth (num_stages sets the wide build's ring), got " \
               f"{q.num_stages}"
    return ""


def _qo_refusal(cap: Capability, q: Question) -> str:
    """Query tokens per request: builds with a ``max_qo`` need the lengths on the host, 1..max_qo each and at
    most ``max_rows`` (query token, head) rows."""
    if cap.max_qo is None:
        return ""
    if q.qo_range is None:
        return "qo_indptr: the query lengths are device-only (they must be known on the host)"
    lo, hi = q.qo_range
    most = max(hi, q.max_qo)
    if lo < 1 or most > cap.max_qo or (cap.max_rows and most * q.num_heads > cap.max_rows):
        rows = f" with max qo_len x num_heads <= {cap.max_rows}" if cap.max_rows else ""
        return (f"qo_len: {cap.title} takes 1..{cap.max_qo} query tokens per request{rows}, got {lo}..{most} "
                f"at {q.num_heads} heads")
    return ""
