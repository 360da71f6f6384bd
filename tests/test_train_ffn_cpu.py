"""CPU tests of the sparse training op: the torch-ops backend (same algorithm as the CUDA kernels: hybrid
format, dense backup rows, transposes) against dense autograd in fp64, the saved format, the CSR-by-neuron
transpose, the dispatch state, input validation and the fake (meta) implementations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sfl.kernels.config import KernelConfig
from sfl.kernels.train import ops
from sfl.kernels.train_ffn import (DispatchState, sparse_gated_ffn_train, sparse_nongated_ffn_train,
                               update_tokens_since_fire_sparse)
from sfl.models.sparsity import l1_penalty, update_tokens_since_fire

DT = torch.float64


def problem(M, K, N, shift, seed, heavy_rows=(), empty_rows=(), full_rows=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, dtype=DT, generator=g)
    x[:, 0] = 1
    wg = torch.randn(N, K, dtype=DT, generator=g)
    wu = torch.randn(N, K, dtype=DT, generator=g)
    wd = torch.randn(K, N, dtype=DT, generator=g)
    wg[:, 0] = -shift
    wu[:, 0] = -shift  # the non-gated block takes its activity from w_up
    wg[:, 1] = wu[:, 1] = 100.0
    x[:, 1] = 0
    for r in heavy_rows:
        x[r, 2:] *= 6
    for r in full_rows:
        x[r, 1] = 1   # every neuron active
    for r in empty_rows:
        x[r] = 0
    return x, wg, wu, wd


def dense_ref(x, wg, wu, wd, reduction):
    a = F.relu(F.linear(x, wg if wg is not None else wu))
    h = a * F.linear(x, wu) if wg is not None else a
    return F.linear(h, wd), l1_penalty(h, reduction), (a != 0).sum(1, dtype=torch.int32)


def run_both(x, wg, wu, wd, reduction, width, coef=0.7, lead=None):
    gated = wg is not None
    ins = [t.clone().requires_grad_(True) for t in ((x, wg, wu, wd) if gated else (x, wu, wd))]
    gy = torch.randn(*x.shape, dtype=DT, generator=torch.Generator().manual_seed(99))
    xin = ins[0] if lead is None else ins[0].reshape(*lead, x.shape[-1])
    fn = sparse_gated_ffn_train if gated else sparse_nongated_ffn_train
    y, l1, st = fn(xin, *ins[1:], l1_reduction=reduction, mode="sparse", width=width, backend="torch")
    assert st["path"] == "sparse"
    g = torch.autograd.grad((y.reshape(-1, x.shape[-1]) * gy).sum() + coef * l1, ins)
    dins = [t.clone().requires_grad_(True) for t in ins]
    yd, l1d, nnz = dense_ref(dins[0], dins[1] if gated else None, dins[-2], dins[-1], reduction)
    gd = torch.autograd.grad((yd * gy).sum() + coef * l1d, dins)
    return (y.reshape(-1, x.shape[-1]), l1, g, st), (yd, l1d, gd, nnz)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_vs_dense_fp64_mixed_rows(gated, reduction):
    x, wg, wu, wd = problem(41, 24, 96, 1.8, 0, heavy_rows=(3, 9), empty_rows=(5,), full_rows=(7,))
    (y, l1, g, st), (yd, l1d, gd, nnz) = run_both(x, wg if gated else None, wu, wd, reduction, width=12)
    assert 0 < st["backup_rows"] < 41  # both light ELL rows and dense backup rows are exercised
    assert torch.allclose(y, yd, rtol=1e-10, atol=1e-10)
    assert torch.allclose(l1.double(), l1d.double(), rtol=1e-6, atol=0)  # l1_penalty sums in fp32
    for a, b in zip(g, gd):  # the reference's L1 goes through fp32 (l1_penalty), hence 1e-7 and not 1e-12
        assert (a - b).norm() <= 1e-7 * b.norm()
    assert torch.equal(st["nnz_per_token"], nnz)
    assert y[5].abs().max() == 0  # empty row


@pytest.mark.parametrize("M", [1, 7])
def test_odd_m_and_leading_dims(M):
    x, wg, wu, wd = problem(M, 16, 64, 1.5, M)
    (y, l1, g, st), (yd, l1d, gd, _) = run_both(x, wg, wu, wd, "mean", width=128)
    assert torch.allclose(y, yd, atol=1e-10) and all((a - b).norm() <= 1e-7 * b.norm() for a, b in zip(g, gd))
    x, wg, wu, wd = problem(6, 16, 64, 1.5, 3)
    (y, l1, g, st), (yd, l1d, gd, _) = run_both(x, wg, wu, wd, "sum", width=4, lead=(2, 3))
    assert torch.allclose(y, yd, atol=1e-10) and all((a - b).norm() <= 1e-7 * b.norm() for a, b in zip(g, gd))


def test_zero_rows_input():
    x = torch.zeros(0, 16, dtype=DT, requires_grad=True)
    wg, wu, wd = (torch.randn(32, 16, dtype=DT), torch.randn(32, 16, dtype=DT), torch.randn(16, 32, dtype=DT))
    y, l1, st = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", backend="torch")
    assert y.shape == (0, 16) and float(l1.detach()) == 0.0


def test_all_rows_backup_and_nan_rows():
    x, wg, wu, wd = problem(9, 16, 32, -1.0, 2)  # shift < 0: most neurons active, every row heavy at W=4
    x[4, 3] = float("nan")
    ins = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    y, l1, st = sparse_gated_ffn_train(*ins, mode="sparse", width=4, backend="torch")
    assert st["backup_rows"] == 9
    yd, _, _ = dense_ref(x, wg, wu, wd, "mean")
    assert torch.equal(torch.isnan(y), torch.isnan(yd))
    ok = ~torch.isnan(yd).any(1)
    assert torch.allclose(y[ok], yd[ok], atol=1e-10)


def test_saved_hybrid_format_and_transpose():
    x, wg, wu, wd = problem(30, 16, 64, 1.2, 4, heavy_rows=(2,))
    out = ops.ffn_fwd(x, wg, wu, wd, 10, 40, 1.0, 7, 0, False, "torch")
    y, l1, ell_col, ell_a, ell_u, nnz, flag, brow, backup, host, last = out
    assert last.numel() == 0
    light = nnz <= 40   # the measurement counts against measure_width 40 (no non-finite rows here)
    assert int(light.sum()) > int((flag == 0).sum()) and brow.numel() > 0   # rows heavy at 10, light at 40
    assert host.tolist() == [brow.numel(), int(nnz[light].max()), int(nnz[light].sum()), int((~light).sum())]
    a = F.relu(F.linear(x, wg))
    nnz_ref = (a != 0).sum(1, dtype=torch.int32)
    assert torch.equal(nnz, nnz_ref)
    assert torch.equal(brow, (nnz_ref > 10).nonzero().squeeze(1))  # exactly the Hybrid heavy rows
    assert torch.equal(backup, a[brow])
    from sfl.kernels import reference as ref

    hy = ref.d2h(a, 10)
    W = ell_col.shape[1]   # the narrowest ELL holding every light row (at most the width, 10)
    assert W == (max(1, int(nnz[flag == 0].max())) if (flag == 0).any() else 1) and W <= 10
    assert ell_a.shape[1] == ell_u.shape[1] == W
    saved = ops.saved_hybrid(ell_col, ell_a, nnz, brow, backup, 64)
    assert torch.equal(saved.backup_mask(), flag.bool())
    valid = saved.valid_mask()
    assert torch.equal(torch.where(valid, ell_col, -1)[flag == 0],
                       torch.where(valid, hy.ell_col[:, :W], -1)[flag == 0])
    assert torch.equal(torch.where(valid, ell_a, 0.0)[flag == 0], torch.where(valid, hy.ell_val[:, :W], 0.0)[flag == 0])
    u = F.linear(x, wu)
    assert torch.allclose(ell_u[valid], torch.gather(u, 1, ell_col.clamp(min=0).long())[valid])
    # CSR by neuron: every light entry exactly once, grouped by neuron, rows ascending
    perm, colptr = ref.csr_by_neuron(saved)
    assert int(colptr[-1]) == int(valid.sum())
    W = ell_col.shape[1]
    for j in range(64):
        e = perm[colptr[j]:colptr[j + 1]]
        rows = e // W
        assert torch.equal(ell_col.flatten()[e], torch.full_like(e, j, dtype=torch.int32))
        assert torch.equal(rows, rows.sort().values)
        expect = ((a[:, j] != 0) & (flag == 0)).nonzero().squeeze(1)
        assert torch.equal(rows, expect)


def test_torch_backend_keeps_no_history():
    """The torch backend (the exact fallback) keeps no dispatch history (that is the CUDA plan's, tested on the GPU):
    a sparse call keeps the narrowest ELL that holds its light rows (at most the width), exact at any width, with
    exact gradients; auto runs dense."""
    x, wg, wu, wd = problem(20, 16, 64, 1.5, 5)
    yd, _, _ = dense_ref(x, wg, wu, wd, "mean")
    st = DispatchState()
    for width in (128, 128, 8):
        ins = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        y, l1, s = sparse_gated_ffn_train(*ins, mode="sparse", backend="torch", state=st, width=width)
        light = s["nnz_per_token"][s["nnz_per_token"] <= width]
        assert s["width"] == (max(1, int(light.max())) if light.numel() else 1) and st.plan is None
        assert torch.allclose(y.double(), yd.double(), atol=1e-10)
        (y.sum() + l1).backward()
        ref_ins = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        yr, l1r, _ = dense_ref(*ref_ins, "mean")
        (yr.sum() + l1r).backward()
        for a, b in zip(ins, ref_ins):
            assert torch.allclose(a.grad, b.grad, atol=1e-10)
    assert s["backup_rows"] > 0   # width 8: rows above it are exact backup rows
    _, _, s = sparse_gated_ffn_train(x, wg, wu, wd, backend="torch", state=st)
    assert s["path"] == "dense" and st.activity is None


def test_last_active_rows_and_tracker():
    x, wg, wu, wd = problem(25, 16, 64, 1.7, 6, heavy_rows=(4,))
    _, _, sd = sparse_gated_ffn_train(x, wg, wu, wd, mode="dense", want_last_active=True)
    _, _, ss = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", width=8, backend="torch",
                                      want_last_active=True)
    assert ss["backup_rows"] >= 1
    assert torch.equal(sd["last_active_row"], ss["last_active_row"])
    a = F.relu(F.linear(x, wg)) != 0
    t1 = torch.randint(0, 50, (64,), dtype=torch.int64)
    t2 = t1.clone()
    update_tokens_since_fire(t1, a)
    update_tokens_since_fire_sparse(t2, ss["last_active_row"], 25)
    assert torch.equal(t1, t2)


def test_dw_chunks_fit_one_slice_in_l2_and_bad_values_are_refused():
    from sfl.kernels.train.ops import dw_chunks

    # the widest K slice (256 nb columns) whose rows x 256 nb bf16 stay within 16 MiB; never below one chunk
    assert [dw_chunks(m) for m in (1, 4096, 8192, 16384, 32768, 65536, 1 << 20)] == [8, 8, 4, 2, 1, 1, 1]
    for v in (3, 16, -1, True):
        with pytest.raises(ValueError, match="train_dw_nb"):
            KernelConfig(train_dw_nb=v)


def test_settings_come_from_the_kernel_config_not_the_environment(monkeypatch):
    """The width and the dispatch thresholds are the config's train_* fields; no environment variable is read per
    call (KernelConfig.from_env is the explicit, read-once override of benchmark sweeps)."""
    cfg = KernelConfig(train_width=4, train_shrink=False, train_fused_dense=False)
    monkeypatch.setenv("SFL_KERNEL_TRAIN_WIDTH", "4")
    x, wg, wu, wd = problem(9, 16, 32, -1.0, 2)   # most neurons active: every row is heavy at W=4, none at W=128
    _, _, st = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", backend="torch", config=cfg)
    assert st["path"] == "sparse" and st["backup_rows"] == 9 and st["width"] <= 4   # the config's width
    _, _, st = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", backend="torch")
    assert st["path"] == "sparse" and st["backup_rows"] == 0   # the env width (4) was not read
    assert KernelConfig.from_env(environ={"SFL_KERNEL_TRAIN_MODE": "sparse"}).train_mode == "sparse"
    with pytest.raises(ValueError, match="KernelConfig.train_mode"):
        KernelConfig(train_mode="forced")
    with pytest.raises(TypeError, match="KernelConfig"):
        sparse_gated_ffn_train(x, wg, wu, wd, config={"train_width": 4})


def test_auto_mode_on_cpu_is_dense_and_exact():
    x, wg, wu, wd = problem(10, 16, 32, 1.5, 7)
    y, l1, st = sparse_gated_ffn_train(x, wg, wu, wd)
    assert st["path"] == "dense"
    yd, l1d, _ = dense_ref(x, wg, wu, wd, "mean")
    assert torch.allclose(y, yd) and torch.allclose(l1.double(), l1d.double(), rtol=1e-6)


def test_autocast_cpu_bf16_fp32_master_grads():
    x, wg, wu, wd = problem(12, 16, 32, 1.5, 8)
    ps = [t.float().requires_grad_(True) for t in (wg, wu, wd)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, l1, st = sparse_gated_ffn_train(x.float(), *ps, mode="sparse", backend="torch")
    assert y.dtype == torch.bfloat16
    (y.float().sum() + l1).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ps)


@pytest.mark.parametrize("bad,match", [
    (dict(w_down="T"), "w_down must be"),
    (dict(w_up="short"), "w_up must be"),
    (dict(reduction="avg"), "l1_reduction"),
    (dict(mode="fast"), "mode must be"),
    (dict(backend="cuda"), "backend='cuda' cannot"),
    (dict(dtype_mix=True), "share one dtype"),
    (dict(width=0), "width must be"),
])
def test_validation_messages(bad, match):
    x, wg, wu, wd = problem(4, 16, 32, 1.5, 9)
    kw = {"l1_reduction": bad.get("reduction", "mean"), "mode": bad.get("mode", "sparse")}
    if "backend" in bad:
        kw["backend"] = bad["backend"]
    if "width" in bad:
        kw["width"] = bad["width"]
    if bad.get("w_down") == "T":
        wd = wd.t()
    if bad.get("w_up") == "short":
        wu = wu[:, :8]
    if bad.get("dtype_mix"):
        x = x.float()
    with pytest.raises(ValueError, match=match):
        sparse_gated_ffn_train(x, wg, wu, wd, **kw)


def test_fake_impls_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(10, 64, dtype=torch.bfloat16, device="cuda" if False else "cpu")
        wg = torch.empty(256, 64, dtype=torch.bfloat16)
        wd = torch.empty(64, 256, dtype=torch.bfloat16)
        out = torch.ops.sfl_train.ffn_fwd(x, wg, wg, wd, 72, 128, 1.0, 4096, 16, True)
        # cuda: static shapes (no data-dependent size: no host sync to trace around)
        assert out[0].shape == (10, 64) and out[2].shape == (10, 72) and out[4].shape == (10, 72)
        assert out[7].shape == (0,) and out[8].shape == (0, 256) and out[9].shape == (4,) and out[10].shape == (256,)
        g = torch.ops.sfl_train.ffn_bwd(out[0], out[1], x, wg, wg, wd, *out[2:7], out[9], 1.0, 4, 0)
        assert g[0].shape == (10, 64) and g[1].shape == (256, 64) and g[3].shape == (64, 256)  # dW_d as w_down
        out2 = torch.ops.sfl_train.ffn_fwd(x, None, wg, wd, 128, 128, 1.0, 4096, 0, False)
        assert out2[2].shape == (10, 128) and out2[4].numel() == 0 and out2[10].numel() == 0


# ----------------------------------------------------------------------------------------------- non-finite values
NONFINITE = {"+inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def assert_same_nonfinite(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """NaN, +Inf and -Inf at exactly the same entries as b (dense autograd), the finite rest close."""
    a, b = a.detach().double(), b.detach().double()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        got, want = test(a), test(b)
        assert torch.equal(got, want), f"{what}: {test.__name__} at {int(got.sum())} entries, dense {int(want.sum())}"
    ok = torch.isfinite(b)
    assert (a[ok] - b[ok]).norm() <= 1e-7 * b[ok].norm() + 1e-12, what


def inject(tensors: dict[str, torch.Tensor], where: str, value: float) -> None:
    """One non-finite value in x (two rows), in one weight entry, or in the upstream gradient dy (one row)."""
    if where == "x":
        tensors["x"][2, 3] = value
        tensors["x"][5, 7] = value
    elif where == "w_gate":
        tensors["w_gate"][4, 3] = value   # reaches neuron 4's pre-activation in every row
    elif where == "w_up":
        tensors["w_up"][4, 3] = value
    elif where == "w_down":
        tensors["w_down"][3, 4] = value
    elif where == "dy":
        tensors["dy"][2, 3] = value


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("where", ["x", "w_gate", "w_up", "w_down", "dy", "dl1"])
@pytest.mark.parametrize("value", list(NONFINITE))
@pytest.mark.parametrize("width", [6, 96])  # 96 >= N: no heavy row, only the non-finite rule sends rows dense
def test_nonfinite_like_dense_autograd(gated, where, value, width):
    """The torch backend (the reference) puts NaN and +-Inf where dense autograd does: y, l1 and every gradient."""
    if where == "w_gate" and not gated:
        pytest.skip("the non-gated block has no w_gate")
    x, wg, wu, wd = problem(12, 16, 96, 1.5, 11, heavy_rows=(1,))
    gy = torch.randn(12, 16, dtype=DT, generator=torch.Generator().manual_seed(12))
    t = {"x": x, "w_gate": wg, "w_up": wu, "w_down": wd, "dy": gy}
    inject(t, where, NONFINITE[value])
    coef = NONFINITE[value] if where == "dl1" else 0.7   # the L1 term's gradient itself non-finite
    (y, l1, g, st), (yd, l1d, gd, _) = run_both_with(x, wg if gated else None, wu, wd, gy, "mean", width, coef)
    assert st["path"] == "sparse" and st["backend"] == "torch"
    assert_same_nonfinite(y, yd, "y")
    assert_same_nonfinite(l1, l1d, "l1")
    names = ["dx", "dw_gate", "dw_up", "dw_down"] if gated else ["dx", "dw_up", "dw_down"]
    for name, a, b in zip(names, g, gd):
        assert_same_nonfinite(a, b, name)


def run_both_with(x, wg, wu, wd, gy, reduction, width, coef):
    """run_both with a given upstream gradient gy (which may hold non-finite values)."""
    gated = wg is not None
    ins = [t.clone().requires_grad_(True) for t in ((x, wg, wu, wd) if gated else (x, wu, wd))]
    fn = sparse_gated_ffn_train if gated else sparse_nongated_ffn_train
    y, l1, st = fn(*ins, l1_reduction=reduction, mode="sparse", width=width, backend="torch")
    g = torch.autograd.grad([y, l1], ins, [gy, torch.tensor(coef, dtype=l1.dtype)])
    dins = [t.clone().requires_grad_(True) for t in ins]
    yd, l1d, nnz = dense_ref(dins[0], dins[1] if gated else None, dins[-2], dins[-1], reduction)
    gd = torch.autograd.grad([yd, l1d], dins, [gy, torch.tensor(coef, dtype=l1d.dtype)])
    return (y, l1, g, st), (yd, l1d, gd, nnz)


def test_nonfinite_x_gate_gradient_counts_match_dense():
    """The case: +Inf in x. The torch backend gave far more NaNs in dW_gate than autograd (a mask product,
    0 * Inf, where relu's backward selects); now the counts are equal entry for entry."""
    x, wg, wu, wd = problem(40, 16, 96, 1.5, 13)
    x[7, 5] = float("inf")
    gy = torch.randn(40, 16, dtype=DT, generator=torch.Generator().manual_seed(14))
    (_, _, g, _), (_, _, gd, _) = run_both_with(x, wg, wu, wd, gy, "mean", 128, 0.7)
    assert int(g[1].isnan().sum()) == int(gd[1].isnan().sum()) > 0
    assert_same_nonfinite(g[1], gd[1], "dw_gate")
