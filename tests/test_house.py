"""lab/house.py (the import graph of the package folders) reads imports as a reader would (CPU, instant)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lab/ is not a package: load the script by path (registered first, as its dataclass needs)
_spec = importlib.util.spec_from_file_location("lab_house", ROOT / "lab" / "house.py")
house = sys.modules.setdefault("lab_house", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(house)

SOURCE = '''
from typing import TYPE_CHECKING
from sfl.kernels import reference
from .config import KernelConfig
if TYPE_CHECKING:
    from sfl.models.modeling_sparse_llama import SparseLlamaMLP


def f():
    import torch
    from sfl.kernels.twell import ops  # a CUDA build: only when called


def g():
    # optional dependency
    import lm_eval
    import numpy

    from sfl.experiments.trainer import provenance
'''
KNOWN = {"kernels", "kernels.reference", "kernels.config", "kernels.twell", "kernels.twell.ops", "models",
         "models.modeling_sparse_llama", "experiments", "experiments.trainer.provenance"}


def test_imports_are_resolved_placed_and_checked_for_a_comment():
    found = {(i.target, i.in_function, i.commented, i.type_only)
             for i in house.imports_of("kernels.ffn", Path("kernels/ffn.py"), SOURCE, KNOWN)}
    assert found == {
        ("typing", False, False, False),
        ("kernels.reference", False, False, False),
        ("kernels.config", False, False, False),  # relative import, resolved against the importing package
        ("models.modeling_sparse_llama", False, False, True),
        ("torch", True, False, False),  # no comment: counted
        ("kernels.twell.ops", True, True, False),
        ("lm_eval", True, True, False),  # the comment above the run of imports covers it...
        ("numpy", True, True, False),
        ("experiments.trainer.provenance", True, False, False),  # ...but not past a blank line
    }


def test_cycles_are_the_strongly_connected_parts():
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")}
    assert house.cycles(edges) == [["a", "b", "c"]]
    assert house.cycles({("a", "b"), ("b", "c")}) == []


def test_rooms_follow_the_kernel_layers_and_the_experiment_folders():
    assert house.room("kernels.reference") == "kernels:reference"
    assert house.room("kernels.twell.ops") == "kernels:op"
    assert house.room("kernels.loader") == "kernels:kernel"
    assert house.room("experiments.speed.bench") == "experiments:speed"
    assert house.room("models.convert") == "models"
    assert house.room("experiments.trainer.train") == "experiments:trainer"


def test_experiments_holds_only_the_trainer_and_experiment_folders():
    """The trainer's modules live in experiments/trainer/; experiments/ itself holds no module but its __init__."""
    assert [p.name for p in (ROOT / "experiments").glob("*.py")] == ["__init__.py"]
    assert (ROOT / "experiments" / "trainer" / "train.py").is_file()
