"""experiments/trainer/paired_eval.py: the paired bootstrap over documents on synthetic per-document scores (known
change, zero-width interval for identical models, pairing, coverage), and the eval.json reading + CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sfl.experiments.trainer.paired_eval import (MEAN, NO_LOG, NOT_PAIRED, NoPerDocLog, NotPaired, change_with_interval, compare,
                                         compare_seeds, main,
                                         paired_bootstrap)


def test_identical_models_give_zero_change_and_zero_width_interval():
    rng = np.random.default_rng(1)
    scores = {"piqa": rng.integers(0, 2, 300), "arc_easy": rng.integers(0, 2, 120)}
    res = paired_bootstrap(scores, {t: v.copy() for t, v in scores.items()}, n_boot=500)
    for t in ("piqa", "arc_easy", MEAN):
        assert (res[t].delta, res[t].lo, res[t].hi) == (0.0, 0.0, 0.0), t


def test_known_change_and_same_indices_for_both_models():
    # other = base with 12 of 1000 wrong answers made right: the change is exactly +1.2 points, and since every
    # document's difference is 0 or +1, a bootstrap that resamples the SAME indices for both models can never go
    # below 0 (an unpaired resampling would, by about +-4 points at p = 0.5)
    rng = np.random.default_rng(2)
    base = rng.integers(0, 2, 1000)
    other = base.copy()
    other[np.flatnonzero(base == 0)[:12]] = 1
    r = paired_bootstrap({"t": base}, {"t": other}, n_boot=2000)["t"]
    assert r.delta == pytest.approx(0.012) and r.other - r.base == pytest.approx(0.012)
    assert 0.0 <= r.lo < 0.012 < r.hi < 0.03
    assert r.n == 1000


def test_task_mean_averages_tasks_and_its_interval_is_narrower():
    rng = np.random.default_rng(3)
    base = {f"t{i}": rng.integers(0, 2, 400) for i in range(4)}
    other = {t: np.where(rng.random(400) < 0.2, 1 - v, v) for t, v in base.items()}  # 20% of answers flipped
    res = paired_bootstrap(base, other, n_boot=3000, seed=7)
    assert res[MEAN].delta == pytest.approx(np.mean([res[t].delta for t in base]))
    assert res[MEAN].base == pytest.approx(np.mean([v.mean() for v in base.values()]))
    assert res[MEAN].lo < res[MEAN].delta < res[MEAN].hi
    width = {t: res[t].hi - res[t].lo for t in res}
    assert width[MEAN] < min(width[t] for t in base)  # 4 independent tasks: about half the width of one
    assert res == paired_bootstrap(base, other, n_boot=3000, seed=7)  # reproducible for a seed


def test_interval_coverage_sanity():
    # 200 synthetic evals of two correlated models with a true change of +5 points: the 95% percentile
    # interval must cover it in roughly 95% of them (binomial sd ~1.5%; percentile intervals run a little low)
    rng = np.random.default_rng(4)
    n, true_delta, covered = 400, 0.05, 0
    for _ in range(200):
        base = (rng.random(n) < 0.5).astype(int)
        u = rng.random(n)
        other = np.where(base == 1, (u >= 0.1).astype(int), (u < 0.2).astype(int))  # E[other - base] = +0.05
        r = paired_bootstrap({"t": base}, {"t": other}, n_boot=1000, seed=int(rng.integers(1 << 30)))["t"]
        covered += r.lo <= true_delta <= r.hi
    assert 0.88 <= covered / 200 <= 0.99, covered


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="same non-empty set of tasks"):
        paired_bootstrap({"a": np.ones(3)}, {"b": np.ones(3)})
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap({"a": np.ones(3)}, {"a": np.ones(4)})


def _eval_json(bits: dict[str, str], sha: str = "s") -> dict:
    return {"tasks": {t: {"acc": b.count("1") / len(b)} for t, b in bits.items()},
            "per_doc": {t: {"acc": b, "acc_norm": None, "docs_sha256": sha + t} for t, b in bits.items()}}


def test_compare_reads_eval_json_and_refuses_what_is_not_paired(tmp_path):
    a = _eval_json({"piqa": "0101010101", "winogrande": "1100"})
    b = _eval_json({"piqa": "1101010111", "winogrande": "1100"})
    res = compare(a, b, metric="acc_norm", n_boot=200)  # no acc_norm -> acc, as the tables' mean
    assert res["piqa"].delta == pytest.approx(0.2) and res["winogrande"].delta == 0.0
    assert res[MEAN].delta == pytest.approx(0.1)
    with pytest.raises(NotPaired, match="different requests"):
        compare(a, _eval_json({"piqa": "0101010101", "winogrande": "1100"}, sha="other"))
    with pytest.raises(NotPaired, match="different tasks"):
        compare(a, _eval_json({"piqa": "0101010101"}))
    old = {"tasks": {"piqa": {"acc": 0.5}}}  # an eval.json from before per-document scores were kept
    with pytest.raises(NoPerDocLog):
        compare(old, b)
    assert change_with_interval(old, b) == NO_LOG and change_with_interval(None, b) == NO_LOG
    assert change_with_interval(a, b, n_boot=200).startswith("+10.00 [")
    assert change_with_interval(a, _eval_json({"piqa": "0101010101", "winogrande": "1100"}, sha="x")) == NOT_PAIRED

    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "eval.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "paired.json"
    assert main([str(tmp_path / "A"), str(tmp_path / "b.json"), "--n-boot", "300", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tasks"]["piqa"]["delta"] == pytest.approx(0.2) and got["tasks"][MEAN]["lo"] <= 0.1
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main([str(tmp_path / "old.json"), str(tmp_path / "b.json")]) == 2


def test_several_seeds_average_each_document_over_its_configuration(tmp_path):
    base = [_eval_json({"piqa": "0000"}), _eval_json({"piqa": "1100"})]  # per-doc means 0.5 0.5 0 0
    other = [_eval_json({"piqa": "1111"}), _eval_json({"piqa": "1110"}), _eval_json({"piqa": "1111"})]
    res = compare_seeds(base, other, n_boot=300)
    assert res["piqa"].base == pytest.approx(0.25) and res["piqa"].other == pytest.approx(11 / 12)
    assert res["piqa"].delta == pytest.approx(11 / 12 - 0.25)
    assert compare_seeds(base[:1], other[:1], n_boot=300) == compare(base[0], other[0], n_boot=300)
    with pytest.raises(NotPaired, match="different requests"):  # a seed that scored other requests is refused
        compare_seeds(base, [*other, _eval_json({"piqa": "1111"}, sha="x")])
    for i, ev in enumerate([*base, *other]):
        (tmp_path / f"e{i}.json").write_text(json.dumps(ev))
    out = tmp_path / "paired.json"
    assert main([f"{tmp_path}/e0.json,{tmp_path}/e1.json", ",".join(f"{tmp_path}/e{i}.json" for i in (2, 3, 4)),
                 "--n-boot", "200", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tasks"]["piqa"]["delta"] == pytest.approx(11 / 12 - 0.25)


def test_a_torn_or_foreign_eval_json_is_named_with_what_to_do(tmp_path, capsys):
    """An eval.json cut short (a writer killed mid-write) or one that is not evaluate.py's: a one-line error naming
    the file and saying to evaluate again, from load_eval and from the CLI (exit 2)."""
    from sfl.experiments.trainer.paired_eval import BadEvalFile, load_eval

    good = tmp_path / "good.json"
    good.write_text(json.dumps(_eval_json({"piqa": "0101"})))
    torn = tmp_path / "torn" / "eval.json"
    torn.parent.mkdir()
    torn.write_text(good.read_text()[:40])
    foreign = tmp_path / "list.json"
    foreign.write_text("[1, 2]")
    for path in (torn, foreign):
        with pytest.raises(BadEvalFile, match="sfl.experiments.trainer.evaluate"):
            load_eval(path)
    capsys.readouterr()
    assert main([str(torn.parent), str(good)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {torn} is not valid JSON") and "evaluate` again" in err and "\n" not in err
