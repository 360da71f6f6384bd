"""The project's one import name: `sfl.kernels`, `sfl.models`, `sfl.data`, `sfl.experiments`, `sfl.notebooks`.

The code lives in the repository's top-level folders (kernels/, models/, ...), whose bare names collide with
PyPI packages (HF's `kernels`, an optional transformers dependency, above all). So everything is imported
through `sfl`:
- from a checkout (run from the repository root, or with it on PYTHONPATH) and after `pip install -e .`,
  this package's search path is extended with the repository root, so `sfl.kernels` is <repo>/kernels;
- after a plain `pip install .`, the folders were copied under sfl/ (pyproject.toml maps them), and the
  search path is left alone.
"""
from __future__ import annotations

from pathlib import Path

SUBPACKAGES: tuple[str, ...] = ("kernels", "models", "data", "experiments", "notebooks")

_HERE = Path(__file__).resolve().parent
_CHECKOUT_ROOT = _HERE.parent


def _is_checkout() -> bool:
    """True when sfl/ sits in a repository checkout beside the real folders (not in an installed copy)."""
    if (_HERE / "kernels").is_dir():  # installed copy: the subpackages are inside sfl/
        return False
    return (_CHECKOUT_ROOT / "pyproject.toml").is_file() and all(
        (_CHECKOUT_ROOT / name / "__init__.py").is_file() for name in SUBPACKAGES)


if _is_checkout() and str(_CHECKOUT_ROOT) not in __path__:
    __path__.append(str(_CHECKOUT_ROOT))
