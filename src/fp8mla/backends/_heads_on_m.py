"""The gluon backend's schedule slack for its heads-on-M build (``kernels/sm90/heads_on_m.py``; which plans it
takes is its record, ``capabilities.GLUON_HEADS_ON_M``)."""
from __future__ import annotations


def aligned_slack(build) -> int:
    """The request-aligned schedule's slack of a build: the persistent builds' ``ALIGNED_SLACK``, or (heads-on-M,
    one CTA per item) any, the aligned cut whenever it fits the CTAs (``kernels.split.UNBOUNDED_SLACK``: the device
    schedule's; the host schedule's longest-first rule sets its own)."""
    from ..kernels.split import ALIGNED_SLACK, UNBOUNDED_SLACK
    return UNBOUNDED_SLACK if build.heads_on_m else ALIGNED_SLACK
