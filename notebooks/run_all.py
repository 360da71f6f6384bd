"""Execute the figure/table notebooks headless: `python -m sfl.notebooks.run_all [--only NAME ...] [--results DIR]`.

Each notebook is executed from a temporary copy (the committed .ipynb stays output-free, so no diff churn)
with the repository root as working directory; the notebooks write figures/*.png and paper_tables/*.md/.csv
(or wherever SFL_FIGURES_DIR / SFL_TABLES_DIR point). With --results DIR they plot a folder of your own runs
(e.g. runs/smoke/results) instead of the records, into DIR/figures and DIR/paper_tables. The kernel is this interpreter
(sys.executable -m ipykernel_launcher), so a fresh venv needs no registered kernelspec.
Exit status is non-zero if any notebook raised.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from tqdm import tqdm

NOTEBOOK_DIR = Path(__file__).resolve().parent
REPO_ROOT = NOTEBOOK_DIR.parent

# Order: the quickstart first (the main job regenerates it), then the paper's order.
ORDER = ["quickstart", "l1_sweep", "sparsify_smollm2", "speed", "kernel_bench", "activation_analysis", "ablations"]


def notebooks(only: list[str] | None = None) -> list[Path]:
    """Notebook paths in run order; `only` selects by stem (an unknown name is an error listing the choices)."""
    found = {p.stem: p for p in NOTEBOOK_DIR.glob("*.ipynb")}
    names = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
    if only:
        unknown = [n for n in only if n.removesuffix(".ipynb") not in found]
        if unknown:
            raise SystemExit(f"unknown notebook(s) {unknown}; choose from {names}")
        names = [n for n in names if n in {o.removesuffix('.ipynb') for o in only}]
    return [found[n] for n in names]


def _kernel_manager():
    """A KernelManager that starts `sys.executable -m ipykernel_launcher`, whatever kernelspecs exist."""
    class _ThisInterpreter(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002 - one kernel only
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="Python 3 (this interpreter)", language="python",
                              env={"MPLBACKEND": "Agg"}, resource_dir=str(NOTEBOOK_DIR))

    return KernelManager(kernel_name="python3", kernel_spec_manager=_ThisInterpreter())


def execute(path: Path, timeout: int = 600, keep_dir: Path | None = None) -> tuple[bool, str]:
    """Run one notebook; returns (ok, message). The executed copy goes to `keep_dir` if given, else is dropped."""
    for attempt in range(2):
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, km=_kernel_manager(), timeout=timeout, startup_timeout=180, allow_errors=False,
                                resources={"metadata": {"path": str(REPO_ROOT)}})
        ok, msg = True, "ok"
        try:
            client.execute()
        except CellExecutionError as e:
            ok, msg = False, str(e)
        except Exception as e:  # kernel died, timeout: report, keep going with the others
            ok, msg = False, f"{type(e).__name__}: {e}"
            if attempt == 0 and "before replying to kernel_info" in str(e):
                continue  # the kernel died while starting (seen on a loaded 2-core machine): start it once more
        break
    if keep_dir is not None:
        keep_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, keep_dir / path.name)
    return ok, msg


def run(only: list[str] | None = None, keep_dir: Path | None = None, timeout: int = 600) -> dict[str, tuple[bool, str]]:
    """Execute the selected notebooks in order; returns {name: (ok, message)} and writes paper_tables/INDEX.md."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    results: dict[str, tuple[bool, str]] = {}
    paths = notebooks(only)
    with tempfile.TemporaryDirectory(prefix="sfl_nb_") as tmp:
        bar = tqdm(paths, desc="notebooks", unit="nb")
        for p in bar:
            bar.set_postfix_str(p.stem)
            t0 = time.time()
            ok, msg = execute(p, timeout=timeout, keep_dir=keep_dir or Path(tmp))
            results[p.stem] = (ok, msg if not ok else f"ok in {time.time() - t0:.1f}s")
    sys.path.insert(0, str(REPO_ROOT))
    from . import nbutil  # here, not at the top: pandas and matplotlib load only when a run needs them

    nbutil.write_index()
    from . import claims  # the README's claims table, from the tables just written (it loads pandas too)

    try:
        claims.main()
    except SystemExit as e:  # a table it reads is missing (e.g. --only, or redirected dirs): say so, keep results
        print(f"paper_tables/claims.md not rewritten: {e}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="notebook stems to run (default: all)")
    ap.add_argument("--keep-executed", type=Path, default=None,
                    help="also write the executed notebooks (with outputs) into this directory")
    ap.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    ap.add_argument("--results", type=Path, default=None, metavar="DIR",
                    help="a folder of your own runs (e.g. runs/smoke/results) to plot instead of results/; "
                         "figures and tables go to DIR/figures and DIR/paper_tables")
    args = ap.parse_args(argv)
    if args.results is not None:
        from . import nbutil  # here, not at the top: pandas and matplotlib load only when a run needs them

        nbutil.use_results(args.results.resolve())
    results = run(args.only, args.keep_executed, args.timeout)
    failed = {k: v for k, v in results.items() if not v[0]}
    for name, (ok, msg) in results.items():
        print(f"{'OK  ' if ok else 'FAIL'} {name}: {msg if ok else msg.splitlines()[-1] if msg else ''}")
    for name, (_, msg) in failed.items():
        print(f"\n===== {name} failed =====\n{msg[-4000:]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
