"""A stand-in for SGLang's CUDA kernel package ``sgl_kernel`` (PyPI sglang-kernel 0.4.10: a 373 MB wheel, too
large to carry to an offline GPU machine with the tree), for lab/scripts/sglang_kit_device.sh only.

On a CUDA machine SGLang imports sgl_kernel at module level (quantization schemes, GGUF, ...) on the way to the
attention unit-test kit, which itself runs no sgl_kernel op on fp8mla's path. Here every ``sgl_kernel.*``
submodule imports and every attribute is a MagicMock (module-level code reads constants such as
``scalar_types.uint4b8``). A call of one prints ``sgl_kernel stand-in called: NAME`` to stderr once per name, so a
run that does reach a real kernel says so in its log (and gets a MagicMock back, which fails at the first tensor
use)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from unittest import mock

__version__ = "0.0.0+stand-in"
__path__: list = []
_CALLED: set = set()


def _stand_in(qualname: str) -> mock.MagicMock:
    def called(*args, **kwargs):
        if qualname not in _CALLED:
            _CALLED.add(qualname)
            print(f"sgl_kernel stand-in called: {qualname}", file=sys.stderr, flush=True)
        return mock.DEFAULT  # the MagicMock's own return value
    return mock.MagicMock(name=qualname, side_effect=called)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stand_in(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``sgl_kernel.<sub>`` import with a _Module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    value = _stand_in(f"{__name__}.{name}")
    globals()[name] = value
    return value
