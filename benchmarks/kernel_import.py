"""Import one module of ``zfunc.kernels`` even where ``zfunc`` itself does not import.

The kernels layer needs only numpy/numba/torch (and triton for the GPU ones);
the rest of zfunc also needs optree, which a bare GPU box may lack. The kernel
benchmarks then load the layer alone, under stub parent packages.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_kernel_module(name: str):
    """``zfunc.kernels.<name>``, with or without the rest of zfunc."""
    try:
        return importlib.import_module(f"zfunc.kernels.{name}")
    except ImportError as e:
        print(f"note: 'import zfunc' failed ({e}); loading zfunc/kernels alone", file=sys.stderr)
        for mod in [k for k in sys.modules if k == "zfunc" or k.startswith("zfunc.")]:
            del sys.modules[mod]
        for mod, path in (("zfunc", ["zfunc"]), ("zfunc.kernels", ["zfunc", "kernels"])):
            stub = types.ModuleType(mod)
            stub.__path__ = [os.path.join(REPO, *path)]
            sys.modules[mod] = stub
        return importlib.import_module(f"zfunc.kernels.{name}")
