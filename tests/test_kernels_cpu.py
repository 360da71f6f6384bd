"""CPU tests of the Python side of the TwELL kernels: input validation, error messages, fake impls."""
from __future__ import annotations

import pytest
import torch

import kernels.ffn as ffn
from kernels.loader import KernelUnavailableError, load_twell, source_hash


def _w(K=576, N=1536, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(8, K, dtype=dtype, device=device), torch.randn(N, K, dtype=dtype, device=device),
            torch.randn(N, K, dtype=dtype, device=device), torch.randn(K, N, dtype=dtype, device=device))


def test_cpu_tensors_name_the_reference_path():
    x, wg, wu, wd = _w()
    with pytest.raises(KernelUnavailableError, match="kernels.reference"):
        ffn.sparse_gated_ffn(x, wg, wu, wd)
    with pytest.raises(KernelUnavailableError, match="kernels.reference"):
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

    import kernels.twell.ops  # noqa: F401

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
    from kernels.twell.ops import crossover

    spec = "1:0.012,17:0,8192:0.003"
    assert crossover(1, spec) == 0.012 and crossover(16, spec) == 0.012
    assert crossover(17, spec) == 0.0 and crossover(8191, spec) == 0.0
    assert crossover(8192, spec) == 0.003 and crossover(10 ** 6, spec) == 0.003
    assert crossover(5, "64:0.01") == 0.0   # below the first bucket: dense
    with pytest.raises(ValueError, match="TWELL_CROSSOVER"):
        crossover(5, "garbage")


def test_layer_history_update_and_keys():
    from kernels.twell.ops import LayerHistory, history_for, reset_history

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


def test_knobs_cached_until_reload(monkeypatch):
    """The hot path reads a cached copy of the TWELL_* knobs; a changed env var takes effect after reload_knobs()."""
    from kernels.twell import ops

    monkeypatch.delenv("TWELL_PROBE_ROWS", raising=False)
    monkeypatch.delenv("TWELL_CROSSOVER", raising=False)
    assert ffn.reload_knobs()["probe_rows"] == 256
    monkeypatch.setenv("TWELL_PROBE_ROWS", "64")
    monkeypatch.setenv("TWELL_CROSSOVER", "1:0.5")
    assert ops._knobs()["probe_rows"] == 256          # not yet: no env reads per call
    with pytest.warns(UserWarning, match="reload_knobs"):
        assert ops.knobs()["probe_rows"] == 256       # provenance names the values in use, and warns
    kn = ffn.reload_knobs()
    assert kn["probe_rows"] == 64 and ops._knobs()["probe_rows"] == 64 and ops._knobs()["_probe_max"] == 64
    assert ops._crossover_at(100, ops._knobs()) == 0.5
    kn["probe_rows"] = 1                              # callers get a copy: the cache stays intact
    assert ops.knobs()["probe_rows"] == 64 and "_probe_max" not in ops.knobs()
    monkeypatch.setenv("TWELL_CROSSOVER", "1:0.25")
    ffn.reload_knobs()
    assert ops._crossover_at(100, ops._knobs()) == 0.25   # the per-M crossover memo is cleared too
    monkeypatch.setenv("TWELL_SLOTS", "many")
    with pytest.raises(ValueError, match="TWELL_SLOTS='many' must be an integer"):
        ffn.reload_knobs()
    assert ops._knobs()["probe_rows"] == 64           # a failed reload leaves the knobs in use untouched
    monkeypatch.undo()
    ffn.reload_knobs()


def _fake_cuda(monkeypatch):
    """CPU tensors that claim to be CUDA for the validation code (which only reads attributes)."""
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)


def test_fast_validation_agrees_with_validate(monkeypatch):
    """The per-call fast check accepts exactly what validate() accepts, and re-checks every call: a weight
    replaced by a new tensor (or edited in place into another dtype/layout) is caught on the next call."""
    x, wg, wu, wd = _w()
    _fake_cuda(monkeypatch)
    assert ffn._fast_ok(x, wg, wu, wd) and ffn._fast_ok(x, None, wu, wd)
    ffn.validate(x, wg, wu, wd)
    assert ffn._fast_ok(x.view(2, 4, 576), wg, wu, wd)
    bad = [(x.float(), wg, wu, wd), (x, wg.t().contiguous().t(), wu, wd), (x, wg, wu, wd.t().contiguous()),
           (x, wg[:256].contiguous(), wu, wd), (x, wg, wu.float(), wd), (x, wg, wu, wd[:, :1024].contiguous()),
           (x[:, :100].contiguous(), wg, wu, wd), (torch.tensor(1.0, dtype=torch.bfloat16), wg, wu, wd),
           ("x", wg, wu, wd)]
    for args in bad:
        assert not ffn._fast_ok(*args)
        with pytest.raises((ValueError, TypeError)):
            ffn.validate(*args)
    lin = torch.nn.Linear(576, 1536, bias=False, dtype=torch.bfloat16)
    w = lin.weight.detach()
    assert ffn._fast_ok(x, w, wu, wd)
    with torch.no_grad():
        lin.weight.data = lin.weight.data.float()     # new tensor under the same Parameter
    assert not ffn._fast_ok(x, lin.weight.detach(), wu, wd)
    wg2 = wg.clone()
    wg2.t_()                                          # in-place metadata edit of the same tensor object
    assert not ffn._fast_ok(x, wg2, wu, wd)
    with pytest.raises(ValueError, match="contiguous|w_gate must be"):
        ffn.validate(x, wg2, wu, wd)


def test_dense_sample_readback_decodes_pairs():
    """poll() reads the dense-path sample ([P, 2] int32 = (nnz, flagged) per row) through one int64 reduction;
    with flagged rows it falls back to the exact masked sum. Both agree with a plain computation."""
    from kernels.twell.ops import LayerHistory

    for pairs in ([[5, 0], [7, 0], [0, 0]], [[5, 1], [7, 0], [3, 0], [1000, 1]], [[2, 1], [4, 1]]):
        P, n = len(pairs), 1536
        h = LayerHistory()
        h._host = [torch.zeros(LayerHistory.HOST_WORDS, dtype=torch.int32) for _ in range(2)]   # unpinned on CPU
        h._events = [None, None]
        host = h._host[0][: 2 * P].view(P, 2)
        host.copy_(torch.tensor(pairs, dtype=torch.int32))
        packed = host.numpy().view("int64").reshape(P)

        class Done:
            def query(self):
                return True

        h.expect(Done(), host, "sample", P, n, packed)
        h.poll()
        ok = [c for c, b in pairs if not b]
        n_bad = P - len(ok)
        want = 1.0 if n_bad == P else sum(ok) / (len(ok) * n)
        assert h.p == pytest.approx(want) and h.f == n_bad / P and h.measurements == 1 and not h.busy()
