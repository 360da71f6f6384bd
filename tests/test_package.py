"""The project imports as one package, `sfl`, from a checkout and after `pip install` (plain and editable),
and its top-level folders never shadow installed packages of the same name (HF's `kernels` above all)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("kernels", "models", "data", "experiments", "notebooks")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _run(code: str, cwd: Path, pythonpath: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_pyproject_lists_every_package_folder():
    want = {"sfl"}
    for top in TOP:
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO)
            want.add("sfl." + ".".join(rel.parts))
    assert set(PYPROJECT["packages"]) == want
    assert PYPROJECT["package-dir"] == {"sfl": "sfl", **{f"sfl.{t}": t for t in TOP}}


def test_python_files_live_in_listed_packages():
    """A .py file in a folder without __init__.py would be left out of a plain install (data/tasks/ is data)."""
    for top in TOP:
        for py in (REPO / top).rglob("*.py"):
            if "__pycache__" in py.parts or py.parent == REPO / "data" / "tasks":
                continue
            assert (py.parent / "__init__.py").is_file(), f"{py.relative_to(REPO)}: its folder has no __init__.py"


_OLD_IMPORT = re.compile(rf"(?<![\w.])(from ({'|'.join(TOP)})(\.\w+)* import |import ({'|'.join(TOP)})\b(?!\.?\w*/)"
                         rf"|-m ({'|'.join(TOP)})\.)")


def test_no_bare_top_level_imports_left():
    """Every import and `python -m` names `sfl.<folder>` (or is relative); bare names would shadow PyPI packages."""
    suffixes = {".py", ".sh", ".ipynb", ".md"}
    hits = []
    for path in [REPO / ".ci" / "run", *REPO.glob("*.md"),
                 *(p for top in (*TOP, "tests") for p in (REPO / top).rglob("*") if p.suffix in suffixes)]:
        if "__pycache__" in path.parts or not path.is_file() or path == Path(__file__).resolve():
            continue  # (this file and sfl/_shadow.py name the bare imports on purpose)
        for n, line in enumerate(path.read_text().splitlines(), 1):
            line = line.replace("from sfl import", "")
            if _OLD_IMPORT.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "bare top-level imports (use sfl.<name> or a relative import):\n" + "\n".join(hits)


def test_checkout_imports_sfl_and_bare_names_are_placeholders():
    r = _run("import sfl.models, sfl.kernels.ffn, sfl.experiments.trainer.train, sfl.data, sfl.notebooks.nbutil\n"
             "import kernels, models\n"
             "print(sfl.kernels.ffn.__file__)\n"
             "print(getattr(kernels, '__file__', None), 'sfl.kernels' in kernels.__doc__)\n"
             "try:\n    from kernels.ffn import sparse_gated_ffn\nexcept ModuleNotFoundError as e:\n    print('refused')\n",
             cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == str(REPO / "kernels" / "ffn.py")
    assert lines[1] == "None True"  # transformers' availability probe reads a package without __file__ as absent
    assert lines[2] == "refused"


def _fake_installed_kernels(root: Path) -> Path:
    """A stand-in for HF's `kernels` package (PyPI) in its own site dir."""
    pkg = root / "site" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '9.9.9'\nFROM_PYPI = True\n")
    (pkg / "layer.py").write_text("X = 1\n")
    return root / "site"


def test_installed_kernels_package_is_not_shadowed(tmp_path):
    site = _fake_installed_kernels(tmp_path)
    r = _run("import sfl.models\nfrom sfl.models import SparseLlamaForCausalLM\nimport kernels, kernels.layer\n"
             "import sfl.kernels.ffn\nprint(kernels.FROM_PYPI, kernels.layer.X, sfl.kernels.ffn.__file__)\n",
             cwd=REPO, pythonpath=[str(REPO), str(site)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1", str(REPO / "kernels" / "ffn.py")]


def _copy_project(dst: Path) -> Path:
    """The files a pip install reads, copied so the build leaves no egg-info/build dirs in the checkout."""
    for name in ("sfl", *TOP):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dst / name)
    return dst


def _pip_install(args: list[str]) -> None:
    pytest.importorskip("setuptools")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


_CHECK_INSTALLED = ("import sfl, sfl.models, sfl.kernels.loader as L, sfl.data.lm_tasks as T\n"
                    "from sfl.models import SparseLlamaForCausalLM\n"
                    "import sfl.experiments.trainer.train, sfl.notebooks.run_all\n"
                    "srcs = L.TWELL_SOURCES + L.COMMON_HEADERS\n"
                    "print(len(L.COMMON_HEADERS) > 0 and all(p.is_file() for p in srcs), "
                    "len(list(T.TEMPLATE_DIR.glob('sfl_*.yaml'))), L.TWELL_SOURCES[0].parents[1])\n"
                    "import kernels\nprint(kernels.FROM_PYPI)\n")


def test_plain_pip_install_works_from_any_directory(tmp_path):
    src = _copy_project(tmp_path / "src")
    target = tmp_path / "target"
    _pip_install(["--target", str(target), str(src)])
    assert (target / "sfl" / "kernels" / "twell" / "twell_kernels.cu").is_file()
    site = _fake_installed_kernels(tmp_path)
    r = _run(_CHECK_INSTALLED, cwd=tmp_path, pythonpath=[str(target), str(site)])
    assert r.returncode == 0, r.stderr
    ok, n_tasks, kernels_dir, from_pypi = r.stdout.split()
    assert (ok, n_tasks, from_pypi) == ("True", "7", "True")
    assert Path(kernels_dir) == target / "sfl" / "kernels"


def test_editable_install_works_from_any_directory(tmp_path):
    src = _copy_project(tmp_path / "src")
    prefix = tmp_path / "prefix"
    _pip_install(["--prefix", str(prefix), "-e", str(src)])
    sites = list(prefix.glob("lib/python*/site-packages"))
    assert len(sites) == 1
    fake = _fake_installed_kernels(tmp_path)
    # .pth files (the editable finder) are processed for site dirs, not for PYTHONPATH entries
    r = _run(f"import site; site.addsitedir({str(sites[0])!r})\n" + _CHECK_INSTALLED, cwd=tmp_path,
             pythonpath=[str(fake)])
    assert r.returncode == 0, r.stderr
    ok, n_tasks, kernels_dir, from_pypi = r.stdout.split()
    assert (ok, n_tasks, from_pypi) == ("True", "7", "True")
    assert Path(kernels_dir) == src / "kernels"
