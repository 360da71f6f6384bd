"""GPU tests of the sparse training op (kernels/train_ffn.py) against fp32 dense autograd (skipped without CUDA).

Budget: for y, l1 and EVERY gradient, ||ours - fp32|| / ||fp32|| <= 2 x the same error of bf16 PyTorch dense
autograd on the same bf16 inputs (+ 1e-6 floor). Inputs are fresh random draws with adversarial rows (heavy,
fully active, empty); outputs are poisoned (free allocator memory NaN-filled) before every call.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
BF = torch.bfloat16


def poison() -> None:
    free = torch.cuda.mem_get_info()[0]
    t = torch.empty(min(int(free * 0.3), 3 << 30) // 4, device=DEV, dtype=torch.float32)
    t.fill_(float("nan"))
    del t
    small = [torch.full((1 << s,), float("nan"), device=DEV) for s in range(10, 24)]
    del small


def make_problem(M, K, N, p, seed, gated=True, heavy_frac=0.0, adversarial=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g)
    x[:, :3] = 0
    x[:, 0] = 1
    std = 1.0 / K ** 0.5
    wg = torch.randn(N, K, device=DEV, generator=g) * std
    wu = torch.randn(N, K, device=DEV, generator=g) * std
    wd = torch.randn(K, N, device=DEV, generator=g) / N ** 0.5
    first = wg if gated else wu
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - p)).item()
    first[:, 0] = -z
    first[:, 1] = 0
    first[: min(N, 300), 1] = 30.0   # feature 1: a block of 300 neurons active (heavy row)
    first[:, 2] = 30.0               # feature 2: every neuron active
    if heavy_frac > 0:
        n = max(1, int(heavy_frac * M))
        rows = torch.randperm(M, device=DEV, generator=g)[:n]
        x[rows, 3:] *= 4.0
    if adversarial and M >= 12:
        x[1] = 0          # empty row: nothing active (feature 0 off too)
        x[2, 3:] *= 6     # heavy row
        x[3, 1] = 1       # 300 active
        x[4, 2] = 1       # fully active row
        x[8:10, 3:] *= 4
    ws = [t.to(BF).contiguous() for t in (wg, wu, wd)]
    return x.to(BF).contiguous(), ws[0], ws[1], ws[2]


def rel(a, b):
    a, b = a.double(), b.double()
    nb = b.norm().item()
    if nb == 0:
        return a.norm().item()
    return (a - b).norm().item() / nb


def dense_fn(x, wg, wu, wd, reduction):
    a = F.relu(F.linear(x, wg if wg is not None else wu))
    h = a * F.linear(x, wu) if wg is not None else a
    y = F.linear(h, wd)
    M, N = x.shape[0], wu.shape[0]
    l1 = h.abs().sum(dtype=torch.float32) / (M * N if reduction == "mean" else M)
    return y, l1


def grads(fn, inputs, gy, coef):
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    y, l1 = fn(*ins)[:2]
    loss = (y.float() * gy.float()).sum() + coef * l1
    gs = torch.autograd.grad(loss, ins)
    return y.detach(), l1.detach(), [g.detach() for g in gs]


def check_case(M, K, N, p, seed, gated=True, heavy_frac=0.0, reduction="sum", coef=1.0, gy_zero=False,
               mode="sparse", width=None, adversarial=True, config=None, state=None):
    from sfl.kernels.train_ffn import sparse_gated_ffn_train, sparse_nongated_ffn_train

    x, wg, wu, wd = make_problem(M, K, N, p, seed, gated, heavy_frac, adversarial)
    gy = torch.zeros(M, K, device=DEV) if gy_zero else torch.randn(M, K, device=DEV, generator=torch.Generator(
        device=DEV).manual_seed(seed + 1))
    ins = [x, wg, wu, wd] if gated else [x, wu, wd]

    def d(*t):
        return dense_fn(t[0], t[1] if gated else None, t[2] if gated else t[1], t[-1], reduction)

    ref = grads(d, [t.float() for t in ins], gy, coef)
    bf = grads(d, ins, gy, coef)

    def ours_fn(*t):
        kw = dict(l1_reduction=reduction, mode=mode, width=width, config=config, state=state)
        if gated:
            return sparse_gated_ffn_train(*t, **kw)
        return sparse_nongated_ffn_train(*t, **kw)

    poison()
    y, l1, gs = grads(ours_fn, ins, gy, coef)
    _, _, st = ours_fn(*ins)
    names = ["y", "l1"] + (["dx", "dw_gate", "dw_up", "dw_down"] if gated else ["dx", "dw_up", "dw_down"])
    outs = [y, l1] + gs
    refs = [ref[0], ref[1]] + ref[2]
    bfs = [bf[0], bf[1]] + bf[2]
    report = {}
    for n, o, r, b in zip(names, outs, refs, bfs):
        assert torch.isfinite(o).all(), f"{n}: non-finite values (unwritten output?)"
        e_o, e_b = rel(o, r), rel(b, r)
        report[n] = (e_o, e_b)
        assert e_o <= 2 * e_b + 1e-6, f"{n}: error {e_o:.3e} > 2 x bf16 PyTorch's {e_b:.3e} ({report})"
    nnz_ref = (F.relu(F.linear(x, wg if gated else wu)) != 0).sum(1, dtype=torch.int32)
    assert torch.equal(st["nnz_per_token"], nnz_ref)
    return st, report


@pytest.mark.parametrize("p,heavy", [(0.005, 0.0), (0.005, 0.01), (0.01, 0.01), (0.02, 0.0), (0.05, 0.0),
                                     (0.2, 0.0)])
def test_gated_paper_shape(p, heavy):
    st, rep = check_case(4096, 2048, 5632, p, seed=int(p * 1e4) + 7, heavy_frac=heavy)
    print(p, heavy, st["backup_rows"], st["width"], rep)
    assert st["path"] == "sparse"
    assert st["backup_rows"] >= 5  # the adversarial rows are heavy: the dense backup is exercised


@pytest.mark.parametrize("M", [1, 7, 1000])
@pytest.mark.parametrize("gated", [True, False])
def test_odd_m_and_small_shapes(M, gated):
    check_case(M, 576, 1536, 0.01, seed=M, gated=gated, adversarial=M >= 12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_l1_gradient_only(reduction):
    # dy = 0: every gradient comes from the L1 term (sign(h) through u, a, the transposes)
    coef = 1.0 if reduction == "sum" else 5632.0
    check_case(2048, 1024, 5632, 0.01, seed=3, reduction=reduction, coef=coef, gy_zero=True)


def test_nongated_paper_shape_heavy():
    st, _ = check_case(4096, 2048, 5632, 0.005, seed=11, gated=False, heavy_frac=0.01)
    assert st["backup_rows"] > 0


def test_small_width_many_backup_rows():
    st, _ = check_case(1024, 1024, 2048, 0.02, seed=5, width=16)
    assert st["backup_rows"] > 500 and st["width"] <= 16


def test_chunked_gate():
    from sfl.kernels.config import KernelConfig

    check_case(1000, 1024, 2048, 0.01, seed=9, config=KernelConfig(train_chunk_rows=300))


@pytest.mark.parametrize("gated", [True, False])
def test_dw_chunk_widths_give_the_same_bits(gated):
    """dw's K slices (train_dw_nb 1/2/4/8, and 0 = from the rows) change which warp sums which columns, not the
    order of any sum: every weight gradient has the same bits. K = 576 leaves a partial last slice at every width."""
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.train_ffn import sparse_gated_ffn_train, sparse_nongated_ffn_train

    check_case(3000, 576, 1536, 0.01, seed=21, gated=gated)  # the error budget, at the automatic width
    x, wg, wu, wd = make_problem(3000, 576, 1536, 0.01, 21, gated, 0.0, True)
    fn = sparse_gated_ffn_train if gated else sparse_nongated_ffn_train
    grads_by_nb = {}
    for nb in (0, 1, 2, 4, 8):
        ins = [t.clone().requires_grad_(True) for t in ([x, wg, wu, wd] if gated else [x, wu, wd])]
        poison()
        y, l1, _ = fn(*ins, mode="sparse", config=KernelConfig(train_dw_nb=nb))
        (y.float().square().sum() + l1).backward()
        grads_by_nb[nb] = [t.grad for t in ins[1:]]
    for nb in (1, 2, 4, 8):
        assert all(torch.equal(a, b) for a, b in zip(grads_by_nb[nb], grads_by_nb[0])), f"nb {nb} differs"


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("gated", [True, False])
def test_neuron_major_w_down(mode, gated):
    """W_d stored neuron-major (kernels/layout.py, the model's layout): dW_d comes back in W_d's strides, so a
    Parameter's .grad keeps them (autograd copies nothing). With no backup rows the sparse path gives the bits it
    gives with nn.Linear's row-major W_d, for y, l1 and every gradient (the kernels read the same values); with
    backup rows (dense GEMMs on W_d) and on the fused dense path, within bf16 rounding of them."""
    from sfl.kernels.layout import is_neuron_major
    from sfl.kernels.train_ffn import sparse_gated_ffn_train, sparse_nongated_ffn_train

    M, K, N = 2048, 1024, 2048
    fn = sparse_gated_ffn_train if gated else sparse_nongated_ffn_train
    gy = torch.randn(M, K, device=DEV, generator=torch.Generator(device=DEV).manual_seed(72))

    def step(x, ws):
        ps = [torch.nn.Parameter(w.clone()) for w in ws]  # clone keeps the strides
        xi = x.clone().requires_grad_(True)
        poison()
        y, l1, st = fn(xi, *ps, l1_reduction="sum", mode=mode)
        ((y.float() * gy).sum() + l1).backward()
        assert st["path"] == mode
        assert all(p.grad.stride() == p.stride() for p in ps), [(p.grad.stride(), p.stride()) for p in ps]
        return int(st["backup_rows"] or 0), [y.detach(), l1.detach(), xi.grad] + [p.grad for p in ps]

    for adversarial in (False, True):
        x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=71, gated=gated, adversarial=adversarial)
        wd_nm = wd.t().contiguous().t()
        assert is_neuron_major(wd_nm) and torch.equal(wd_nm, wd)
        first = [wg] if gated else []
        (r0, rows), (r1, nm) = step(x, first + [wu, wd]), step(x, first + [wu, wd_nm])
        assert r0 == r1 and is_neuron_major(nm[-1]) and not is_neuron_major(rows[-1])
        exact = mode == "sparse" and r0 == 0
        assert exact or adversarial or mode == "dense", "the problem without adversarial rows has backup rows"
        for i, (a, b) in enumerate(zip(rows, nm)):
            assert torch.isfinite(b).all(), f"output {i}: non-finite values"
            if exact:
                assert torch.equal(a, b), f"output {i}: bits differ from the row-major W_d's"
            else:
                assert rel(b, a) <= 1e-2, f"output {i}: {rel(b, a):.3e} from the row-major W_d's"


def test_auto_dispatch_and_history():
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train as _train

    cfg = KernelConfig(train_sparse_min_m=0)

    def sparse_gated_ffn_train(*a, **kw):
        return _train(*a, config=cfg, **kw)

    x, wg, wu, wd = make_problem(2048, 1024, 2048, 0.003, 1)
    st = DispatchState()
    _, _, s1 = sparse_gated_ffn_train(x, wg, wu, wd, state=st)
    assert s1["path"] == "dense"       # first call: nothing measured yet
    a = F.relu(F.linear(x, wg))
    a[0, 5] = -0.0
    a[1, 6] = float("nan")
    from sfl.kernels.train_ffn import _count_rows
    assert torch.equal(s1["nnz_per_token"], (F.relu(F.linear(x, wg)) != 0).sum(1, dtype=torch.int32))
    assert torch.equal(_count_rows(a), (a != 0).sum(1, dtype=torch.int32))  # -0.0 inactive, NaN active
    torch.cuda.synchronize()
    _, _, s2 = sparse_gated_ffn_train(x, wg, wu, wd, state=st)
    assert s2["path"] == "sparse" and st.activity is not None and st.activity < 0.007
    xh, wgh, wuh, wdh = make_problem(2048, 1024, 2048, 0.1, 2)
    st2 = DispatchState()
    sparse_gated_ffn_train(xh, wgh, wuh, wdh, state=st2)
    torch.cuda.synchronize()
    _, _, s3 = sparse_gated_ffn_train(xh, wgh, wuh, wdh, state=st2)
    assert s3["path"] == "dense"


def test_nonfinite_rows_match_dense():
    from sfl.kernels.train_ffn import sparse_gated_ffn_train

    x, wg, wu, wd = make_problem(512, 512, 1024, 0.01, 4)
    x[20, 7] = float("nan")
    x[21, 8] = float("inf")
    gy = torch.randn(512, 512, device=DEV)
    xs = x.clone().requires_grad_(True)
    y, l1, st = sparse_gated_ffn_train(xs, wg, wu, wd, mode="sparse")
    (y.float() * gy).sum().backward()
    xd = x.clone().requires_grad_(True)
    yd, _ = dense_fn(xd, wg, wu, wd, "sum")
    (yd.float() * gy).sum().backward()
    assert torch.equal(torch.isfinite(y).all(1), torch.isfinite(yd).all(1))
    assert torch.equal(torch.isfinite(xs.grad).all(1), torch.isfinite(xd.grad).all(1))
    ok = torch.isfinite(yd).all(1)
    assert rel(y[ok], yd[ok]) < 1e-2


def test_saved_format_matches_reference():
    from sfl.kernels.train import ops

    x, wg, wu, wd = make_problem(3000, 1024, 2048, 0.01, 6)
    out = ops.ffn_fwd(x, wg, wu, wd, 128, 128, 1.0, 1 << 20, 64, False, "cuda")
    y, l1, ell_col, ell_a, ell_u, nnz, flag, brow, backup, host, last = out
    from sfl.kernels import reference as ref

    a = F.relu(F.linear(x, wg))
    hy_r = ref.d2h(a, 128)   # finite inputs: the backup rows are exactly the heavy rows
    assert torch.equal(nnz, hy_r.nnz)
    assert torch.equal(flag.bool(), hy_r.backup_mask())
    # the backup rows are not kept (the backward recomputes them); their count reaches the host without a sync
    assert brow.numel() == 0 and backup.shape == (0, 2048) and last.numel() == 0
    torch.cuda.synchronize()
    assert host.is_pinned() and int(host[0]) == hy_r.backup_rows.numel() > 0
    light = flag == 0
    valid = ops.saved_hybrid(ell_col, ell_a, nnz, hy_r.backup_rows, a[hy_r.backup_rows], a.shape[1]).valid_mask()
    assert torch.equal(torch.where(valid, ell_col, -1)[light], torch.where(valid, hy_r.ell_col, -1)[light])
    assert torch.equal(torch.where(valid, ell_a.float(), 0.0)[light],
                       torch.where(valid, hy_r.ell_val.float(), 0.0)[light])
    u = F.linear(x.float(), wu.float())
    ue = torch.gather(u, 1, ell_col.clamp(min=0).long())
    assert (ue - ell_u)[valid].abs().max().item() < 1e-3


def test_autocast_fp32_master_weights():
    from sfl.kernels.train_ffn import sparse_gated_ffn_train

    x, wg, wu, wd = make_problem(2048, 1024, 2048, 0.01, 8)
    ps = [t.float().clone().requires_grad_(True) for t in (wg, wu, wd)]
    pd = [t.float().clone().requires_grad_(True) for t in (wg, wu, wd)]
    xf = x.float()
    gy = torch.randn(2048, 1024, device=DEV)
    with torch.autocast("cuda", dtype=BF):
        y, l1, st = sparse_gated_ffn_train(xf, *ps, mode="sparse")
        yd, l1d = dense_fn(xf, *pd, "mean")
    ((y.float() * gy).sum() + 100 * l1).backward()
    ((yd.float() * gy).sum() + 100 * l1d).backward()
    assert st["path"] == "sparse"
    for a, b in zip(ps, pd):
        assert a.grad.dtype == torch.float32
        assert rel(a.grad, b.grad) < 2e-2


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("M,K,N,p", [(4096, 2048, 5632, 0.01), (1000, 576, 1536, 0.2), (7, 576, 1536, 0.05)])
def test_fused_dense_path_vs_fp32(M, K, N, p, gated):
    """mode='dense' runs the fused dense function (relu*mul+L1+stats forward, one elementwise backward pass):
    y, l1 and every gradient within 2x of bf16 PyTorch's error against fp32, adversarial rows included."""
    from sfl.kernels import train_ffn
    from sfl.kernels.config import KernelConfig

    x = torch.zeros(M, K, device=DEV, dtype=BF)
    assert train_ffn._fused_dense_ok(x, "cuda", KernelConfig(), N)   # the default KernelConfig
    st, _ = check_case(M, K, N, p, seed=M + 3, gated=gated, mode="dense", adversarial=M >= 12)
    assert st["path"] == "dense"


@pytest.mark.parametrize("gated", [True, False])
def test_fused_dense_equals_plain_dense(gated):
    """Fused and plain (KernelConfig(train_fused_dense=False)) dense paths: the same y bits (same GEMMs, same rounding of
    relu*mul), the same per-token counts, last-active rows and dispatch measurement; gradients agree to bf16."""
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train, sparse_nongated_ffn_train

    x, wg, wu, wd = make_problem(3000, 1024, 2048, 0.02, seed=21, gated=gated)
    gy = torch.randn(3000, 1024, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).to(BF)
    res = {}
    for fused in ("1", "0"):
        cfg = KernelConfig(train_fused_dense=fused == "1")
        ins = [t.clone().requires_grad_(True) for t in ((x, wg, wu, wd) if gated else (x, wu, wd))]
        state = DispatchState()
        fn = sparse_gated_ffn_train if gated else sparse_nongated_ffn_train
        y, l1, st = fn(*ins, mode="dense", state=state, want_last_active=True, config=cfg)
        torch.autograd.backward([y, l1], [gy, torch.tensor(3.0, device=DEV)])
        torch.cuda.synchronize()
        res[fused] = (y.detach(), l1.detach(), [t.grad for t in ins], st, state.activity, state.backup_frac)
    (y1, l1a, g1, s1, a1, b1), (y0, l1b, g0, s0, a0, b0) = res["1"], res["0"]
    fin = torch.isfinite(y0).all(1)
    assert torch.equal(y1[fin], y0[fin])
    assert torch.equal(torch.isfinite(y1), torch.isfinite(y0))
    assert abs(l1a.item() - l1b.item()) <= 1e-4 * abs(l1b.item())
    assert torch.equal(s1["nnz_per_token"], s0["nnz_per_token"])
    assert torch.equal(s1["last_active_row"], s0["last_active_row"])
    assert a1 is not None and a1 == pytest.approx(a0) and b1 == pytest.approx(b0)
    for a, b in zip(g1, g0):
        ok = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), ok)
        assert rel(a[ok], b[ok]) < 2e-2


# ---------------------------------------------------------------------------------------------------------------
# Non-finite values (kernels/FORMAT.md, "Non-finite values", CUDA table). Public API only, small shapes (K 128,
# N 512, M 64, ~1% active), one value injected into x or one weight entry; bf16 dense autograd is the reference.
_NONFINITE = {"+inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
_NF_NEURON, _NF_FEATURE = 6, 5   # the poisoned weight entry: neuron 6, feature 5 (features 0..2 steer activity)


def _nf_problem(gated: bool, where: str, value: float, seed: int):
    x, wg, wu, wd = make_problem(64, 128, 512, 0.01, seed, gated, adversarial=False)
    j, k = _NF_NEURON, _NF_FEATURE
    if where == "x":
        # feature k reaches one neuron positively: with x[1, k] = +Inf only neuron j is active in row 1, and
        # gated dense forms 0 * Inf = NaN at all the others (a path that skipped them would give +-Inf there)
        first = wg if gated else wu
        first[:, k] = -first[:, k].abs()
        first[j, k] = first[j, k].abs()
        x[1, k] = value
        x[63, k + 3] = value
    elif where == "w_gate":
        wg[j, k] = value
    elif where in ("w_up", "w_down"):
        (wg if gated else wu)[j, 0] = 0.0   # neuron j active in about half the rows: both cases occur
        if where == "w_up":
            wu[j, k] = value
        else:
            wd[k, j] = value
    return x, wg, wu, wd


def _assert_like_dense(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """NaN, +Inf and -Inf exactly where dense autograd has them, the finite rest close (bf16 vs bf16)."""
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        got, want = test(a), test(b)
        assert torch.equal(got, want), f"{what}: {test.__name__} at {int(got.sum())} entries, dense {int(want.sum())}"
    fin = torch.isfinite(b)
    if fin.any():
        assert rel(a[fin], b[fin]) < 3e-2, f"{what}: finite entries differ"


def _nf_run(gated: bool, ins, gy, mode: str):
    from sfl.kernels.train_ffn import sparse_gated_ffn_train, sparse_nongated_ffn_train

    def ours(*t):
        if gated:
            return sparse_gated_ffn_train(*t, l1_reduction="sum", mode=mode)
        return sparse_nongated_ffn_train(*t, l1_reduction="sum", mode=mode)

    def d(*t):
        return dense_fn(t[0], t[1] if gated else None, t[2] if gated else t[1], t[-1], "sum")

    poison()
    return grads(ours, ins, gy, 0.5), grads(d, ins, gy, 0.5)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("where", ["x", "w_gate", "w_up", "w_down"])
@pytest.mark.parametrize("value", list(_NONFINITE))
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_nonfinite_like_dense_autograd(gated, where, value, mode):
    """y, l1 and every gradient put NaN/+-Inf where bf16 dense autograd does: mode="dense" (the fused dense path)
    for every injection; mode="sparse" where the spec says the CUDA path is exact (a non-finite x, or a non-finite
    entry of the first weight: every such row goes through the dense backup, forward and backward)."""
    if where == "w_gate" and not gated:
        pytest.skip("the non-gated block has no w_gate")
    if mode == "sparse" and (where == "w_down" or (where == "w_up" and gated)):
        pytest.skip("spec: a non-finite w_up / w_down is not reproduced at inactive neurons on the sparse path "
                    "(test_nonfinite_sparse_poisoned_neuron_forward)")
    x, wg, wu, wd = _nf_problem(gated, where, _NONFINITE[value], seed=3)
    ins = [x, wg, wu, wd] if gated else [x, wu, wd]
    gy = torch.randn(64, 128, device=DEV, generator=torch.Generator(device=DEV).manual_seed(4))
    (y, l1, gs), (yd, l1d, gds) = _nf_run(gated, ins, gy, mode)
    _assert_like_dense(y, yd, "y")
    _assert_like_dense(l1, l1d, "l1")
    names = ["dx", "dw_gate", "dw_up", "dw_down"] if gated else ["dx", "dw_up", "dw_down"]
    for name, a, b in zip(names, gs, gds):
        _assert_like_dense(a, b, name)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("where", ["w_up", "w_down"])
@pytest.mark.parametrize("value", list(_NONFINITE))
def test_nonfinite_sparse_poisoned_neuron_forward(gated, where, value):
    """Spec (CUDA sparse path): a non-finite w_up row j (gated) or w_down column j is used only where neuron j is
    active. Rows where j is active match dense; rows where it is inactive are finite (dense: NaN, 0 * Inf)."""
    from sfl.kernels.train_ffn import sparse_gated_ffn_train, sparse_nongated_ffn_train

    if where == "w_up" and not gated:
        pytest.skip("non-gated: w_up is the first weight (every row goes through the dense backup)")
    x, wg, wu, wd = _nf_problem(gated, where, _NONFINITE[value], seed=5)
    poison()
    with torch.no_grad():
        if gated:
            y, _, _ = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse")
        else:
            y, _, _ = sparse_nongated_ffn_train(x, wu, wd, mode="sparse")
        yd, _ = dense_fn(x, wg if gated else None, wu, wd, "sum")
        active = F.relu(F.linear(x, wg if gated else wu))[:, _NF_NEURON] != 0
    assert active.any() and (~active).any()
    _assert_like_dense(y[active], yd[active], "rows where the poisoned neuron is active")
    assert torch.isfinite(y[~active]).all(), "rows where the poisoned neuron is inactive"


# ----------------------------------------------------------------------------------- glue kernels of the op
def compacted(ext, g, W):
    """The training op's ELL of gate pre-activations g [M, N] at width W: (ell_col, ell_a, nnz, flag)."""
    M, N = g.shape
    ell_col = torch.empty(M, W, device=DEV, dtype=torch.int32)
    ell_a = torch.empty(M, W, device=DEV, dtype=BF)
    nnz = torch.empty(M, device=DEV, dtype=torch.int32)
    flag = torch.empty(M, device=DEV, dtype=torch.int32)
    ext.compact(g, N, ell_col, ell_a, nnz, flag, None, 0)
    return ell_col, ell_a, nnz, flag


@pytest.mark.parametrize("K,N,W,gated", [(2048, 5632, 72, True), (2048, 5632, 128, False), (576, 1536, 64, True),
                                         (3072, 2048, 1536, True)])
def test_block_kernels_equal_warp_kernels(K, N, W, gated):
    """fwd_block / bwd_block (one block per light row) and, what the op runs, fwd_block's / bwd_block's coefficients
    + dx_slices against fwd_rows / bwd_rows (one warp per row): u, h, the L1 row sums and the backward coefficients
    bit for bit at every shape; dx_slices' y and dx bit for bit at every shape; the block kernels' y and dx bit for bit where one share
    covers K (K >= 2048), within 2x bf16 PyTorch's error of float64 elsewhere (K = 576: three shares). W = 1536 with
    a 1200-entry light row: two windows of entries. Flagged rows are left to the caller by all."""
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    M = 300
    x, wg, wu, wd = make_problem(M, K, N, min(0.02, 0.4 * W / N), seed=K + W, gated=gated)   # most rows light
    if W > 1024:
        wg[:1200, 1] = 30.0   # row 3 (feature 1 on): 1200 active, a light row longer than one window
    g = F.linear(x, wg if gated else wu)
    ell_col, ell_a, nnz, flag = compacted(ext, g, W)
    light = ~flag.bool()
    assert light.sum() > M // 2 and (~light).sum() >= 1
    if W > 1024:
        assert int(nnz[light].max()) > 1024
    valid = (torch.arange(W, device=DEV)[None, :] < nnz[:, None]) & light[:, None]
    wdt = wd.t().contiguous()
    gen = torch.Generator(device=DEV).manual_seed(7)
    dy = torch.randn(M, K, device=DEV, generator=gen).to(BF)
    l1c = torch.tensor([0.3], device=DEV)
    outs = {}
    for name in ("rows", "block"):
        poison()
        ell_u = torch.full((M, W), float("nan"), device=DEV)
        y = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
        rowabs = torch.full((M,), float("nan"), device=DEV)
        getattr(ext, "fwd_" + name)(gated, x, wu, wdt, ell_col, ell_a, nnz, flag, ell_u, y, rowabs)
        cg = torch.full((M, W), float("nan"), device=DEV)
        cu = torch.full((M, W), float("nan"), device=DEV)
        dx = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
        getattr(ext, "bwd_" + name)(gated, dy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu, dx)
        torch.cuda.synchronize()
        outs[name] = (ell_u, y, rowabs, cg, cu, dx)
    (u0, y0, r0, g0, c0, d0), (u1, y1, r1, g1, c1, d1) = outs["rows"], outs["block"]
    # the forward the op runs: fwd_block for u, h and the L1 row sums only, then dx_slices' non-gated form over W_dT
    # for y (entries ascending: fwd_rows' y bit for bit at every K); flagged rows stay the caller's
    us = torch.full((M, W), float("nan"), device=DEV)
    hs = torch.full((M, W), float("nan"), device=DEV)
    ys = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
    rs = torch.full((M,), float("nan"), device=DEV)
    ext.fwd_block(gated, x, wu, wdt, ell_col, ell_a, nnz, flag, us, ys[:0], rs, hs)
    assert bool(ys.isnan().all())
    ext.dx_slices(False, wdt, wdt, ell_col, nnz, flag, hs, hs, ys, 1)   # the op's block shape: one row per block
    torch.cuda.synchronize()
    for rows in (2, 4):   # slices' other block shapes: the same bits
        yo = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
        ext.dx_slices(False, wdt, wdt, ell_col, nnz, flag, hs, hs, yo, rows)
        torch.cuda.synchronize()
        assert torch.equal(yo[light], ys[light]) and bool(yo[~light].isnan().all()), f"y, {rows} rows per block"
    assert torch.equal(rs, r0)
    assert torch.equal(hs[valid], (ell_a.float() * (u0 if gated else 1.0))[valid])
    if gated:
        assert torch.equal(us[valid], u0[valid])
    assert torch.equal(ys[light], y0[light]) and bool(ys[~light].isnan().all())
    with pytest.raises(RuntimeError, match="needs h"):
        ext.fwd_block(gated, x, wu, wdt, ell_col, ell_a, nnz, flag, us, ys[:0], rs)
    # what the op runs: bwd_block for the coefficients only, then dx_slices (slice-major); its entry sums run in
    # bwd_rows' order, so dx has bwd_rows' bits at every K, and flagged rows stay the caller's (unwritten)
    cg = torch.full((M, W), float("nan"), device=DEV)
    cu = torch.full((M, W), float("nan"), device=DEV)
    dx = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
    ext.bwd_block(gated, dy, wg, wu, wdt, ell_col, ell_a, u1, nnz, flag, l1c, cg, cu, dx.new_empty(0, K))
    assert bool(dx.isnan().all())
    ext.dx_slices(gated, wg, wu, ell_col, nnz, flag, cg, cu, dx, 1)
    torch.cuda.synchronize()
    for rows in (2, 4):
        do = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
        ext.dx_slices(gated, wg, wu, ell_col, nnz, flag, cg, cu, do, rows)
        torch.cuda.synchronize()
        assert torch.equal(do[light], dx[light]) and bool(do[~light].isnan().all()), f"dx, {rows} rows per block"
    assert torch.equal(cg[valid], g0[valid]) and (not gated or torch.equal(cu[valid], c0[valid]))
    assert torch.equal(dx[light], d0[light]) and bool(dx[~light].isnan().all())
    assert torch.equal(r0, r1) and bool((r1[~light] == 0).all())
    assert torch.equal(g0[valid], g1[valid])
    if gated:
        assert torch.equal(u0[valid], u1[valid]) and torch.equal(c0[valid], c1[valid])
    for a, b in ((y0, y1), (d0, d1)):
        assert bool(torch.isfinite(b[light]).all()), "a light row was left unwritten"
        if K >= 2048:
            assert torch.equal(a[light], b[light])
        else:   # the shares' sums in another order: rounding-level differences only
            assert rel(b[light], a[light]) < 1e-2
    if K < 2048:   # y against float64 math on the light rows (h from the stored bf16 a, as the kernels use it)
        a64 = ell_a.double() * (u1.double() if gated else 1.0)
        h = torch.zeros(M, N, device=DEV, dtype=torch.float64)
        rows = torch.arange(M, device=DEV)[:, None].expand(M, W)
        h[rows[valid], ell_col[valid].long()] = a64[valid]
        ref = (h @ wd.double().t())[light]
        ref16 = (h.to(BF) @ wd.t()).double()[light]
        err, err16 = rel(y1[light], ref), rel(ref16, ref)
        assert err <= 2 * err16 + 1e-6, (err, err16)


@pytest.mark.parametrize("K,N,W,gated", [(2048, 5632, 72, True), (2048, 5632, 128, False), (576, 1536, 64, True),
                                         (200, 1024, 64, True), (3072, 2048, 256, False)])
def test_dwd_dh_and_coefficients(K, N, W, gated):
    """What the op's backward runs for the light entries' coefficients: dwd_dh (neuron-major over dy slices: dW_dT
    and the partial dot products dy_r . W_dT[j] per 256 columns) then dh_coef. dW_dT has dw part 1's bits at every
    slice width; the partial sums have the same bits at every width; cg / cu are within fp32 rounding of float64
    math (at most 2x bwd_block's error of it) and NaN exactly where bwd_block's are (a NaN in dy); entries that are
    not light (pads, flagged rows) stay unwritten. K = 200 and 576 end in a partial 256-column slice."""
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    M = 400
    x, wg, wu, wd = make_problem(M, K, N, min(0.02, 0.4 * W / N), seed=K + N, gated=gated)
    g = F.linear(x, wg if gated else wu)
    ell_col, ell_a, nnz, flag = compacted(ext, g, W)
    light = ~flag.bool()
    assert light.sum() > M // 2 and (~light).sum() >= 1
    valid = (torch.arange(W, device=DEV)[None, :] < nnz[:, None]) & light[:, None]
    wdt = wd.t().contiguous()
    gen = torch.Generator(device=DEV).manual_seed(11)
    dy = torch.randn(M, K, device=DEV, generator=gen).to(BF)
    nan_row = int(torch.nonzero(light & (nnz > 0))[5])
    dy[nan_row, K // 3] = float("nan")
    ell_u = torch.randn(M, W, device=DEV, generator=gen) if gated else torch.empty(0, 0, device=DEV)
    l1c = torch.tensor([0.3], device=DEV)
    perm, colptr = ext.csr_by_neuron(ell_col, nnz, flag, N)
    nsub = (K // 8 + 31) // 32
    n = int(colptr[-1])
    parts, dwdts = {}, {}
    for nb in (1, 2, 4, 8):
        poison()
        part = torch.full((nsub, M * W), float("nan"), device=DEV)
        dwdt = torch.full((N, K), float("nan"), device=DEV, dtype=BF)
        ext.dwd_dh(nb, dy, wdt, perm, colptr, ell_a, ell_u, None, dwdt, part)
        ref = torch.full((N, K), float("nan"), device=DEV, dtype=BF)
        none = torch.empty(0, 0, device=DEV)
        ext.dw(gated, nb, x, dy, perm, colptr, ell_a, ell_u, none, none, None, None, None, ref, ref, ref, 1, 1)
        torch.cuda.synchronize()
        assert torch.equal(dwdt.view(torch.int16), ref.view(torch.int16)), f"dW_dT, nb {nb}"
        assert bool(part[:, n:].isnan().all()), "partial sums written past the light entries"
        parts[nb], dwdts[nb] = part[:, :n], dwdt
    for nb in (2, 4, 8):
        assert torch.equal(parts[nb].view(torch.int32), parts[1].view(torch.int32)), f"partial sums, nb {nb}"
    # what the op allocates: one column per light entry (the forward's summary bounds them), here exactly n
    part = torch.full((nsub, n), float("nan"), device=DEV)
    ext.dwd_dh(2, dy, wdt, perm, colptr, ell_a, ell_u, None, torch.empty_like(dwdts[1]), part)
    cg = torch.full((M, W), float("nan"), device=DEV)
    cu = torch.full((M, W), float("nan"), device=DEV) if gated else torch.empty(0, 0, device=DEV)
    ext.dh_coef(gated, part, K, perm, colptr, ell_a, ell_u, l1c, cg, cu)
    torch.cuda.synchronize()
    assert torch.equal(part.view(torch.int32), parts[1].view(torch.int32)), "partial sums, n columns"
    bg = torch.full((M, W), float("nan"), device=DEV)
    bu = torch.full((M, W), float("nan"), device=DEV)
    ext.bwd_block(gated, dy, wg, wu, wdt, ell_col, ell_a, ell_u if gated else bu, nnz, flag, l1c, bg,
                  bu, dy.new_empty(0, K))
    torch.cuda.synchronize()
    assert bool(cg[~valid].isnan().all()) and (not gated or bool(cu[~valid].isnan().all())), "non-light entry written"
    # float64 math of the same coefficients
    rows = torch.arange(M, device=DEV)[:, None].expand(M, W)[valid]
    j = ell_col[valid].long()
    dh = (dy.double()[rows] * wdt.double()[j]).sum(1)
    a = ell_a.float()[valid].double()
    outs = [(cg, bg)] + ([(cu, bu)] if gated else [])
    if gated:
        u = ell_u[valid].double()
        d = dh + 0.3 * torch.sign(a * u)
        want = [d * u, d * a]
    else:
        want = [dh + 0.3 * torch.sign(a)]
    for (ours, theirs), w64 in zip(outs, want):
        o, t = ours[valid], theirs[valid]
        assert torch.equal(o.isnan(), t.isnan()) and bool(o.isnan().any()), "NaN from dy"
        fin = ~t.isnan()
        assert rel(o[fin], w64[fin]) <= 2 * rel(t[fin], w64[fin]) + 1e-7


@pytest.mark.parametrize("R,C,pad", [(8, 8, 0), (72, 136, 0), (2048, 5632, 0), (136, 64, 24), (1000, 8, 8)])
def test_transpose_kernel_bit_exact(R, C, pad):
    from sfl.kernels.train import ops

    g = torch.Generator(device=DEV).manual_seed(R + C)
    base = torch.randn(R, C + pad, device=DEV, generator=g).to(BF)
    base[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    src = base[:, :C]  # row stride C + pad: a view, as a sliced weight would be
    poison()
    out = ops.load_ext().transpose(src)
    assert out.shape == (C, R) and out.is_contiguous()
    assert torch.equal(out.view(torch.int16), src.t().contiguous().view(torch.int16))


@pytest.mark.parametrize("M,N,W,p,seed", [(1, 256, 8, 0.02, 0), (63, 512, 8, 0.01, 1), (3000, 2048, 128, 0.01, 2),
                                          (20000, 1024, 32, 0.01, 3), (4096, 5632, 128, 0.005, 4)])
def test_csr_by_neuron_kernel_equals_reference(M, N, W, p, seed):
    """The counting sort gives the reference's colptr and perm (neuron, then row ascending) on ELL states with
    backup rows (heavy, full, non-finite), empty rows, odd M and M beyond 64 rows per block."""
    from sfl.kernels import reference as ref
    from sfl.kernels.train import ops

    x, wg, wu, wd = make_problem(M, 256, N, p, seed)
    if M >= 12:
        x[5, 7] = float("nan")
    out = ops.ffn_fwd(x, wg, wu, wd, W, W, 1.0, 1 << 20, M, False, "cuda")
    y, l1, ell_col, ell_a, ell_u, nnz, flag = out[:7]
    brow = flag.nonzero().squeeze(1)
    hy = ops.saved_hybrid(ell_col, ell_a, nnz, brow, F.relu(F.linear(x[brow], wg)), N)
    perm_r, colptr_r = ref.csr_by_neuron(hy)
    poison()
    perm, colptr = ops.load_ext().csr_by_neuron(ell_col, nnz, flag, N)
    assert torch.equal(colptr, colptr_r)
    n = int(colptr_r[-1])
    assert n == int(hy.valid_mask().sum())
    assert torch.equal(perm[:n], perm_r[:n])


def test_csr_by_neuron_falls_back_beyond_shared_memory():
    """Where the counting sort's shared memory does not fit (N 40000), the kernel refuses with a message and the
    op's backward takes the reference's sort instead: y, L1 and every gradient within the error budget."""
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    assert ext.csr_supported(5632, 128) and not ext.csr_supported(40000, 128)
    x, wg, wu, wd = make_problem(100, 64, 40000, 0.001, 5)
    out = ops.ffn_fwd(x, wg, wu, wd, 128, 128, 1.0, 1 << 20, 100, False, "cuda")
    with pytest.raises(RuntimeError, match="shared memory"):
        ext.csr_by_neuron(out[2], out[5], out[6], 40000)
    st, _ = check_case(100, 64, 40000, 0.001, seed=5, width=128)
    assert st["path"] == "sparse"


@pytest.mark.parametrize("chunk", [1 << 20, 700])
def test_compact_summary_counts_flagged_and_widest_light_row(chunk):
    """The compaction's device summary (backup rows; against the configured width: widest light row, light
    non-zeros, other rows) accumulates over gate chunks and equals the torch backend's."""
    from sfl.kernels.train import ops

    x, wg, wu, wd = make_problem(3000, 512, 2048, 0.01, 7, heavy_frac=0.01)
    x[11, 5] = float("inf")
    poison()
    M, N = x.shape[0], wg.shape[0]
    ell_col = torch.empty(M, 64, device=DEV, dtype=torch.int32)
    ell_a = torch.empty(M, 64, device=DEV, dtype=BF)
    nnz = torch.empty(M, device=DEV, dtype=torch.int32)
    flag = torch.empty(M, device=DEV, dtype=torch.int32)
    summary = torch.zeros(4, device=DEV, dtype=torch.int64)
    for c0 in range(0, M, chunk):   # the forward's chunks (binding.cpp, ffn_fwd_gate)
        c1 = min(M, c0 + chunk)
        ops.load_ext().compact(torch.mm(x[c0:c1], wg.t()), N, ell_col[c0:c1], ell_a[c0:c1], nnz[c0:c1],
                               flag[c0:c1], summary, 96)
    g = torch.cat([torch.mm(x[c0:c0 + chunk], wg.t()) for c0 in range(0, x.shape[0], chunk)])  # the same GEMMs
    n_ref = (F.relu(g) != 0).sum(1, dtype=torch.int32)
    flag_ref = (n_ref > 64) | ~torch.isfinite(g).all(1)
    assert torch.equal(nnz[~flag_ref], n_ref[~flag_ref]) and torch.equal(flag.bool(), flag_ref)
    light96 = (n_ref <= 96) & torch.isfinite(g).all(1)   # the measurement counts against measure_width 96
    assert summary.tolist() == [int(flag_ref.sum()), int(n_ref[light96].max()), int(n_ref[light96].sum()),
                                int((~light96).sum())]
    assert summary.tolist() == ops.host_summary(nnz, flag, 64, 96).tolist()   # the torch backend's summary


@pytest.mark.parametrize("rows,N,pad", [(1, 8, 0), (5, 264, 8), (127, 512, 0), (129, 5632, 0), (20000, 1024, 16)])
def test_last_active_kernel_equals_torch_mask(rows, N, pad):
    """Per column the last relu-active row (> 0 or NaN; -0.0, +0 and negatives are not), -1 for a column that never
    fires, across row chunks and partial column groups, on a strided view."""
    from sfl.kernels.train import ops
    from sfl.kernels.train_ffn import _last_active_dense

    g = torch.Generator(device=DEV).manual_seed(rows + N)
    base = torch.randn(rows, N + pad, device=DEV, generator=g)
    base = torch.where(torch.rand(rows, N + pad, device=DEV, generator=g) < 0.97, -base.abs(), base)  # sparse
    base = base.to(BF)
    a = base[:, :N]
    a[:, 0] = -1.0                         # never fires
    a[:, 1] = -0.0                         # negative zero: not active
    if N > 3:
        a[:, 2] = -1.0
        a[0, 2] = 0.5                      # fires in row 0 only: the scan must cross every chunk
    if N > 5:
        a[:, 4] = -1.0
        a[rows // 2, 4] = float("nan")     # NaN counts as active
        a[:, 5] = -1.0
        a[rows - 1, 5] = -float("nan")     # a NaN with the sign bit set too
    poison()
    last = ops.load_ext().last_active(a)
    assert torch.equal(last, _last_active_dense((a > 0) | torch.isnan(a)))
    assert last[0] == -1 and last[1] == -1


def test_last_active_sparse_path_equals_dense_path():
    """The sparse path's dead-neuron tracker (computed inside the op, no host sync) gives the dense path's rows,
    backup rows (heavy, full, non-finite) included."""
    from sfl.kernels.train_ffn import sparse_gated_ffn_train

    x, wg, wu, wd = make_problem(3000, 256, 1024, 0.01, 8, heavy_frac=0.01)
    x[7, 5] = float("nan")
    _, _, sd = sparse_gated_ffn_train(x, wg, wu, wd, mode="dense", want_last_active=True)
    _, _, ss = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", width=32, want_last_active=True)
    assert ss["path"] == "sparse" and ss["backup_rows"] > 0
    assert torch.equal(sd["last_active_row"], ss["last_active_row"])


@pytest.mark.parametrize("M,N,p,width", [(1, 256, 0.05, 8), (5000, 5632, 0.005, 64), (2049, 1024, 0.2, 16)])
@pytest.mark.parametrize("cap", [0, 3, None])
def test_tracker_of_the_op_equals_the_dense_mask(M, N, p, width, cap):
    """The op's dead-neuron tracker (want_last: the ELL kernel, the backup block's rows, the overflow kernel's rows)
    equals the dense mask's, whatever share of the backup rows goes past the block (cap 0: all of them)."""
    from sfl.kernels.train import ops
    from sfl.kernels.train_ffn import _last_active_dense

    x, wg, wu, wd = make_problem(M, 256, N, p, 11, heavy_frac=0.02)
    if M > 2:
        x[M // 2, 7] = float("nan")  # a non-finite row: a backup row, not in the ELL
    out = ops.ffn_fwd(x, wg, wu, wd, width, width, 1.0, 1 << 20, M if cap is None else cap, True, "cuda")
    g = F.linear(x, wg)
    assert torch.equal(out[10], _last_active_dense((g > 0) | torch.isnan(g)))


@pytest.mark.parametrize("cap", [0, 7, None])
@pytest.mark.parametrize("gated", [True, False])
def test_backup_rows_past_the_capacity_are_exact(cap, gated):
    """The backup rows beyond the dense block's capacity (a CUDA-core kernel) give y, L1 and every gradient within
    the error budget, heavy, full, non-finite rows included, with the capacity from the history or forced."""
    from sfl.kernels.config import KernelConfig

    cfg = KernelConfig(backup_rows=-1 if cap is None else cap)
    s1, _ = check_case(1500, 1024, 2048, 0.01, seed=17, gated=gated, heavy_frac=0.03, config=cfg)
    assert int(s1["backup_rows"]) > 7


@pytest.mark.parametrize("gated", [True, False])
def test_captured_training_step_replays_exactly(gated):
    """A training step (forward, L1 term, backward) captured in one CUDA graph replays to the bits of the eager step
    with the same decisions (width 64, a 16-row backup block), on fresh inputs: light rows, heavy rows past the
    block (the CUDA-core backward, its count only on the device) and a non-finite row; and within the error budget
    of dense bf16 against fp32. Nothing is read on the host while capturing (no event query, no pinned copy)."""
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train, sparse_nongated_ffn_train

    M, K, N = 2048, 1024, 2048
    x0, wg, wu, wd = make_problem(M, K, N, 0.01, seed=31, gated=gated, heavy_frac=0.002)
    static_x = x0.clone().requires_grad_(True)
    leaves = [static_x] + [t.clone().requires_grad_(True) for t in ((wg, wu, wd) if gated else (wu, wd))]
    gy = torch.randn(M, K, device=DEV, generator=torch.Generator(device=DEV).manual_seed(32))
    st = DispatchState()
    cfg = KernelConfig(train_width=64, train_shrink=False, backup_rows=16)
    fn = sparse_gated_ffn_train if gated else sparse_nongated_ffn_train

    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        y, l1, stats = fn(*leaves, l1_reduction="sum", mode="sparse", state=st, config=cfg)
        assert stats["path"] == "sparse"
        ((y.float() * gy).sum() + 0.5 * l1).backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        static_y = step()
    captured = [static_y] + [t.grad for t in leaves]
    many_heavy = x0.clone()
    many_heavy[100:400, 3:] *= 4.0   # ~300 heavy rows: most past the 16-row block
    nonfinite = x0.clone()
    nonfinite[7, 5] = float("nan")
    names = ["y", "dx"] + [f"dw{i}" for i in range(len(leaves) - 1)]
    for x_new in (make_problem(M, K, N, 0.01, seed=33, gated=gated)[0], many_heavy, nonfinite):
        with torch.no_grad():
            static_x.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        got = [t.detach().clone() for t in captured]
        want = [step().detach()] + [t.grad for t in leaves]
        for name, a, b in zip(names, got, want):
            assert torch.equal(a.isnan(), b.isnan()), name
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), f"{name}: replay differs from eager"
    # the heavy case against fp32 dense: the CUDA-core backward within the error budget
    with torch.no_grad():
        static_x.copy_(many_heavy)
    graph.replay()
    ins = [many_heavy] + [t.detach() for t in leaves[1:]]

    def d(*t):
        return dense_fn(t[0], t[1] if gated else None, t[-2], t[-1], "sum")

    ref, bf = grads(d, [t.float() for t in ins], gy, 0.5), grads(d, ins, gy, 0.5)
    for name, o, r, b in zip(names[1:], captured[1:], ref[2], bf[2]):
        assert rel(o, r) <= 2 * rel(b, r) + 1e-6, f"{name}: {rel(o, r):.3e} vs bf16 {rel(b, r):.3e}"


# ----------------------------------------------------------------------------------------------- dispatch on the plan
def _measured(st, cfg, nnz, n_cols, width=8, gated=True):
    """st after one decision (which makes its plan) and one landed measurement from per-row counts nnz."""
    st.decide(cfg, gated, "auto", 1000, 128)
    st.record(torch.tensor(nnz, dtype=torch.int32, device=DEV), n_cols, width)
    torch.cuda.synchronize()
    return st


def test_dispatch_rules_on_the_plan():
    """The training dispatch is the C++ plan's (runtime.cpp: train_decide): dense before any measurement and below
    train_sparse_min_m; activity of the light rows against train_dense_above (train_dense_above_large from
    train_large_m rows), heavy-row fraction against train_backup_dense_above; the backup block from the flagged
    fraction (M / 16 before any measurement, none after a measurement with none); the ELL width from the widest
    light row (shrink)."""
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.train_ffn import DispatchState

    kn = KernelConfig(train_dense_above=0.01, train_dense_above_large=0.01, train_large_m=10 ** 9,
                      train_backup_dense_above=0.1, train_width=8, train_sparse_min_m=100)
    st = DispatchState()
    assert st.decide(kn, True, "auto", 1000, 128) == (False, 128, 64)  # nothing measured: dense, width, M / 16
    _measured(st, kn, [1, 2, 0, 3], 100)
    assert st.decide(kn, True, "auto", 1000, 128)[0] is False and st.activity == 6 / 400  # 1.5% active > 1%
    st2 = _measured(DispatchState(), kn, [1, 2, 0, 1], 1000)
    assert st2.decide(kn, True, "auto", 1000, 128) == (True, 8, 0)   # widest light row 2 -> width 8; no heavy row
    assert st2.activity == 4 / 4000 and st2.backup_frac == 0.0 and st2.widest_light == 2
    assert st2.decide(kn, True, "auto", 10, 128)[0] is False  # below sparse_min_m
    assert st2.decide(kn, True, "sparse", 10, 128)[0] is True and st2.decide(kn, True, "dense", 1000, 128)[0] is False
    st3 = _measured(DispatchState(), kn, [50, 2, 0, 40], 1000, width=48)  # 1 of 4 rows heavy
    sparse, width, cap = st3.decide(kn, True, "auto", 1000, 128)
    assert not sparse and st3.backup_frac == 0.25 and st3.activity == 42 / 3000  # activity of the light rows
    assert width == 56 and cap == 352   # 40 * 5 // 4 + 1 -> 56; 1.25 * 0.25 * 1000 + 32 -> 344 -> 352
    assert st3.decide(kn.replace(train_shrink=False), True, "auto", 1000, 128)[1] == 128  # a new config: new plan
    # from large_m rows the activity limit is dense_above_large: 1.5% runs sparse there, dense below
    kn_large = kn.replace(train_dense_above_large=0.02, train_large_m=5000)
    st4 = _measured(DispatchState(), kn_large, [1, 2, 0, 3], 100)
    assert st4.decide(kn_large, True, "auto", 4999, 128)[0] is False
    assert st4.decide(kn_large, True, "auto", 5000, 128)[0] is True


def test_recompute_in_backward_reuses_forward_path():
    """An activation-checkpoint recompute runs inside backward: it takes the path of the layer's last forward (else
    the recomputed saved tensors differ from what the checkpoint recorded), whatever the history says now."""
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.train_ffn import DispatchState

    kn = KernelConfig(train_dense_above=0.01, train_backup_dense_above=0.1, train_sparse_min_m=100)
    st = _measured(DispatchState(), kn, [1, 2, 0, 1], 1000)
    assert st.decide(kn, True, "auto", 1000, 128)[0] is True   # the forward: sparse
    seen = {}
    t = torch.ones(3, device=DEV, requires_grad=True)
    h = t * 2

    def hook(g):
        seen["sparse"] = st.decide(kn, True, "auto", 10, 128)[0]   # below sparse_min_m, but a recompute

    h.register_hook(hook)
    h.sum().backward()
    assert seen["sparse"] is True
    assert st.decide(kn, True, "auto", 10, 128)[0] is False   # a forward again: below sparse_min_m


def test_shrink_takes_the_widest_light_row_of_earlier_calls():
    """The ELL width of a sparse call comes from the layer's history (no host sync): the configured width until a
    measurement, then the widest light row plus a quarter, rounded up to 8; exact at any width."""
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

    x, wg, wu, wd = make_problem(1024, 1024, 2048, 0.01, seed=41)
    st = DispatchState()
    _, _, s1 = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", state=st)
    torch.cuda.synchronize()
    nnz = s1["nnz_per_token"]
    widest = int(nnz[nnz <= 128].max())
    y2, _, s2 = sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", state=st)
    assert s1["width"] == 128 and st.widest_light == widest
    assert s2["width"] % 8 == 0 and widest < s2["width"] <= 128 and s2["width"] >= widest * 5 // 4
    y32 = dense_fn(*(t.float() for t in (x, wg, wu, wd)), "mean")[0]
    ybf = dense_fn(x, wg, wu, wd, "mean")[0]
    assert rel(y2, y32) <= 2 * rel(ybf, y32) + 1e-6
