"""The gluon backend's choices for its heads-on-M build (``kernels/sm90/heads_on_m.py``): which plans it takes
(``heads_on_m_refusal``) and its schedule's slack (``aligned_slack``)."""
from __future__ import annotations

PAGE_MULTIPLE = 64   # pages the TMA row boxes take (the wide build's too)
DEFAULT_STAGES = 3   # gluon.DEFAULTS["num_stages"]: the wide build's ring; another num_stages asks for that build


def heads_on_m_refusal(spec, options: dict, max_qo: int) -> str:
    """Why the heads-on-M build (``sm90.heads_on_m``) does not take a plan the Gluon kernel accepts ("" when it
    does): it is built for FP8 e4m3 with per-tensor scales, the default numerics (not fp8_math), one query per
    request, pages of a multiple of 64, 33..128 heads and its own 2-stage ring (a ``num_stages`` other than the
    default asks for the wide build's ring)."""
    from ..kernels import sm90 as k
    ns = options.get("num_stages")
    checks = (
        (spec.kv_format.scale_kind == "tensor", lambda: f"kv format {spec.kv_format.name}: it takes per-tensor "
                                                        "scales (fp8_e4m3), not group scales"),
        (not options.get("fp8_math"), lambda: "fp8_math: it runs the default 16-bit MMAs"),
        (max_qo == 1, lambda: f"max qo_len {max_qo}: it takes one query per request"),
        (spec.page_size % PAGE_MULTIPLE == 0, lambda: f"page_size {spec.page_size}: it takes a multiple of 64"),
        (k.MH_MIN_HEADS <= spec.num_heads <= k.MAX_WIDE_HEADS,
         lambda: f"num_heads {spec.num_heads}: it takes {k.MH_MIN_HEADS}..{k.MAX_WIDE_HEADS}"),
        (ns is None or ns == DEFAULT_STAGES,
         lambda: f"num_stages {ns}: its ring is {k.MH_STAGES} stages (num_stages sets the wide build's ring)"),
    )
    for ok, why in checks:
        if not ok:
            return why()
    return ""


def aligned_slack(build) -> int:
    """The request-aligned schedule's slack of a build: the persistent builds' ``ALIGNED_SLACK``, or (heads-on-M,
    one CTA per item) any, the aligned cut whenever it fits the CTAs (``kernels.split.UNBOUNDED_SLACK``: the device
    schedule's; the host schedule's longest-first rule sets its own)."""
    from ..kernels.split import ALIGNED_SLACK, UNBOUNDED_SLACK
    return UNBOUNDED_SLACK if build.heads_on_m else ALIGNED_SLACK
