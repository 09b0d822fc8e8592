"""fp8mla audit on planted cases: the same pool conversion (or compute-dtype KV plan) written the many ways
engine code writes it. Every case is a bug; each line marked ``# expect: RULE`` must be reported and nothing
else. ``CLEAN`` holds the look-alikes that must stay unreported (the false alarms each new spelling could bring)."""
from __future__ import annotations

import re

import pytest

from fp8mla.tools.audit import audit_source

_FWD = "class Impl:\n    def forward(self, q, layer, forward_batch, kv_cache, kv_caches):\n"


def _m(body: str) -> str:
    """``body`` (8-space indented lines) as the forward method of an attention backend."""
    return "import torch\n\n" + _FWD + body


PLANTED = {
    # -- spellings the audit has long found ------------------------------------------------------------------
    "to_q_dtype": _m("        k = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
                     "        return k.to(q.dtype)  # expect: KV001\n"),
    "float": _m("        return kv_cache.float()  # expect: KV001\n"),
    "half": _m("        return kv_cache.half()  # expect: KV001\n"),
    "bfloat16": _m("        return kv_cache.bfloat16()  # expect: KV001\n"),
    "double": _m("        return kv_cache.double()  # expect: KV001\n"),
    "type_as": _m("        return kv_cache.type_as(q)  # expect: KV001\n"),
    "type": _m("        return kv_cache.type(torch.float16)  # expect: KV001\n"),
    "dtype_keyword": _m("        return kv_cache.to(dtype=self.model_dtype)  # expect: KV001\n"),
    "torch_dtype": _m("        return kv_cache.to(torch.bfloat16)  # expect: KV001\n"),
    "to_tensor": _m("        return kv_cache.to(q)  # expect: KV001\n"),
    "alias": _m("        latent = kv_cache\n        cache = latent\n        return cache.float()  # expect: KV001\n"),
    "view_chain": _m("        return kv_cache.view(-1, 576).to(q.dtype)  # expect: KV001\n"),
    "slice": _m("        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
                "        return k_buffer[:, :, :512].float()  # expect: KV001\n"),
    "layer_index": _m("        kv = self.kv_buffer[layer.layer_id]\n        return kv.half()  # expect: KV001\n"),
    "unbind": _m("        k_cache, v_cache = kv_cache.unbind(0)\n"
                 "        return k_cache.to(q.dtype)  # expect: KV001\n"),
    "kv_tuple": _m("        k, v = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)\n"
                   "        return v.to(q.dtype)  # expect: KV001\n"),
    "loop": _m("        for kv in kv_caches:\n            kv.float()  # expect: KV001\n"),
    "self_attr": _m("        self.cache = kv_cache\n        return self.cache.to(q.dtype)  # expect: KV001\n"),
    "closure": _m("        k = kv_cache\n        def score():\n            return q @ k.float().T  # expect: KV001\n"
                  "        return score()\n"),
    "torch_flatten": _m("        return torch.flatten(kv_cache, 0, 1).float()  # expect: KV001\n"),
    "plan_keyword": (
        "from flashinfer import BatchMLAPagedAttentionWrapper\n"
        "def plan(w: BatchMLAPagedAttentionWrapper, qo, kv, idx, lens, model_runner):\n"
        "    w.plan(qo, kv, idx, lens, 16, 512, 64, 1, False, 0.1,  # expect: KV002\n"
        "           q_data_type=model_runner.dtype, kv_data_type=model_runner.dtype)\n"
        "def read(forward_batch, layer):\n    return forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"),
    "plan_positional": (
        "from flashinfer import BatchMLAPagedAttentionWrapper\n"
        "class Updater:\n    def __init__(self, model_runner, ws):\n        self.data_type = model_runner.dtype\n"
        "        self.w = BatchMLAPagedAttentionWrapper(ws)\n"
        "    def update(self, qo, kv, idx, lens, pool):\n"
        "        self.w.plan(qo, kv, idx, lens, 16, 512, 64, 1, False, 0.1,  # expect: KV002\n"
        "                    self.data_type, self.data_type)\n"
        "        return pool.token_to_kv_pool\n"),
    "plan_missed_site": (
        "from flashinfer import BatchDecodeWithPagedKVCacheWrapper\n"
        "class Backend:\n    def __init__(self, runner, ws):\n        self.kv_data_type = runner.kv_cache_dtype\n"
        "        self.q_data_type = runner.dtype\n        self.w = BatchDecodeWithPagedKVCacheWrapper(ws, 'NHD')\n"
        "    def capture(self, indptr, indices, last):\n"
        "        self.w.begin_forward(indptr, indices, last, 16, 1, 576, 1,  # expect: KV003\n"
        "                             q_data_type=self.q_data_type)\n"),
    "plan_forwarded": (
        "from flashinfer import BatchDecodeWithPagedKVCacheWrapper\n"
        "def fast_plan(self, indptr, indices, last, q_data_type, kv_data_type):\n"
        "    self.plan(indptr, indices, last, 8, 8, 128, 16, q_data_type=q_data_type, kv_data_type=kv_data_type)\n"
        "class Builder:\n    def __init__(self, model_config, ws):\n        self.model_config = model_config\n"
        "        self.w = BatchDecodeWithPagedKVCacheWrapper(ws)\n        self.kv_cache_dtype = None\n"
        "    def build(self, indptr, indices, last):\n"
        "        fast_plan(self.w, indptr, indices, last, q_data_type=self.model_config.dtype,  # expect: KV002\n"
        "                  kv_data_type=self.model_config.dtype)\n"),
    # -- dtype aliases whose names do not say "dtype" --------------------------------------------------------
    "alias_module_constant": "import torch\nBF16 = torch.bfloat16\n\n" + _FWD +
                             "        return kv_cache.to(BF16)  # expect: KV001\n",
    "alias_local_target": _m("        target = q.dtype\n"
                             "        return kv_cache.view(-1, 576).to(target)  # expect: KV001\n"),
    "alias_self_attr": ("import torch\n\nclass Impl:\n    def __init__(self, runner):\n"
                        "        self.act = runner.dtype\n"
                        "    def forward(self, q, kv_cache):\n"
                        "        return kv_cache.to(self.act)  # expect: KV001\n"),
    # -- the pool passed to a helper, a method, a lambda -----------------------------------------------------
    "helper_function": ("import torch\n\ndef _widen(t, dtype):\n    return t.to(dtype)  # expect: KV001\n\n" + _FWD +
                        "        k = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
                        "        return _widen(k, q.dtype)\n"),
    "helper_method": ("import torch\n\nclass Impl:\n    def _upcast(self, x):\n"
                      "        return x.float()  # expect: KV001\n"
                      "    def forward(self, q, layer, forward_batch):\n"
                      "        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
                      "        return q @ self._upcast(k_buffer).T\n"),
    "helper_lambda": _m("        up = lambda t: t.to(torch.float32)  # expect: KV001\n"
                        "        return up(kv_cache)\n"),
    "helper_map": _m("        return list(map(lambda kv: kv.to(q.dtype), kv_caches))  # expect: KV001\n"),
    # -- comprehensions over a list of pools -----------------------------------------------------------------
    "comprehension": _m("        return [kv.to(q.dtype) for kv in kv_caches]  # expect: KV001\n"),
    "comprehension_enumerate": _m("        return {i: c.half() for i, c in enumerate(kv_caches)}  # expect: KV001\n"),
    # -- unusual call spellings ------------------------------------------------------------------------------
    "tensor_to_unbound": _m("        return torch.Tensor.to(kv_cache, q.dtype)  # expect: KV001\n"),
    "getattr_to": _m("        return getattr(kv_cache, 'to')(q.dtype)  # expect: KV001\n"),
    "default_dtype": _m("        return kv_cache.to(torch.get_default_dtype())  # expect: KV001\n"),
    # -- plan(**{...}) with a literal dict -------------------------------------------------------------------
    "plan_literal_kwargs": (
        "from flashinfer import BatchDecodeWithPagedKVCacheWrapper\n"
        "def plan(w: BatchDecodeWithPagedKVCacheWrapper, indptr, indices, last, model_config, kv_cache_dtype):\n"
        "    w.plan(indptr, indices, last, 32, 8, 128, 16,  # expect: KV002\n"
        "           **{'q_data_type': model_config.dtype, 'kv_data_type': model_config.dtype})\n"),
    # -- a pool name rebound on one branch only (vLLM 0.34.0's ROCm torch fallback, rocm_aiter_mla_sparse.py)
    "branch_rebinding": (
        "import torch\nFP8_DTYPE = torch.float8_e4m3fn\n\n"
        "def fp8_paged_mqa_logits_torch(q, kv_cache, weights, block_size, dim, shuffled=False):\n"
        "    num_block = kv_cache.shape[0]\n"
        "    kv_cache_flat = kv_cache.reshape(num_block, -1)\n"
        "    values = kv_cache_flat[:, : block_size * dim]\n"
        "    if shuffled:\n"
        "        values = _unshuffle_indexer_k_values(values, block_size, dim)\n"
        "    q = q.float()\n"
        "    kv_cache = values.reshape(num_block, block_size, 1, dim).view(FP8_DTYPE).float()  # expect: KV001\n"
        "    return kv_cache\n"),
}

CLEAN = {
    # an alias of the KV-cache dtype, a device alias, a gather first
    "alias_kv_constant": "import torch\nFP8 = torch.float8_e4m3fn\n\n" + _FWD + "        return kv_cache.to(FP8)\n",
    "alias_local_kv": _m("        target = self.kv_cache_dtype\n        return kv_cache.to(target)\n"),
    "alias_device": _m("        target = q.device\n        dev = torch.device('cuda')\n"
                       "        return kv_cache.to(target), kv_cache.to(dev)\n"),
    # helpers that gather first, move the device, or are never given the pool
    "helper_gathers": ("def _rows(t, idx, dtype):\n    return t[idx].to(dtype)\n\n" + _FWD +
                       "        return _rows(kv_cache, forward_batch.kv_indices, q.dtype)\n"),
    "helper_device": ("def _move(t, dev):\n    return t.to(dev)\n\n" + _FWD +
                      "        return _move(kv_cache, q.device)\n"),
    "helper_other_arg": ("def _widen(t, dtype):\n    return t.to(dtype)\n\n" + _FWD +
                         "        return _widen(q, torch.float32), _widen(kv_cache[forward_batch.idx], q.dtype)\n"),
    "helper_kv_dtype": ("def _cast(t, dtype):\n    return t.to(dtype)\n\n" + _FWD +
                        "        return _cast(kv_cache, self.kv_cache_dtype), _cast(kv_cache, kv_cache.dtype)\n"),
    "map_gathers": _m("        return list(map(lambda kv: kv[forward_batch.idx].float(), kv_caches))\n"),
    "lambda_gathers": _m("        pick = lambda t: t[forward_batch.kv_indices].float()\n"
                         "        return pick(kv_cache)\n"),
    # comprehensions over gathered rows or other tensors
    "comprehension_gathered": _m("        return [kv[forward_batch.idx].to(q.dtype) for kv in kv_caches]\n"),
    "comprehension_other": _m("        return [x.float() for x in (q, self.bias)]\n"),
    # unusual spellings that are not conversions
    "getattr_view": _m("        return getattr(kv_cache, 'view')(torch.uint8), torch.Tensor.to(kv_cache, q.device)\n"),
    # plan(**{...}) with the KV dtype right
    "plan_literal_kwargs_kv": (
        "from flashinfer import BatchDecodeWithPagedKVCacheWrapper\n"
        "def plan(w: BatchDecodeWithPagedKVCacheWrapper, indptr, indices, last, model_config, kv_cache_dtype):\n"
        "    w.plan(indptr, indices, last, 32, 8, 128, 16,\n"
        "           **{'q_data_type': model_config.dtype, 'kv_data_type': kv_cache_dtype})\n"),
    # every branch rebinds the name, or the branch that keeps it leaves
    "branch_both_rebind": _m("        values = kv_cache.flatten(0, 1)\n        if self.shuffled:\n"
                             "            values = values[forward_batch.idx]\n        else:\n"
                             "            values = values.index_select(0, forward_batch.idx)\n"
                             "        return values.float()\n"),
    "branch_keeps_and_leaves": _m("        values = kv_cache.flatten(0, 1)\n        if self.shuffled:\n"
                                  "            return None\n        values = values[forward_batch.idx]\n"
                                  "        return values.float()\n"),
    # a target computed from the pool itself: its own dtype (SGLang 0.5.23 qsa/mqa.py's scoring dtype)
    "own_dtype_computed": ("import torch\n\ndef _scoring_dtype(q, k):\n"
                           "    return torch.float8_e4m3fn if k.dtype == torch.float8_e4m3fn else torch.bfloat16\n\n"
                           "def decode(q, k_cache, kernel):\n    scoring_dtype = _scoring_dtype(q, k_cache)\n"
                           "    return kernel(q.to(scoring_dtype), k_cache.to(scoring_dtype).contiguous())\n"),
}


def _marks(src: str) -> list:
    return [(i, m.group(1)) for i, line in enumerate(src.splitlines(), 1)
            for m in [re.search(r"#\s*expect:\s*(KV\d{3})", line)] if m]


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_bug_is_found(name):
    src = PLANTED[name]
    got = [(f.line, f.rule) for f in audit_source(src)]
    assert got == _marks(src), [str(f) for f in audit_source(src)]


@pytest.mark.parametrize("name", list(CLEAN))
def test_look_alike_is_not_reported(name):
    assert [str(f) for f in audit_source(CLEAN[name])] == []


def test_the_planted_set():
    assert len(PLANTED) == 38 and all(_marks(s) for s in PLANTED.values())


def test_a_finding_in_a_helper_names_the_calls_that_reach_it():
    src = ("import torch\n\ndef _widen(t, dtype):\n    return t.to(dtype)\n\n"
           "def _scores(q, k):\n    return q @ _widen(k, q.dtype).T\n\n" + _FWD +
           "        k = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
           "        return _scores(q, k)\n")
    (f,) = audit_source(src)
    assert (f.line, f.rule) == (4, "KV001")
    assert "passed in by `_scores(q, k)` (line 12), then `_widen(k, q.dtype)` (line 7)) to dtype (= `q.dtype`)" \
        in f.message
    # three calls deep is past what is followed
    deeper = src.replace("return _scores(q, k)", "return self._outer(q, k)") + \
        "    def _outer(self, q, k):\n        return _scores(q, k)\n"
    assert audit_source(deeper) == []


def test_a_helper_is_judged_at_each_call():
    """A helper called first with the KV dtype (right) and then with the query's (the bug)."""
    src = ("def _cast(t, dtype):\n    return t.to(dtype)\n\n" + _FWD +
           "        a = _cast(kv_cache, self.kv_cache_dtype)\n        return a, _cast(kv_cache, q.dtype)\n")
    (f,) = audit_source(src)
    assert f.line == 2 and "passed in by `_cast(kv_cache, q.dtype)` (line 7)" in f.message


@pytest.mark.parametrize("kw, n", [
    ("kw = dict(q_data_type=model_config.dtype, kv_data_type=model_config.dtype)\n", 1),
    ("kw = {'q_data_type': model_config.dtype, 'kv_data_type': model_config.dtype}\n", 1),
    ("kw = {'q_data_type': model_config.dtype, 'kv_data_type': kv_cache_dtype}\n", 0),
    # changed after it was written: its keys cannot be read off the literal
    ("kw = {'q_data_type': model_config.dtype}\n    kw['kv_data_type'] = model_config.dtype\n", 0),
])
def test_plan_with_a_local_literal_dict(kw, n):
    src = ("from flashinfer import BatchDecodeWithPagedKVCacheWrapper\n"
           "def plan(w: BatchDecodeWithPagedKVCacheWrapper, indptr, indices, last, model_config, kv_cache_dtype):\n"
           "    " + kw + "    w.plan(indptr, indices, last, 32, 8, 128, 16, **kw)\n")
    assert [f.rule for f in audit_source(src)] == ["KV002"] * n


def test_a_getattr_conversion_in_a_directory_is_parsed(tmp_path):
    from fp8mla.tools.audit import audit_run
    (tmp_path / "backend.py").write_text("def f(q, kv_cache):\n    return getattr(kv_cache, 'float')()\n")
    r = audit_run([tmp_path])
    assert [(f.line, f.rule) for f in r.findings] == [(2, "KV001")] and r.not_parsed == 0


@pytest.mark.parametrize("setup, alias, flagged", [
    ("BF16 = torch.bfloat16\n", "BF16", True),
    ("", "self.act", True),
    ("FP8 = torch.float8_e4m3fn\n", "FP8", False),
    ("", "self.kv", False),
])
def test_both_rules_read_a_dtype_alias_alike(setup, alias, flagged):
    """The same alias is a compute dtype (or the KV dtype) to the cast rule and to the plan rule."""
    src = ("import torch\nfrom flashinfer import BatchMLAPagedAttentionWrapper\n" + setup +
           "class Impl:\n    def __init__(self, runner, ws):\n        self.act = runner.dtype\n"
           "        self.kv = runner.kv_cache_dtype\n        self.w = BatchMLAPagedAttentionWrapper(ws)\n"
           "    def plan(self, qo, kv, idx, lens):\n"
           f"        self.w.plan(qo, kv, idx, lens, 16, 512, 64, 1, False, 0.1, {alias}, {alias})\n"
           f"    def forward(self, q, kv_cache):\n        return kv_cache.to({alias})\n")
    got = sorted(f.rule for f in audit_source(src))
    assert got == (["KV001", "KV002"] if flagged else [])
