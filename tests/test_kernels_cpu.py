"""CPU tests of the Python side of the TwELL kernels: input validation, error messages, fake impls."""
from __future__ import annotations

import os

import pytest
import torch

import sfl.kernels.ffn as ffn
from sfl.kernels import tables
from sfl.kernels.loader import EXTENSIONS, KernelUnavailableError, load_train, load_twell, prebuilt_for, source_hash


def _w(K=576, N=1536, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(8, K, dtype=dtype, device=device), torch.randn(N, K, dtype=dtype, device=device),
            torch.randn(N, K, dtype=dtype, device=device), torch.randn(K, N, dtype=dtype, device=device))


def test_cpu_tensors_name_the_reference_path():
    x, wg, wu, wd = _w()
    with pytest.raises(KernelUnavailableError, match="sfl.kernels.reference"):
        ffn.sparse_gated_ffn(x, wg, wu, wd)
    with pytest.raises(KernelUnavailableError, match="sfl.kernels.reference"):
        ffn.sparse_nongated_ffn(x, wu, wd)


def test_explicit_dense_is_three_linears_and_no_op(monkeypatch):
    """mode='dense' (or a dense config) without a plan or stats runs plain torch ops: no plan is made and the op is
    not called, on any device; the result is HF's dense math bit for bit (what the op's dense path computes)."""
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.twell import ops

    def refuse(*a, **kw):
        raise AssertionError("an explicit dense call reached the plan or the op")

    monkeypatch.setattr(ffn, "plan_for", refuse)
    monkeypatch.setattr(ops, "ffn", refuse)
    x, wg, wu, wd = _w(K=64, N=256)
    x = x.reshape(2, 4, 64)
    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(1) or real_linear(*a))
    y = ffn.sparse_gated_ffn(x, wg, wu, wd, mode="dense")
    assert len(calls) == 3
    want = real_linear(torch.relu(real_linear(x, wg)) * real_linear(x, wu), wd)
    assert y.shape == (2, 4, 64) and torch.equal(y, want)
    y = ffn.sparse_nongated_ffn(x, wu, wd, config=KernelConfig(mode="dense"))
    assert torch.equal(y, real_linear(torch.relu(real_linear(x, wu)), wd))
    with pytest.raises(KernelUnavailableError, match="sfl.kernels.reference"):   # stats are the op's: CUDA only
        ffn.sparse_gated_ffn(x, wg, wu, wd, mode="dense", stats=torch.zeros(3, dtype=torch.int64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_loader_without_gpu_says_what_to_do():
    with pytest.raises(KernelUnavailableError, match="CUDA GPU.*sfl.kernels.reference"):
        load_twell()
    with pytest.raises(KernelUnavailableError, match="CUDA GPU.*backend='torch' or mode='dense'"):
        load_train()


def test_one_loader_picks_each_extensions_prebuilt_library():
    listed = os.pathsep.join(["/a/sfl_train_1f.so", "/b/sfl_twell_9c.cpython-312.so", "/c/other.so"])
    assert prebuilt_for("twell", listed) == "/b/sfl_twell_9c.cpython-312.so"
    assert prebuilt_for("train", listed) == "/a/sfl_train_1f.so"
    assert prebuilt_for("twell", "/c/other.so") is None and prebuilt_for("train", None) is None
    # both extensions build from their own sources plus the shared ones, hashed apart
    twell, train = (EXTENSIONS[n].sources for n in ("twell", "train"))
    assert twell[0].parent.name == "twell" and train[0].parent.name == "train" and set(twell) & set(train)
    assert source_hash(list(twell)) != source_hash(list(train))


def test_source_hash_is_stable_and_covers_sources(tmp_path):
    """The hash is a function of the sources' names and bytes: equal for identical copies, different after an
    edit of any source or an added one (else a stale build of edited kernels would load). Temp copies only."""
    import shutil

    from sfl.kernels.loader import TWELL_SOURCES

    h = source_hash()
    assert len(h) == 12 and all(c in "0123456789abcdef" for c in h)
    copies = []
    for src in TWELL_SOURCES:
        copies.append(tmp_path / src.name)
        shutil.copy(src, copies[-1])
    assert source_hash(copies) == h  # same names and bytes, another place: same hash
    for i, c in enumerate(copies):
        text = c.read_bytes()
        c.write_bytes(text + b"\n// edited\n")
        assert source_hash(copies) != h, f"an edit of {c.name} does not change the hash"
        c.write_bytes(text)
    assert source_hash(copies) == h
    extra = tmp_path / "extra.cu"
    extra.write_text("// a new source\n")
    assert source_hash(copies + [extra]) != h


def test_down_layout_helpers():
    """set_down_layout_ re-lays out a Linear's weight in place (the same Parameter, the same values, strides
    (1, K) or row-major); keep_down_layout leaves a neuron-major W_d as it is and makes any other contiguous; the
    TwELL modules store W_d neuron-major, and loading an nn.Linear's row-major weights keeps that."""
    from sfl.kernels.layout import is_neuron_major, keep_down_layout, set_down_layout_

    lin = torch.nn.Linear(256, 64, bias=False)
    w, v = lin.weight, lin.weight.detach().clone()
    set_down_layout_(lin)
    assert lin.weight is w and is_neuron_major(w) and w.stride() == (1, 64) and torch.equal(w, v)
    assert keep_down_layout(w) is w
    set_down_layout_(lin, neuron_major=False)
    assert lin.weight is w and w.is_contiguous() and not is_neuron_major(w) and torch.equal(w, v)
    strided = torch.randn(64, 512)[:, ::2]
    assert keep_down_layout(strided).is_contiguous() and torch.equal(keep_down_layout(strided), strided)
    down = torch.nn.Linear(256, 64, bias=False)
    m = ffn.TwELLMLP.from_linears(torch.nn.Linear(64, 256, bias=False), down)
    assert is_neuron_major(m.down_proj.weight) and torch.equal(m.down_proj.weight, down.weight)
    m.load_state_dict({k: t.contiguous() for k, t in m.state_dict().items()})
    assert is_neuron_major(m.down_proj.weight)



    lin = torch.nn.Linear(64, 256, bias=True)
    with pytest.raises(ValueError, match="bias"):
        ffn.TwELLMLP.from_linears(lin, torch.nn.Linear(256, 64, bias=False))


def test_inference_entry_refuses_autograd_inputs() -> None:
    """No backward in the inference kernels: grad-requiring inputs get a clear error (before any device check),
    and the same call under no_grad goes on to the usual checks."""
    from sfl.kernels import ffn

    K, N = 64, 256
    x = torch.randn(4, K, dtype=torch.bfloat16)
    w = [torch.randn(N, K, dtype=torch.bfloat16, requires_grad=True), torch.randn(N, K, dtype=torch.bfloat16),
         torch.randn(K, N, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="no_grad.*train_ffn"):
        ffn.sparse_gated_ffn(x, *w)
    with pytest.raises(ValueError, match="inference-only"):
        ffn.sparse_nongated_ffn(x.requires_grad_(), w[1], w[2])
    with torch.no_grad(), pytest.raises(Exception) as e:
        ffn.sparse_gated_ffn(x, *w)
    assert "inference-only" not in str(e.value)
    # an explicit dense request is plain torch: differentiable, on any device
    ffn.sparse_gated_ffn(x, *w, mode="dense").float().sum().backward()
    assert w[0].grad is not None and w[0].grad.shape == (N, K)



def test_crossover_spec_from_calibration_rows():
    """The calibration -> table rule: interpolated 0.98 crossing, min over profiles, a profile that loses at its
    lowest activity limits the table just below it, no measured win -> 0."""
    pytest.importorskip("sfl.experiments.kernel_bench.bench_inference")
    from sfl.experiments.kernel_bench.bench_inference import crossover_spec

    def rows(M, pattern, pts):
        return [{"M": M, "pattern": pattern, "p_measured": p, "speedup": s} for p, s in pts]

    data = (rows(4, "u", [(0.001, 1.5), (0.005, 1.18), (0.01, 0.78)])      # crosses 0.98 at 0.0075
            + rows(4, "p", [(0.003, 1.2), (0.02, 1.1)])                    # never loses: 0.02
            + rows(64, "u", [(0.001, 1.3), (0.005, 0.9)])                   # crosses at 0.0042
            + rows(64, "p", [(0.0027, 0.9), (0.005, 0.8)])                  # loses at its lowest: limit 0.0026
            + rows(256, "u", [(0.001, 0.5)]) + rows(256, "p", [(0.002, 0.4)]))   # never wins: 0
    spec = dict(kv.split(":") for kv in crossover_spec(data).split(","))
    assert spec == {"4": "0.0075", "64": "0.0026", "256": "0"}


def test_source_hash_covers_the_shared_header(tmp_path, monkeypatch):
    """Editing kernels/common/*.cuh must change every extension's hash (else a stale build would load)."""
    from sfl.kernels import loader

    hdr = tmp_path / "x.cuh"
    hdr.write_text("// a")
    monkeypatch.setattr(loader, "COMMON_HEADERS", [hdr])
    before = loader.source_hash()
    hdr.write_text("// b")
    assert loader.source_hash() != before


# ----------------------------------------------------------------------------------------------- KernelConfig
@pytest.mark.parametrize("kw, field", [
    (dict(mode="fast"), "mode"), (dict(d2t="triton"), "d2t"), (dict(slots=0), "slots"), (dict(slots=512), "slots"),
    (dict(slots=True), "slots"), (dict(decode_tiles_per_warp=0), "decode_tiles_per_warp"), (dict(d2t_max_ctas=-1), "d2t_max_ctas"),
    (dict(flagged_dense_above=1.5), "flagged_dense_above"), (dict(activity_hint=-0.1), "activity_hint"),
    (dict(self_timing=1), "self_timing"), (dict(train_width=0), "train_width"),
    (dict(train_sparse_min_m=-1), "train_sparse_min_m"), (dict(crossover="garbage"), "crossover"),
    (dict(crossover_nongated="1:2.0"), "crossover_nongated"),
    (dict(fused_decode_max_m=9), "fused_decode_max_m"), (dict(rows_decode_max_m=-1), "rows_decode_max_m"),
    (dict(decode_rows_slices=9), "decode_rows_slices"),
    (dict(backup_rows=-2), "backup_rows"), (dict(hot_neurons=100), "hot_neurons"), (dict(hot_neurons=-256), "hot_neurons"),
])
def test_kernel_config_validation_names_the_field(kw, field):
    from sfl.kernels.config import KernelConfig

    with pytest.raises(ValueError, match=rf"KernelConfig\.{field}="):
        KernelConfig(**kw)


def test_kernel_config_is_frozen_and_hashable():
    """Frozen (the functional API keys plans by it): equal configs hash alike, replace() makes a new one."""
    import dataclasses

    from sfl.kernels.config import KernelConfig

    a, b = KernelConfig(), KernelConfig()
    assert a == b and hash(a) == hash(b)
    c = a.replace(slots=16)
    assert c.slots == 16 and a.slots == 32 and c != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.slots = 8


def test_kernel_config_from_env_reads_sfl_kernel_vars_once(monkeypatch):
    from sfl.kernels.config import KernelConfig

    env = {"SFL_KERNEL_SLOTS": "16", "SFL_KERNEL_SELF_TIMING": "0", "SFL_KERNEL_FLAGGED_DENSE_ABOVE": "0.25",
           "SFL_KERNEL_CROSSOVER": "1:0.5", "SFL_KERNEL_MODE": "sparse", "TWELL_SLOTS": "8"}
    cfg = KernelConfig.from_env(environ=env)
    assert (cfg.slots, cfg.self_timing, cfg.flagged_dense_above, cfg.crossover, cfg.mode) == \
        (16, False, 0.25, "1:0.5", "sparse")
    assert cfg.crossover_table(True) == ((1,), (0.5,))
    # a base is kept where no variable overrides it
    base = KernelConfig(decode_tiles_per_warp=2, slots=64)
    assert KernelConfig.from_env(base, environ={"SFL_KERNEL_SLOTS": "8"}) == base.replace(slots=8)
    assert KernelConfig.from_env(base, environ={}) is base
    # os.environ by default; read at the call, never later (the config is plain data afterwards)
    monkeypatch.setenv("SFL_KERNEL_DECODE_TILES_PER_WARP", "8")
    cfg = KernelConfig.from_env()
    monkeypatch.setenv("SFL_KERNEL_DECODE_TILES_PER_WARP", "1")
    assert cfg.decode_tiles_per_warp == 8
    # bad values name the variable and the field
    with pytest.raises(ValueError, match="SFL_KERNEL_SLOTS.*KernelConfig.slots"):
        KernelConfig.from_env(environ={"SFL_KERNEL_SLOTS": "many"})
    with pytest.raises(ValueError, match="SFL_KERNEL_TRAIN_SHRINK"):
        KernelConfig.from_env(environ={"SFL_KERNEL_TRAIN_SHRINK": "maybe"})
    with pytest.raises(ValueError, match=r"KernelConfig\.decode_tiles_per_warp"):
        KernelConfig.from_env(environ={"SFL_KERNEL_DECODE_TILES_PER_WARP": "0"})


def test_kernel_config_dict_round_trip():
    import json

    from sfl.kernels.config import KernelConfig

    cfg = KernelConfig(mode="dense", slots=64, crossover="1:0.01,64:0", self_timing=False, activity_hint=0.02,
                       train_width=96)
    d = cfg.to_dict()
    assert "_parsed" not in d and d["slots"] == 64 and d["self_timing"] is False
    assert KernelConfig.from_dict(json.loads(json.dumps(d))) == cfg   # survives a JSON log
    assert KernelConfig.from_dict(None) == KernelConfig() == KernelConfig.from_dict({})
    with pytest.raises(ValueError, match="unknown KernelConfig field.*compact"):
        KernelConfig.from_dict({**d, "compact": 1})
    # a retired field of an older config.json (down_nb: the split up/down path's setting) is dropped, not refused
    assert KernelConfig.from_dict({**d, "down_nb": 4}) == cfg


def test_parse_crossover_and_crossover_at():
    from sfl.kernels.config import DEFAULT_CROSSOVER, KernelConfig, crossover_at, parse_crossover

    spec = "17:0,1:0.012,8192:0.003"   # order does not matter
    assert parse_crossover(spec) == ((1, 17, 8192), (0.012, 0.0, 0.003))
    assert crossover_at(spec, 1) == 0.012 and crossover_at(spec, 16) == 0.012
    assert crossover_at(spec, 17) == 0.0 and crossover_at(spec, 8191) == 0.0
    assert crossover_at(spec, 8192) == 0.003 and crossover_at(spec, 10 ** 6) == 0.003
    assert parse_crossover("64:0.01") == ((1, 64), (0.0, 0.01))   # bucket 1 added: dense below the first bucket
    assert crossover_at("64:0.01", 5) == 0.0
    with pytest.raises(ValueError, match="KernelConfig.crossover_nongated="):
        parse_crossover("garbage", "crossover_nongated")
    with pytest.raises(ValueError, match=">= 1"):
        parse_crossover("0:0.1")
    cfg = KernelConfig()
    assert cfg.crossover_table(True) == parse_crossover(DEFAULT_CROSSOVER)
    assert cfg.crossover_table(False) != cfg.crossover_table(True)   # the non-gated table is its own


def test_plan_spec_has_every_field_the_op_reads():
    """plan_spec names exactly the fields runtime.cpp's parse_config reads (taken from its source), each once, with
    values that read back exactly; a field added on one side only fails here."""
    import re
    from pathlib import Path

    from sfl.kernels.config import KernelConfig
    from sfl.kernels.twell import ops

    src = (Path(ops.__file__).parent / "runtime.cpp").read_text()
    body = src[src.index("Config parse_config("):]
    body = body[: body.index("\n}\n")]
    read = re.findall(r'f\.(?:text|integer|number|flag|table)\("(\w+)"', body)
    assert len(read) == len(set(read)) and set(read) == set(ops.OP_FIELDS)
    assert set(ops.OP_FIELDS) == {f for f in KernelConfig().to_dict()
                                  if not f.startswith("train_") or f in ops.TRAIN_PLAN_FIELDS}
    cfg = KernelConfig(mode="sparse", slots=16, self_timing=False, d2t="cublas", flagged_dense_above=0.1,
                       activity_hint=1 / 3, crossover="64:0.002,1:0.01", crossover_nongated="8:0.2")
    fields = dict(item.split("=", 1) for item in ops.plan_spec(cfg).split(";"))
    assert list(fields) == list(ops.OP_FIELDS)
    assert (fields["mode"], fields["slots"], fields["self_timing"], fields["d2t"]) == ("sparse", "16", "0", "cublas")
    assert float(fields["activity_hint"]) == 1 / 3 and fields["tile_n"] == "256"
    assert fields["crossover"] == "1:0.01,64:0.002" and fields["crossover_nongated"] == "1:0.0,8:0.2"
    plan = ops.Plan(cfg)
    assert plan.spec == ops.plan_spec(cfg) and plan.config is cfg
    assert ops.Plan(cfg).id != plan.id


def test_plan_freed_while_capturing_waits(monkeypatch):
    """A plan whose handle dies while the current stream captures a CUDA graph is released only at the next free
    outside a capture (destroying it frees pinned memory, which would invalidate the capture); then every waiting
    plan goes."""
    from sfl.kernels.twell import ops

    freed: list[int] = []

    class Ext:
        def plan_free(self, plan_id: int) -> None:
            freed.append(plan_id)

    capturing = [True]
    ext = Ext()
    monkeypatch.setattr(ops, "loaded", lambda name: ext)
    monkeypatch.setattr(ops, "_RETIRED", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    ops._free(7)
    ops._free(8)
    assert freed == []
    capturing[0] = False
    ops._free(9)
    assert sorted(freed) == [7, 8, 9] and ops._RETIRED == []


def test_plan_for_is_per_storage_and_config():
    """Views of one weight share the functional API's plan (its dispatch history); another weight, another config
    or the other block kind get their own."""
    from sfl.kernels.config import KernelConfig

    w = torch.randn(256, 64)
    cfg = KernelConfig()
    p = ffn.plan_for(w, cfg, True)
    assert p is ffn.plan_for(w.detach(), KernelConfig(), True) is ffn.plan_for(w.view(256, 64), cfg, True)
    assert ffn.plan_for(torch.randn(256, 64), cfg, True) is not p
    assert ffn.plan_for(w, cfg.replace(slots=16), True) is not p
    assert ffn.plan_for(w, cfg, False) is not p
    # a forced mode is a key of its own, its config built once
    forced = ffn.plan_for(w, cfg, True, "sparse")
    assert forced is ffn.plan_for(w, cfg, True, "sparse") and forced is not p and forced.config.mode == "sparse"
    # the config as given, with its crossover table resolved for this GPU and shape (unchanged without the kernels)
    assert p.config == tables.for_current_gpu(cfg, 64, 256)


def test_fake_impls_shapes():
    """The ops' fake implementations (what torch.compile traces): ffn returns x's shape and dtype for gated and
    non-gated blocks and any leading dims; d2t returns [M, N/256, slots], [M, N/256], [M] int32."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sfl.kernels.config import KernelConfig
    from sfl.kernels.twell import ops

    spec = ops.plan_spec(KernelConfig())
    with FakeTensorMode():
        x = torch.empty(3, 37, 576, dtype=torch.bfloat16)
        wg = torch.empty(1536, 576, dtype=torch.bfloat16)
        wd = torch.empty(576, 1536, dtype=torch.bfloat16)
        stats = torch.zeros(3, dtype=torch.int64)
        y = torch.ops.sfl_twell.ffn(x, wg, wg, wd, stats, 1, spec)
        assert y.shape == (3, 37, 576) and y.dtype == torch.bfloat16
        y = torch.ops.sfl_twell.ffn(x[0], None, wg, wd, None, 2, spec)
        assert y.shape == (37, 576) and y.dtype == torch.bfloat16
        p, c, f = torch.ops.sfl_twell.d2t(x, wg, 32, spec)
        assert p.shape == (111, 6, 32) and c.shape == (111, 6) and f.shape == (111,)
        assert p.dtype == c.dtype == f.dtype == torch.int32
        p, c, f = torch.ops.sfl_twell.d2t(x[0], wg, 8, spec)
        assert p.shape == (37, 6, 8) and c.shape == (37, 6) and f.shape == (37,)


def test_default_crossover_is_derived_from_the_calibration_logs():
    """DEFAULT_CROSSOVER is what experiments/kernel_bench/decode_crossover.py derives from the committed calibration
    logs (r18 from M = 256 up, r21 measuring the decode buckets to 25% activity): a hand-edited table fails."""
    from pathlib import Path

    from sfl.experiments.kernel_bench.decode_crossover import BASE, decode_table
    from sfl.kernels.config import DEFAULT_CROSSOVER

    root = Path(__file__).resolve().parents[1]
    new = [str(root / f"results/kernel_bench/calibration/calib_decode_h100_r21{r}.jsonl") for r in "ab"]
    base = [str(root / BASE.format(r)) for r in "ab"]
    assert decode_table(new, base) == DEFAULT_CROSSOVER


def test_nongated_crossover_is_its_calibration():
    """DEFAULT_CROSSOVER_NONGATED is decode_crossover.py --kind nongated of the committed logs (r22's two non-gated
    runs from M = 256 up, r17 measuring the decode buckets to 25% activity): a hand-edited table fails here."""
    from pathlib import Path

    from sfl.experiments.kernel_bench.decode_crossover import BASE_NONGATED, decode_table
    from sfl.kernels.config import DEFAULT_CROSSOVER_NONGATED

    root = Path(__file__).resolve().parents[1]
    new = [str(root / f"results/kernel_bench/calibration/calib_decode_nongated_h100_r17{r}.jsonl") for r in "ab"]
    base = [str(root / BASE_NONGATED.format(r)) for r in "ab"]
    assert decode_table(new, base, kind="nongated") == DEFAULT_CROSSOVER_NONGATED


def test_bench_inference_runs_the_mode_its_flag_names(monkeypatch):
    """bench_inference's command line: each mode flag reaches its function with its arguments, none runs the
    benchmark, two at once or --calib's settings without --calib are refused."""
    bi = pytest.importorskip("sfl.experiments.kernel_bench.bench_inference")
    from sfl.kernels.config import KernelConfig

    calls = []
    for name in ("bench", "calibrate", "overhead", "explore", "d2t_compare", "overlap_probe"):
        monkeypatch.setattr(bi, name, lambda *a, name=name: calls.append(
            (name, tuple(v for v in a if not isinstance(v, KernelConfig)))) or 0)
    runs = {(): ("bench", ("x.jsonl", False)), ("--quick",): ("bench", ("x.jsonl", True)),
            ("--calib",): ("calibrate", ("x.jsonl", "gated", None, None)),
            ("--calib", "--kind", "nongated", "--calib-ms", "1", "64", "--calib-acts", "0.01"):
                ("calibrate", ("x.jsonl", "nongated", [1, 64], [0.01])),
            ("--overhead",): ("overhead", ()), ("--explore",): ("explore", ()),
            ("--d2t",): ("d2t_compare", ("x.jsonl",)), ("--overlap-probe",): ("overlap_probe", ("x.jsonl",))}
    for flags, want in runs.items():
        calls.clear()
        assert bi.main(["--out", "x.jsonl", *flags]) == 0
        assert calls == [want], flags
    assert set(bi.MODES) == {"bench", "calib", "overhead", "explore", "d2t", "overlap_probe"}
    for bad in (["--calib", "--d2t"], ["--calib-ms", "1"], ["--kind", "nongated"], ["--quick", "--explore"]):
        with pytest.raises(SystemExit):
            bi.parse_args(bad)


def test_bench_inference_cases_and_progress_line():
    """The benchmark's configurations (full and --quick) and its progress line on a decode (graph) row and a prefill
    (eager) row."""
    bi = pytest.importorskip("sfl.experiments.kernel_bench.bench_inference")
    full, quick = bi.bench_cases(False), bi.bench_cases(True)
    assert (len(full), len(quick)) == (55, 17) and len(set(full)) == len(full)
    assert [c for c in full if c[0] == "nongated"] == [("nongated", M, 10, "uniform", p, 0.0)
                                                       for M in (65536, 16384) for p in (0.005, 0.01, 0.02)]
    row = {"kind": "gated", "M": 16, "pattern": "paper", "activity": 0.005, "heavy_frac": 0.0, "nnz_mean": 28.25,
           "nnz_max": 40, "path": "decode", "overflow_rows": 0, "dense_ms": 0.05, "ours_ms": 0.025, "speedup": 2.0,
           "rel_err_vs_dense_bf16": 1e-3, "ours_sparse_forced_ms": 0.03, "p_est": 0.005}
    assert bi.case_line(2, 55, 12.3, row) == ("[3/55 12s] gated M=16 paper p=0.005 heavy=0.0 nnz=28.2/40 path=decode "
                                              "ovf=0 dense=0.050 ours=0.025 x2.00 err=1.00e-03 sparse_forced=0.030 "
                                              "p_est=0.005")
    eager = {**row, "M": 65536, "speedup_steady": 1.5, "dense_vs_dense_ratio": 1.0, "phase_ms": {"d2t": 1.0},
             "gate_gemm_ms": 1.0, "d2t_ms": 1.1, "d2t_cublas_ms": 1.2, "ours_sparse_forced_cublas_d2t_ms": 2.0,
             "ours_sparse_forced_cublas_d2t_chunk4096_ms": 2.1, "ours_sparse_forced_cublas_d2t_chunk16384_ms": 2.2}
    line = bi.case_line(0, 1, 0.0, eager)
    assert " steady x1.50 err=" in line and " AA=1.000 d2t=1.000 gate=1.000" in line
    assert line.endswith("chunk16384=2.200")


@pytest.mark.parametrize("pattern,p", [("uniform", 0.005), ("paper", 0.005), ("paper", 0.01), ("paper", 0.02)])
def test_benchmark_cases_measure_their_label(monkeypatch, pattern, p):
    """bench_inference's cases: the measured activity of x @ w_gate^T matches the case's label (the paper profile's
    per-token scale once inflated its 0.5% to 0.82%)."""
    bi = pytest.importorskip("sfl.experiments.kernel_bench.bench_inference")
    monkeypatch.setattr(bi, "DEV", "cpu")
    M, K, N = 4096, 256, 2048
    wg32, _, _ = bi.make_weights(K, N)
    x, wg = bi.make_case(wg32, M, K, N, pattern, p, 0.0, seed=3)
    measured = (x.float() @ wg.float().t() > 0).double().mean().item()
    assert abs(measured / p - 1) < 0.1, (pattern, p, measured)
