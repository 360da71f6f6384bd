"""The calibrated dispatch on the CPU (kernels/calibrate.py, kernels/tables.py): the cache key, the crossover found
from injected timings, the lookup order (user cache > table of record > built-in), the time budget, and a plan
picking up a cached table on a (faked) Hopper GPU."""
from __future__ import annotations

import json

import pytest

import sfl.kernels.calibrate as cal
import sfl.kernels.tables as tables
from sfl.kernels.config import DEFAULT_CROSSOVER, DEFAULT_CROSSOVER_NONGATED, KernelConfig, crossover_at
from sfl.kernels.provenance import git, measurement_provenance

H200 = tables.GpuIdentity("NVIDIA H200", (9, 0), "570.86.15", "2.9.1+cu128", "12.8")


def test_cache_key_separates_what_a_table_depends_on():
    base = tables.cache_key(H200, "gated", 2048, 5632, "abc123")
    assert base == "nvidia-h200_driver-570.86.15_torch-2.9.1+cu128_kernels-abc123_gated-k2048-n5632".replace("_", "-")
    variants = [tables.cache_key(H200.__class__(**{**H200.__dict__, **change}), "gated", 2048, 5632, "abc123")
                for change in ({"name": "NVIDIA H100 80GB HBM3"}, {"driver": "580.1"}, {"torch": "2.10.0"})]
    variants += [tables.cache_key(H200, "nongated", 2048, 5632, "abc123"), tables.cache_key(H200, "gated", 576, 5632,
                 "abc123"), tables.cache_key(H200, "gated", 2048, 1536, "abc123"),
                 tables.cache_key(H200, "gated", 2048, 5632, "def456")]
    assert len({base, *variants}) == 8
    assert all(c.isalnum() or c in "-.+" for c in base)


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tables.cache_dir() == tmp_path / "sfl" / "dispatch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tables.cache_dir().parts[-3:] == (".cache", "sfl", "dispatch")


def _synthetic(cross_by_m: dict[int, float], calls: list | None = None):
    """Fake timings: dense 1 ms; sparse wins below the activity cross_by_m[M] (speedup 1 + 10 (c - p), >= 0.1)."""
    def measure(kind, K, N, M, a, profile):
        if calls is not None:
            calls.append((M, a, profile))
        p = a * (1.1 if profile == "skewed" else 1.0)
        return cal.Point(M, profile, a, p, 1.0, 1.0 / max(0.1, 1.0 + 10.0 * (cross_by_m[M] - p)))
    return measure


def test_crossover_from_synthetic_timings():
    truth = {1: 0.15, 2: 0.1, 8: 0.05, 64: 0.012, 1024: -0.01, 16384: 0.0081, 65536: 0.0113}
    calls = []
    res = cal.calibrate_shape("gated", 2048, 5632, _synthetic(truth, calls), deadline=float("inf"),
                              fallback=DEFAULT_CROSSOVER, ms=tuple(truth), clock=lambda: 0.0)
    # speedup 0.98 at p = c + 0.002 on both profiles; linear between grid points is exact for this linear model;
    # the table rounds down to 0.0001; M = 1024 never wins
    for M, c in truth.items():
        want = max(0.0, c + 0.002)
        assert want - 1.01e-4 <= res.per_m[M] <= want + 1e-12, M
    assert res.spec.split(",")[:4] == [f"1:{res.per_m[1]:g}", f"2:{res.per_m[2]:g}", f"3:{res.per_m[8]:g}",
                                       f"9:{res.per_m[64]:g}"]
    assert res.spec.split(",")[4:] == [f"{m}:{res.per_m[m]:g}" for m in (1024, 16384, 65536)]
    assert crossover_at(res.spec, 5) == res.per_m[8] and crossover_at(res.spec, 30000) == res.per_m[16384]
    KernelConfig(crossover=res.spec)  # a table the kernels accept
    # each sweep stops after its second loss: at M = 1024 both profiles lose from the first activity
    assert sum(1 for M, _, _ in calls if M == 1024) == 4


def test_no_win_below_the_limit_gives_zero():
    lose_low = [cal.Point(4096, "uniform", a, a, 1.0, 2.0) for a in (0.001, 0.0025)]
    assert cal.crossover({"uniform": lose_low}) == 0.0
    win = [cal.Point(4096, "uniform", 0.001, 0.001, 1.0, 0.5), cal.Point(4096, "uniform", 0.0025, 0.0025, 1.0, 2.0)]
    assert cal.crossover({"uniform": win}) == 0.002  # speedup 2 -> 0.5 crosses 0.98 at 0.00202
    # the other profile loses from its lowest activity, 0.0015: the table stops just below it (a win at 0.001)
    late = [cal.Point(4096, "skewed", 0.0015, 0.0015, 1.0, 2.0)]
    assert cal.crossover({"uniform": win, "skewed": late}) == 0.0014
    assert cal.crossover({"uniform": win[1:], "skewed": late}) == 0.0  # and no win below that: never sparse


def test_budget_is_honoured_and_unreached_m_keep_the_fallback():
    now = [0.0]

    def clock():
        return now[0]

    truth = {m: 0.01 for m in cal.MS}
    inner = _synthetic(truth)

    def slow(*a):  # every point costs 1 s of the fake clock
        now[0] += 1.0
        return inner(*a)

    shapes = [("gated", 2048, 5632), ("nongated", 2048, 8192)]
    res = cal.calibrate(shapes, slow, budget_s=40.0, fallback=lambda k, K, N: tables.KINDS[k][1], clock=clock,
                        show_progress=False)
    assert now[0] <= 40.0 + 1.0  # at most the point in flight at the deadline
    for r, builtin in zip(res, (DEFAULT_CROSSOVER, DEFAULT_CROSSOVER_NONGATED)):
        assert r.unmeasured and r.unmeasured[-1] == cal.MS[-1]
        for M in r.unmeasured:
            assert r.per_m[M] == crossover_at(builtin, M)
        assert len(r.points) >= 10  # each shape had its share: the first could not starve the second
        KernelConfig(crossover=r.spec)


def _write_record(tmp_path, gpu, entries):
    return tables.write_record([tables.entry(gpu, k, K, N, spec) for k, K, N, spec in entries], gpu, tmp_path)


def test_lookup_order_cache_then_record_then_builtin(tmp_path):
    cache, record = tmp_path / "cache", tmp_path / "record"
    kw = dict(kernels="abc123", cache=cache, record_dir=record)
    assert tables.lookup(H200, "gated", 2048, 5632, **kw) is None
    assert tables.resolve(KernelConfig(), 2048, 5632, H200, **kw) == KernelConfig()
    path = _write_record(record, H200, [("gated", 2048, 5632, "1:0.2,256:0.005"), ("gated", 576, 1536, "1:0.1")])
    assert path == record / "nvidia-h200.json"
    assert tables.lookup(H200, "gated", 2048, 5632, **kw).crossover == "1:0.2,256:0.005"
    assert tables.lookup(H200, "gated", 512, 1280, **kw).crossover == "1:0.1"  # nearest K * N of that kind
    assert tables.lookup(H200, "nongated", 2048, 8192, **kw) is None
    tables.write_cache(tables.entry(H200, "gated", 2048, 5632, "1:0.3,4096:0.009"), H200, "abc123", cache)
    assert tables.lookup(H200, "gated", 2048, 5632, **kw).crossover == "1:0.3,4096:0.009"
    assert tables.lookup(H200, "gated", 2048, 5632, **{**kw, "kernels": "other"}).crossover == "1:0.2,256:0.005"
    h100 = tables.GpuIdentity("NVIDIA H100 80GB HBM3", (9, 0), "570.86.15", "2.9.1+cu128", "12.8")
    assert tables.lookup(h100, "gated", 2048, 5632, **kw) is None
    cfg = tables.resolve(KernelConfig(), 2048, 5632, H200, **kw)
    assert cfg.crossover == "1:0.3,4096:0.009" and cfg.crossover_nongated == DEFAULT_CROSSOVER_NONGATED
    mine = KernelConfig(crossover="1:0.05")
    assert tables.resolve(mine, 2048, 5632, H200, **kw) == mine  # a table set by hand is kept


def test_a_broken_table_is_skipped_with_a_warning(tmp_path):
    (tmp_path / "nvidia-h200.json").write_text(json.dumps({"tables": [{"kind": "gated", "K": 1, "N": 2,
                                                                       "crossover": "x"}]}))
    with pytest.warns(RuntimeWarning, match="ignoring the dispatch table"):
        assert tables.lookup(H200, "gated", 1, 2, kernels="k", cache=None, record_dir=tmp_path) is None


def test_a_plan_picks_up_the_cached_table_on_this_gpu(monkeypatch, tmp_path, capsys):
    from sfl.kernels.twell import ops

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tables, "RECORD_DIR", tmp_path / "no_records")  # the cache alone, not the repository's tables
    monkeypatch.setattr(tables, "kernels_supported", lambda *a: (True, ""))
    monkeypatch.setattr(tables, "current_gpu", lambda *a: H200)
    monkeypatch.setattr(tables, "_NOTICED", set())
    tables.write_cache(tables.entry(H200, "gated", 64, 512, "1:0.3,4096:0.009"), H200, tables.kernels_source(),
                       tables.cache_dir())
    assert ops.Plan(KernelConfig(), shape=(64, 512)).config.crossover == "1:0.3,4096:0.009"
    assert ops.Plan(KernelConfig(), shape=(64, 512)).config.crossover == "1:0.3,4096:0.009"
    assert capsys.readouterr().err.count("sfl: dispatch tables for NVIDIA H200") == 1  # one notice
    assert ops.Plan(KernelConfig(), shape=(64, 768)).config == KernelConfig()  # no table for this shape
    assert ops.Plan(KernelConfig()).config == KernelConfig()  # no shape: the config as given
    monkeypatch.setattr(tables, "kernels_supported", lambda *a: (False, "sm_80"))
    assert ops.Plan(KernelConfig(), shape=(64, 512)).config == KernelConfig()


def test_command_without_hopper_says_why(capsys, monkeypatch):
    monkeypatch.setattr(cal, "kernels_supported", lambda *a: (False, "the TwELL kernels need an sm_90 GPU; X is sm_80"))
    assert cal.main([]) == 2
    assert "X is sm_80: nothing to calibrate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cal.main(["--shape", "2048"])


def test_command_writes_cache_record_and_log(monkeypatch, tmp_path, capsys):
    """The command end to end with injected timings: a cache entry per shape, the table of record, a JSONL log whose
    rows carry the GPU and the timings."""
    from sfl.kernels.twell import ops

    monkeypatch.setattr(cal, "kernels_supported", lambda *a: (True, ""))
    monkeypatch.setattr(ops, "load", lambda: None)
    monkeypatch.setattr(tables, "current_gpu", lambda *a: H200)
    monkeypatch.setattr(cal, "CudaMeasure", lambda: _synthetic({m: 0.01 for m in cal.MS}))
    log = tmp_path / "calib.jsonl"
    assert cal.main(["--shape", "576,1536", "--shape", "2048,5632", "--profiles", "uniform", "--budget-s", "30",
                     "--cache-dir", str(tmp_path / "cache"), "--record-dir", str(tmp_path / "rec"),
                     "--log", str(log)]) == 0
    record = json.loads((tmp_path / "rec" / "nvidia-h200.json").read_text())
    assert [(t["kind"], t["K"], t["N"]) for t in record["tables"]] == [("gated", 576, 1536), ("gated", 2048, 5632)]
    spec = record["tables"][0]["crossover"]
    assert crossover_at(spec, 4096) == pytest.approx(0.0119, abs=1e-4) and record["tables"][0]["unmeasured_m"] == []
    kw = dict(kernels=tables.kernels_source(), cache=tmp_path / "cache", record_dir=tmp_path / "none")
    assert tables.lookup(H200, "gated", 576, 1536, **kw).crossover == spec
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    points = [r for r in rows if r["event"] == "point"]
    assert points and all(r["provenance"]["gpu_identity"]["name"] == "NVIDIA H200" and r["dense_ms"] > 0
                          and r["sparse_ms"] > 0 for r in points)
    assert list(points[0]) == ["event", "kind", "K", "N", "M", "profile", "activity", "p", "dense_ms", "sparse_ms",
                               "rel_err", "speedup", "timing", "provenance"]
    prov = points[0]["provenance"]
    assert {"git_commit", "git_dirty", "source_tree_hash", "time_utc", "gpu_identity", "kernels_source", "shapes",
            "threshold"} <= set(prov)
    assert [r["K"] for r in rows if r["event"] == "table"] == [576, 2048]
    assert "table of record:" in capsys.readouterr().out


def test_measurement_provenance_names_the_exported_commit(monkeypatch):
    """A machine given a copy of the tree names its commit through $SFL_GIT_COMMIT (its .git may be stale); without
    it, git's HEAD of this checkout (or None outside one)."""
    monkeypatch.setenv("SFL_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("SFL_GIT_DIRTY", "0")
    prov = measurement_provenance()
    assert (prov["git_commit"], prov["git_dirty"]) == ("0123abc", "0")
    assert prov["time_utc"].endswith("+00:00") and prov["host"]
    monkeypatch.delenv("SFL_GIT_COMMIT")
    head = git("rev-parse", "HEAD")
    prov = measurement_provenance()
    assert prov["git_commit"] == head and "git_head_local" not in prov
    assert prov["git_dirty"] in ((None,) if head is None else (True, False))
