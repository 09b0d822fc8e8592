"""The model layer (``src/fp8mla/models/``) uses the cache and the attention wrappers through their public verbs
and records only (``PagedMLACache.seq_state / seq_states / fork_count / shared_page / id_list``,
``MLAPagedAttention.replan_rows / graph_buffers``): no module there reads a private attribute (``obj._name``) of an
object it did not define. The rule, read from the source: a ``._name`` attribute is read only on ``self``, ``cls``
or ``super()`` (a class's own state, or a subclass's hook: ``DSACache._unshare_last_page``), and
``getattr`` / ``hasattr`` / ``setattr`` never name a private attribute."""
from __future__ import annotations

import ast
import glob
import os

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "fp8mla", "models")
OWN = ("self", "cls")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reach_ins(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each private attribute read on an object other than ``self`` / ``cls`` /
    ``super()``, and of each getattr / hasattr / setattr naming a private attribute."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            v = node.value
            own = (isinstance(v, ast.Name) and v.id in OWN) or (
                isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super")
            if not own:
                out.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_the_rule_sees_each_kind_of_reach_in():
    src = ("def f(self, cache, attn, step):\n"
           "    a = cache._seqs\n"                        # a cache's private table
           "    b = self.cache._forks\n"                  # through an attribute of self
           "    attn._replan_rows([], [])\n"              # a private method
           "    c = getattr(step.cache, '_seqs', {})\n"  # by name
           "    d = hasattr(cache, '_id_list')\n"
           "    e = self._rows, cls._n, super()._hook(), cache.__class__, cache.pages(0)\n")
    found = private_reach_ins(src)
    assert sorted(line for line, _ in found) == [2, 3, 4, 5, 6], found


def test_models_reach_into_no_private_attributes():
    files = sorted(glob.glob(os.path.join(MODELS, "*.py")))
    assert len(files) >= 5, files
    bad = []
    for path in files:
        with open(path) as f:
            bad += [f"{os.path.basename(path)}:{line}: {expr}" for line, expr in private_reach_ins(f.read())]
    assert not bad, "private attributes read from another module (use the public verbs):\n" + "\n".join(bad)


def test_cache_verbs_the_models_use():
    """The records and verbs behind the models' staleness checks: a state per life of an id, a read-only table, the
    fork count, and the first shared page of a token range (None once a reservation unshared it)."""
    import pytest
    from fp8mla import PagedMLACache
    cache = PagedMLACache(1, 8, 4, "bf16", head_dim_ckv=8, head_dim_kpe=4)
    a = cache.add_sequence(0, num_tokens=6)            # pages: 2, the second half full
    first = cache.seq_state(a)
    assert cache.seq_states[a] is first and first.length == 6 and len(first.pages) == 2
    with pytest.raises(TypeError):
        cache.seq_states[99] = first                   # a view, not the cache's own table
    with pytest.raises(KeyError, match="seq_id: no sequence 7"):
        cache.seq_state(7)
    assert cache.fork_count == 0 and cache.shared_page(a, 0, 6) is None
    b = cache.fork(a, 1)
    assert cache.fork_count == 1
    assert cache.shared_page(a, 4, 2) == first.pages[1] and cache.shared_page(b, 0, 1) == first.pages[0]
    assert cache.shared_page(a, 4, 0) is None
    cache.reserve([a], 1)                              # unshares a's partly filled last page
    assert cache.shared_page(a, 4, 3) is None and cache.shared_page(a, 0, 4) == first.pages[0]
    cache.free(a)
    assert cache.seq_states.get(a) is None
    cache.add_sequence(a)
    assert cache.seq_state(a) is not first             # a new life of the id: a new state
    assert cache.id_list(range(3)) == [0, 1, 2] and cache.id_list(5) == [5]


def private_imports_from_below(source: str) -> list[tuple[int, str]]:
    """(line, name) of each private name (``_x``) that a models/ module imports from a module outside models/
    (a lower layer: kernels, cache, attention ...); names shared between models/ modules are theirs to keep."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level != 1 or node.module is None):
            out += [(node.lineno, a.name) for a in node.names if _private(a.name)]
    return out


def test_models_import_no_private_names_from_lower_layers():
    assert private_imports_from_below("from ..kernels.quant_append import E4M3, _store\nfrom .deepseek import _rope\n"
                                      "from fp8mla.cache import _x\n") == [(1, "_store"), (3, "_x")]
    bad = []
    for path in sorted(glob.glob(os.path.join(MODELS, "*.py"))):
        with open(path) as f:
            bad += [f"{os.path.basename(path)}:{line}: {name}" for line, name in private_imports_from_below(f.read())]
    assert not bad, "private names imported from below models/ (give them a public name there):\n" + "\n".join(bad)
