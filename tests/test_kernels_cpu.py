"""CPU tests of the Python side of the TwELL kernels: input validation, error messages, fake impls."""
from __future__ import annotations

import pytest
import torch

import sfl.kernels.ffn as ffn
from sfl.kernels.loader import KernelUnavailableError, load_twell, source_hash


def _w(K=576, N=1536, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(8, K, dtype=dtype, device=device), torch.randn(N, K, dtype=dtype, device=device),
            torch.randn(N, K, dtype=dtype, device=device), torch.randn(K, N, dtype=dtype, device=device))


def test_cpu_tensors_name_the_reference_path():
    x, wg, wu, wd = _w()
    with pytest.raises(KernelUnavailableError, match="sfl.kernels.reference"):
        ffn.sparse_gated_ffn(x, wg, wu, wd)
    with pytest.raises(KernelUnavailableError, match="sfl.kernels.reference"):
        ffn.sparse_nongated_ffn(x, wu, wd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_loader_without_gpu_says_what_to_do():
    with pytest.raises(KernelUnavailableError, match="CUDA GPU"):
        load_twell()


def test_source_hash_is_stable_and_covers_sources():
    assert source_hash() == source_hash() and len(source_hash()) == 12


def test_validate_rejects_bad_inputs():
    x, wg, wu, wd = _w()
    with pytest.raises(KernelUnavailableError, match=r"\.cuda\(\)"):
        ffn.validate(x, wg, wu, wd)


@pytest.mark.parametrize("K,N,msg", [(100, 1536, "K % 64"), (576, 1000, "N % 256"), (8192, 1536, "K <= 4096")])
def test_validate_shape_rules(monkeypatch, K, N, msg):
    x, wg, wu, wd = _w(K, N)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=msg):
        ffn.validate(x, wg, wu, wd)


def test_validate_dtype_contiguity_layout(monkeypatch):
    x, wg, wu, wd = _w()
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="bfloat16"):
        ffn.validate(x.float(), wg, wu, wd)
    with pytest.raises(ValueError, match="contiguous"):
        ffn.validate(x, wg.t().contiguous().t(), wu, wd)
    with pytest.raises(ValueError, match="w_down must be"):
        ffn.validate(x, wg, wu, wd.t().contiguous())
    with pytest.raises(ValueError, match="w_gate must be"):
        ffn.validate(x, wg[:256].contiguous(), wu, wd)


def test_fake_impls_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import sfl.kernels.twell.ops  # noqa: F401

    ops = torch.ops.sfl_twell
    with FakeTensorMode():
        x = torch.empty(37, 576, dtype=torch.bfloat16)
        wg = torch.empty(1536, 576, dtype=torch.bfloat16)
        wdt = torch.empty(1536, 576, dtype=torch.bfloat16)
        wd = torch.empty(576, 1536, dtype=torch.bfloat16)
        y, nnz = ops.gated_ffn(x, wg, wg, wdt, wd, 0, 0.0, True)
        assert y.shape == (37, 576) and y.dtype == torch.bfloat16 and nnz.shape == (37,) and nnz.dtype == torch.int32
        y, nnz = ops.nongated_ffn(x, wg, wdt, wd, 0, 0.0, False)
        assert y.shape == (37, 576) and nnz.shape == (0,)
        p, c, f = ops.d2t(x, wg, 32)
        assert p.shape == (37, 6, 32) and c.shape == (37, 6) and f.shape == (37,)


def test_module_rejects_bias():
    lin = torch.nn.Linear(64, 256, bias=True)
    with pytest.raises(ValueError, match="bias"):
        ffn.TwELLMLP.from_linears(lin, torch.nn.Linear(256, 64, bias=False))


def test_crossover_table_parsing():
    from sfl.kernels.twell.ops import crossover

    spec = "1:0.012,17:0,8192:0.003"
    assert crossover(1, spec) == 0.012 and crossover(16, spec) == 0.012
    assert crossover(17, spec) == 0.0 and crossover(8191, spec) == 0.0
    assert crossover(8192, spec) == 0.003 and crossover(10 ** 6, spec) == 0.003
    assert crossover(5, "64:0.01") == 0.0   # below the first bucket: dense
    with pytest.raises(ValueError, match="TWELL_CROSSOVER"):
        crossover(5, "garbage")


def test_layer_history_update_and_keys():
    from sfl.kernels.twell.ops import LayerHistory, history_for, reset_history

    h = LayerHistory()
    h.update(nnz_ok=900, n_bad=10, rows=100, n=1000)   # 900 active entries over 90 unflagged rows of 1000
    assert h.p == 0.01 and h.f == 0.1
    h.update(nnz_ok=45, n_bad=0, rows=10, n=900)
    assert h.p == 45 / 9000 and h.f == 0.0
    h.update(nnz_ok=0, n_bad=4, rows=4, n=900)   # every row flagged: treat as fully active (dense)
    assert h.p == 1.0 and h.f == 1.0
    reset_history()
    w = torch.empty(256, 64)
    assert history_for(w) is history_for(w.detach()) is history_for(w.view(256, 64))
    assert history_for(w) is not history_for(torch.empty(256, 64))


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



def test_knobs_parse_every_env_var(monkeypatch):
    """knobs() runs on CPU too: every TWELL_* knob parses, a set value reaches the dict, unset ones default."""
    from sfl.kernels.twell import ops

    base = ops.knobs()
    assert base["slots"] == 32 and base["compact"] == 2 and "crossover" in base
    for name in ops._KNOB_ENV:
        assert name.startswith("TWELL_")
    monkeypatch.setenv("TWELL_SLOTS", "16")
    monkeypatch.setenv("TWELL_FLAGGED_DENSE_ABOVE", "0.25")
    kn = ops.knobs()
    assert kn["slots"] == 16 and kn["flagged_dense_above"] == 0.25


def test_every_knob_is_documented():
    """Each TWELL_* env knob the ops read has a row in kernels/README.md's KNOBS table (default, effect, failure)."""
    from pathlib import Path

    from sfl.kernels.twell import ops

    readme = (Path(ops.__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## KNOBS"):]
    missing = [k for k in ops._KNOB_ENV if f"| `{k}` |" not in table]
    assert not missing, f"knobs without a KNOBS row in kernels/README.md: {missing}"


def test_self_timing_decisions_on_cpu():
    """LayerHistory's self-timing bookkeeping (no GPU needed: samples injected)."""
    from sfl.kernels.twell.ops import LayerHistory

    h = LayerHistory()
    b = 13
    h.count_call(b)
    assert h.needs_dense_probe(b) and not h.sparse_slower(b) and h.want_timing(b, "dense")
    for ms in (5.0, 1.0):               # a warm-up outlier, then the real dense time
        h.add_sample(b, "dense", ms)
    assert not h.needs_dense_probe(b)
    h.add_sample(b, "sparse", 1.5)
    assert not h.sparse_slower(b)        # one sparse sample is not enough
    h.add_sample(b, "sparse", 1.2)
    h.count_call(b)
    assert h.sparse_slower(b)            # min 1.2 > min 1.0
    for ms in (0.8, 0.9, 0.7):           # activity fell: sparse now faster; only the last 3 samples count
        h.add_sample(b, "sparse", ms)
    assert h.times[(b, "sparse")] == [0.8, 0.9, 0.7] and not h.sparse_slower(b)
    h.add_sample(b, "sparse", 2.0)
    h.add_sample(b, "sparse", 2.0)
    h.add_sample(b, "sparse", 2.0)
    h.bucket_calls[b] = LayerHistory.REPROBE_EVERY
    assert not h.sparse_slower(b)        # the periodic re-probe runs sparse again
    h.bucket_calls[b] += 1
    assert h.sparse_slower(b)


def test_promotion_band_decisions_on_cpu():
    """Just above the crossover: sparse is probed (2 samples), run when >2% faster than dense, re-probed every
    REPROBE_EVERY calls of the bucket."""
    from sfl.kernels.twell.ops import LayerHistory

    h = LayerHistory()
    b = 17
    h.count_call(b)
    assert h.needs_sparse_probe(b) and not h.sparse_faster(b)
    h.add_sample(b, "sparse", 0.9)
    h.add_sample(b, "sparse", 0.8)
    assert not h.needs_sparse_probe(b) and not h.sparse_faster(b)   # no dense samples yet
    h.add_sample(b, "dense", 1.0)
    h.add_sample(b, "dense", 1.1)
    assert h.sparse_faster(b)                                        # 0.8 < 0.98 * 1.0
    h.add_sample(b, "sparse", 0.99)
    h.add_sample(b, "sparse", 0.99)
    h.add_sample(b, "sparse", 0.99)
    assert not h.sparse_faster(b)                                    # within 2%: stay dense
    h.bucket_calls[b] = LayerHistory.REPROBE_EVERY
    assert h.needs_sparse_probe(b)


def test_nongated_table_is_its_own(monkeypatch):
    from sfl.kernels.twell import ops

    kn = ops.knobs()
    assert kn["crossover_nongated"] == ops.DEFAULT_CROSSOVER_NONGATED != kn["crossover"]
    monkeypatch.setenv("TWELL_CROSSOVER_NONGATED", "1:0.5")
    assert ops.crossover(100, ops.knobs()["crossover_nongated"]) == 0.5


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


def test_history_is_per_storage():
    """Views of one weight share a history; a new weight at the same address would not (storage object in the
    key), so timing samples of a freed weight never steer a new one."""
    import torch

    from sfl.kernels.twell import ops

    w = torch.randn(256, 64)
    assert ops.history_for(w) is ops.history_for(w.detach()) is ops.history_for(w.view(256, 64))
    other = torch.randn(256, 64)
    assert ops.history_for(other) is not ops.history_for(w)
