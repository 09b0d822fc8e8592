"""The engine plugins' ``register()`` without the engine installed: an error that names the engine, the versions
supported and what was found (was a bare ModuleNotFoundError; the clear message was only logged)."""
from __future__ import annotations

import importlib
import importlib.util
import logging

import pytest

from fp8mla.integrations.versions import SUPPORTED


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_register_without_the_engine_names_it(engine, caplog):
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed (tests/engines/ runs its plugin)")
    plugin = importlib.import_module(f"fp8mla.integrations.{engine}")
    with caplog.at_level(logging.WARNING), pytest.raises(ModuleNotFoundError) as err:
        plugin.register()
    msg = str(err.value)
    assert msg.startswith(f"fp8mla.integrations.{engine}.register: expected {engine} "), msg
    assert all(v in msg for v in SUPPORTED[engine]) and f"fp8mla[{engine}]" in msg, msg
    assert msg.endswith(f"got: {engine} is not installed"), msg
    assert err.value.name == engine
    assert not caplog.records, "the error is raised, not only logged"
    assert plugin._registered is False
