"""experiments/paper_scale's throughput rows, read from a real (tiny, CPU) training log: the median tokens/s of the
steps after the warm-up, per process, the activity of every step, the config and provenance; a run that did not
finish gives a row that says so."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_run_safety import cfg_for, data_dir, read_log  # noqa: E402,F401

from sfl.experiments.trainer import train as train_mod  # noqa: E402
from sfl.experiments.paper_scale.throughput_rows import init_activity, row  # noqa: E402


def test_throughput_row_from_a_training_log(data_dir, tmp_path) -> None:
    out = tmp_path / "0p5b_sparse_actrue_mpfalse_n1"
    train_mod.train(cfg_for(data_dir, out, eval_every=0, l1_coeff=2e-5))
    steps = [x for x in read_log(out) if x["type"] == "step"]
    r = row(out, warm=2)
    assert r["run"] == out.name and r["world_size"] == 1 and r["steps_timed"] == len(steps) - 2 == 4
    assert r["tokens_per_s_per_gpu"] == statistics.median(x["tokens_per_s"] for x in steps[2:])
    assert r["nnz_mean_steps"] == [x["nnz_mean"] for x in steps] and r["l1_coeff"] == 2e-5
    assert r["num_hidden_layers"] == 2 and r["provenance"] and r["kernel_config"]
    assert "did not finish" in row(tmp_path / "missing", warm=2)["error"]
    assert "init_target_nnz_mean" not in r  # a scratch init: no paper_init.json


def test_throughput_row_carries_the_init_activity(tmp_path) -> None:
    init = tmp_path / "init"
    init.mkdir()
    (init / "paper_init.json").write_text(json.dumps({"target_nnz_mean": 29.0, "achieved_nnz_mean": 29.0,
                                                      "held_out_nnz_mean": 30.1, "calibration_seqs": 64}))
    assert init_activity(str(init)) == {"init_target_nnz_mean": 29.0, "init_calibration_nnz_mean": 29.0,
                                        "init_held_out_nnz_mean": 30.1, "init_calibration_seqs": 64}
    assert init_activity(None) == {} and init_activity(str(tmp_path)) == {}
