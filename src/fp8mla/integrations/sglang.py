"""SGLang plugin: registers fp8mla as the attention backend ``fp8mla``.

Installed as the ``sglang.srt.plugins`` entry point ``fp8mla`` (``pip install 'fp8mla[sglang]'``). SGLang runs
its general plugins at the start of every process (``sglang.srt.plugins.load_plugins``, before the CLI is
parsed); :func:`register` then

- adds ``fp8mla`` to the attention-backend registry (``attention_registry.register_attention_backend``), whose
  factory builds :class:`fp8mla.integrations.sglang_backend.FP8MLAAttnBackend` for MLA models;
- adds ``fp8mla`` to the CLI's ``--attention-backend`` choices (and the prefill/decode ones);
- registers a DeepSeek attention-method handler for ``fp8mla`` that keeps every forward on the absorbed MLA
  path (``forward_decode`` / ``forward_extend`` over the latent cache): without it SGLang would fall back to the
  Triton handler, which sends prompt prefill through the per-head MHA path.

Users then run ``sglang serve --model-path ... --attention-backend fp8mla --kv-cache-dtype fp8_e4m3``. The
SGLang version is checked first (:mod:`fp8mla.integrations.versions`); a plugin must not break an SGLang that
does not use it, so another version only logs here and building the backend raises the error naming what is
supported.
"""
from __future__ import annotations

import logging

from .versions import UnsupportedEngineVersion, check_version, require_installed

__all__ = ["BACKEND_NAME", "register", "create_backend"]

BACKEND_NAME = "fp8mla"
logger = logging.getLogger(__name__)
_registered = False


def create_backend(runner):
    """The registry factory: fp8mla's backend for MLA models (it checks the SGLang version on import)."""
    if not getattr(runner, "use_mla_backend", False):
        raise ValueError(f"--attention-backend {BACKEND_NAME}: fp8mla implements MLA attention (DeepSeek-V2/V3, "
                         "Kimi-K2, GLM-5 and other MLA models); this model does not use MLA")
    from .sglang_backend import FP8MLAAttnBackend
    return FP8MLAAttnBackend(runner)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (idempotent). Without SGLang installed it raises
    :class:`fp8mla.integrations.versions.EngineNotInstalled` (an ImportError) saying how to install it."""
    global _registered
    if _registered:
        return
    require_installed("sglang", "fp8mla.integrations.sglang.register()")
    try:
        check_version("sglang")
    except UnsupportedEngineVersion as e:  # create_backend raises it again, from the backend module
        logger.warning("%s", e)
    from sglang.srt.layers.attention import attention_registry
    attention_registry.register_attention_backend(BACKEND_NAME)(create_backend)
    try:
        from sglang.srt.arg_groups import choices
        for name in ("ATTENTION_BACKEND_CHOICES",):
            lst = getattr(choices, name, None)
            if isinstance(lst, list) and BACKEND_NAME not in lst:
                lst.append(BACKEND_NAME)
    except ImportError:  # another layout of SGLang's CLI choices: the registry entry still works from Python
        logger.warning("fp8mla: could not add %r to SGLang's --attention-backend choices", BACKEND_NAME)
    _register_deepseek_handler()
    _registered = True


def _register_deepseek_handler() -> None:
    try:
        from sglang.srt.models.deepseek_common.attention_backend_handler import (
            AttentionBackendRegistry,
            _dispatch_mla_subtype,
        )
    except ImportError:
        logger.warning("fp8mla: SGLang's DeepSeek attention handler registry was not found; DeepSeek models may "
                       "route prefill to the MHA path, which %r does not implement", BACKEND_NAME)
        return

    def handle_attention_fp8mla(attn, forward_batch):
        # Absorbed MLA for decode and extend alike: queries against the latent cache (fp8mla's forward_extend
        # runs the fresh tokens ragged and the cached prefix paged, merged by LSE).
        return _dispatch_mla_subtype(attn, forward_batch)

    AttentionBackendRegistry.register(BACKEND_NAME, handle_attention_fp8mla)
