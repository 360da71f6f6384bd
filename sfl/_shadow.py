"""Keep the repository's top-level folders from shadowing installed packages of the same name.

From a checkout the repository root is on sys.path (the current directory of `python -m ...`, or
PYTHONPATH), so a bare `import kernels` would find our kernels/ folder before HF's `kernels` package,
which transformers imports when it is installed. Each top-level folder's __init__.py therefore checks
the name it is imported under: as `sfl.<name>` it is ours; as the bare `<name>` it hands the import over
to the next package of that name on sys.path; with none, the import yields an empty placeholder (no
__file__, no submodules: what transformers' availability probe reads as "not installed", and what makes a
leftover `from kernels.ffn import ...` fail at once). This also keeps a module from being loaded twice
under two names (which would, e.g., register the torch.library ops twice).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

_REPO_ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def defer_to_installed(name: str) -> None:
    """Replace sys.modules[name] (our folder, imported by its bare name) by the installed package `name`.

    With no other package of that name, sys.modules[name] becomes an empty placeholder whose docstring
    says to import `sfl.<name>` instead.
    """
    search = [p for p in sys.path if os.path.realpath(p or os.curdir) != _REPO_ROOT]
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    if spec is None or spec.loader is None:
        placeholder = types.ModuleType(name, f"Not installed. This repository's {name}/ folder is the package "
                                             f"`sfl.{name}`: import it as `sfl.{name}`.")
        placeholder.__path__ = []  # a package with no submodules: `from {name}.x import y` fails at once
        sys.modules[name] = placeholder
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import statement returns what sys.modules holds once this __init__ ends
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
