"""Engine integrations: fp8mla as the MLA attention backend of vLLM (``FP8MLA``) and SGLang (``fp8mla``).

Importing this package imports no engine. The engines find the backends through entry points declared in
``pyproject.toml``: ``vllm.general_plugins`` -> :func:`fp8mla.integrations.vllm.register` and
``sglang.srt.plugins`` -> :func:`fp8mla.integrations.sglang.register`. Each checks the installed engine
against :data:`fp8mla.integrations.versions.SUPPORTED` before touching its internals.
"""
from .versions import SUPPORTED, UnsupportedEngineVersion, check_version

__all__ = ["SUPPORTED", "UnsupportedEngineVersion", "check_version"]
