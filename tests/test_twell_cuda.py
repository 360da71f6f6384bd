"""GPU tests of the TwELL CUDA kernels against dense fp32 (skipped without CUDA).

Error budget: ||ours - fp32|| / ||fp32|| <= 2 x the same error of bf16 PyTorch (three F.linear) on the same
inputs. Outputs are poisoned (the caching allocator's free memory is filled with NaN) before every call so an
unwritten output element shows up as NaN. Inputs are fresh random draws with adversarial rows.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sfl.kernels.timing import capture_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
BF = torch.bfloat16


def poison() -> None:
    """Fill free allocator blocks with NaN so torch.empty inside the op returns NaN-filled memory."""
    free = torch.cuda.mem_get_info()[0]
    n = min(int(free * 0.3), 3 << 30) // 4
    t = torch.empty(n, device=DEV, dtype=torch.float32)
    t.fill_(float("nan"))
    del t
    small = [torch.full((1 << s,), float("nan"), device=DEV) for s in range(10, 24)]
    del small


def make_problem(M: int, K: int, N: int, p: float, seed: int, gated: bool = True, adversarial: bool = True):
    """x [M, K], weights with a per-neuron gate shift giving activity ~p; adversarial rows when asked.

    Feature 0 is a constant 1 carrying the shift; feature 1 switches 'whole tile 3 active'; feature 2 switches
    'every neuron active'.
    """
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
    first[3 * 256: 4 * 256, 1] = 30.0
    first[:, 2] = 30.0
    if adversarial and M >= 12:
        x[1] = 0                       # all-zero row: no active neuron, y = 0
        x[2, 3:] *= 6                  # heavy row (~25% active)
        x[3, 1] = 1                    # a whole tile active
        x[4, 2] = 1                    # every neuron active
        x[5, 7] = float("nan")         # NaN propagates
        x[6, 8] = float("inf")         # Inf propagates
        x[7, 9] = float("-inf")
        x[8:10, 3:] *= 4               # more heavy rows
    w = [t.to(BF).contiguous() for t in (wg, wu, wd)]
    return x.to(BF).contiguous(), w[0], w[1], w[2]


def dense(x, wg, wu, wd, gated: bool):
    if gated:
        return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)
    return F.linear(F.relu(F.linear(x, wu)), wd)


def check(y: torch.Tensor, x, wg, wu, wd, gated: bool, nan_fill_ok: bool = True) -> tuple[float, float]:
    ref32 = dense(x.double(), wg.double() if gated else None, wu.double(), wd.double(), gated)
    ref16 = dense(x, wg, wu, wd, gated)
    assert y.shape == ref16.shape and y.dtype == BF
    fin16 = torch.isfinite(ref16)
    assert torch.equal(torch.isfinite(y), fin16), "non-finite pattern differs from dense bf16 PyTorch"
    rows = fin16.all(1) & torch.isfinite(ref32).all(1)
    a, r, b = y[rows].double(), ref32[rows], ref16[rows].double()
    nrm = r.norm().clamp_min(1e-30)
    err, err16 = ((a - r).norm() / nrm).item(), ((b - r).norm() / nrm).item()
    assert err <= 2 * err16 + 1e-7, f"error {err:.3e} > 2 x bf16 PyTorch {err16:.3e}"
    return err, err16


@pytest.fixture(scope="module")
def ffn():
    import sfl.kernels.ffn as ffn

    return ffn


def new_plan(gated: bool = True, **cfg):
    """A fresh layer plan with these KernelConfig fields (its dispatch history starts empty)."""
    from sfl.kernels.config import KernelConfig
    from sfl.kernels.twell.ops import Plan

    return Plan(KernelConfig(**cfg))


def run(ffn, x, wg, wu, wd, gated: bool = True, plan=None, stats=None, **cfg):
    """One call of the gated (or non-gated) op with a KernelConfig built from cfg (or through `plan`)."""
    from sfl.kernels.config import KernelConfig

    kw = dict(plan=plan, stats=stats) if plan is not None else dict(config=KernelConfig(**cfg), stats=stats)
    return ffn.sparse_gated_ffn(x, wg, wu, wd, **kw) if gated else ffn.sparse_nongated_ffn(x, wu, wd, **kw)


def captured(fn):
    """(graph, output) of fn() captured by kernels.timing.capture_graph after two eager calls, each synchronised, so
    the plan's history holds their measurements."""
    for _ in range(2):
        fn()
        torch.cuda.synchronize()
    return capture_graph(fn)


def check_stats(stats: torch.Tensor, h: torch.Tensor) -> None:
    """The op's accumulated statistics equal the dense count: (sum of non-zeros, largest per-token count, tokens)."""
    n = (h != 0).sum(1)
    assert stats.tolist() == [int(n.sum()), int(n.max()), h.shape[0]]


SHAPES = [(576, 1536, True), (2048, 5632, True), (2048, 8192, False), (4096, 11008, True)]


@pytest.mark.parametrize("K,N,gated", SHAPES)
@pytest.mark.parametrize("M", [1, 7, 64, 1000])
def test_ffn_vs_fp32(ffn, K, N, gated, M):
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=M * 7 + K + N, gated=gated)
    poison()
    # mode="sparse": exercise the kernels at every M (auto may pick dense for 16 < M <= 64)
    for up_list_min_m in ((0, 1) if M > 64 else (0,)):   # above decode sizes: up_down, and up_list + slices
        stats = torch.zeros(3, device=DEV, dtype=torch.int64)
        y = run(ffn, x, wg, wu, wd, gated, stats=stats, mode="sparse", up_list_min_m=up_list_min_m)
        torch.cuda.synchronize()
        check(y, x, wg, wu, wd, gated)
        check_stats(stats, F.relu(F.linear(x, wg if gated else wu)))


@pytest.mark.parametrize("mode", ["sparse", "dense", "auto"])
@pytest.mark.parametrize("p", [0.005, 0.1])
def test_modes_and_many_heavy_rows(ffn, mode, p):
    """Many overflowing rows (every 3rd row heavy) are all exact, in every mode, across chunk boundaries."""
    K, N, M = 2048, 5632, 2500
    x, wg, wu, wd = make_problem(M, K, N, p, seed=11)
    x[::3, 3:] *= 5
    for d2t, up_list_min_m in (("fused", 0), ("fused", 1), ("cublas", 4096)):   # cublas: 1 MB scratch, 256-row chunks
        poison()
        y = run(ffn, x, wg, wu, wd, mode=mode, d2t=d2t, gate_scratch_mb=1, up_list_min_m=up_list_min_m)
        torch.cuda.synchronize()
        check(y, x, wg, wu, wd, True)


@pytest.mark.parametrize("scratch_mb", [1, 1024])   # 1 MB: chunks of 256 rows; 1024: one GEMM over all rows
def test_d2t_matches_reference(ffn, scratch_mb):
    """Every cuBLAS d2t variant (full-M GEMM, chunked) equals reference.d2t bit for bit on the valid slots."""
    from sfl.kernels import reference
    from sfl.kernels.config import KernelConfig

    K, N, M = 2048, 5632, 300
    x, wg, _, _ = make_problem(M, K, N, 0.01, seed=3)
    poison()
    packed, counts, flag = ffn.twell_d2t(x, wg, 32, config=KernelConfig(d2t="cublas", gate_scratch_mb=scratch_mb))
    step = 256 if scratch_mb == 1 else M   # the same GEMM calls as the op, so the same cuBLAS rounding
    h = F.relu(torch.cat([torch.mm(x[i:i + step], wg.t()) for i in range(0, M, step)]))
    ref = reference.d2t(h, 256, 32)
    assert torch.equal(counts, ref.counts)
    nonfinite = (~torch.isfinite(torch.mm(x, wg.t()))).any(1)
    assert torch.equal(flag.bool(), ref.overflow_mask() | nonfinite)
    valid = ref.valid_mask()
    assert torch.equal(packed[valid], ref.packed[valid])


@pytest.mark.parametrize("M", [16, 300])
def test_cuda_graph_capture(ffn, M):
    """Under capture (M 16: lossless decode slots; M 300: the flagged rows' dense backup) replays with new inputs stay
    exact, a heavy row included."""
    K, N = 2048, 5632
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=5, adversarial=False)
    static_x = x.clone()
    ffn.sparse_gated_ffn(static_x, wg, wu, wd, mode="sparse")  # warm-up: build, caches
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ffn.sparse_gated_ffn(static_x, wg, wu, wd, mode="sparse")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = ffn.sparse_gated_ffn(static_x, wg, wu, wd, mode="sparse")
    for seed in (21, 22):
        x2, _, _, _ = make_problem(M, K, N, 0.01, seed=seed, adversarial=False)
        x2[0, 3:] *= 6  # a heavy row
        static_x.copy_(x2)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(static_y, x2, wg, wu, wd, True)


@pytest.mark.parametrize("K,N,gated", [(2048, 5632, True), (2048, 8192, False), (4096, 11008, True)])
@pytest.mark.parametrize("backup_rows", [0, 7, -1])
@pytest.mark.parametrize("up_list_min_m", [0, 1])
def test_backup_rows_past_the_block_are_exact(ffn, K, N, gated, backup_rows, up_list_min_m):
    """Above decode_max_m every flagged row (heavy, whole tile, every neuron, NaN / +-Inf in x) is exact however many
    there are: the first backup_rows by the dense block, the rest on CUDA cores (0: all of them; -1: the layer's
    measured flagged rows x 1.25 + 32, in multiples of 32). K 4096 holds x in shared memory (16 chunks a lane).
    Light rows through up_down (up_list_min_m 0) and through up_list + slices (1)."""
    M = 600
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=K + N + backup_rows, gated=gated)
    x[20::7, 3:] *= 6   # 83 more heavy rows
    plan = new_plan(gated, mode="sparse", backup_rows=backup_rows, up_list_min_m=up_list_min_m)
    for _ in range(3):   # no measurement, then the first call's, then the second's
        poison()
        y = run(ffn, x, wg, wu, wd, gated, plan=plan)
        torch.cuda.synchronize()
        check(y, x, wg, wu, wd, gated)
    info = plan.info()
    flagged = info["flagged_rows"]
    assert info["path"] == "sparse" and flagged is not None and flagged > 80
    rule = min(M, -(-(int(1.25 * (flagged / M) * M) + 32) // 32) * 32)
    assert info["backup_cap"] == (backup_rows if backup_rows >= 0 else rule)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("backup_rows", [0, 5])
def test_backup_rows_small_shapes(ffn, gated, backup_rows):
    """Small shapes where nearly every row is flagged (S = 1 slot), NaN / +-Inf rows among them: the dense block and
    the CUDA-core rows, exact (also the compute-sanitizer case: small enough for racecheck)."""
    M, K, N = 70, 256, 512
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=61 + backup_rows, gated=gated)
    for up_list_min_m in (0, 1):
        poison()
        y = run(ffn, x, wg, wu, wd, gated, mode="sparse", slots=1, backup_rows=backup_rows, up_list_min_m=up_list_min_m)
        torch.cuda.synchronize()
        check(y, x, wg, wu, wd, gated)


def test_sparse_call_above_decode_sizes_never_waits(ffn):
    """A sparse call above decode_max_m with flagged rows returns while the GPU is still busy with earlier work: the
    flagged rows' count and list stay on the device, the measurement comes back without a wait."""
    K, N, M = 2048, 5632, 600
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=41)
    plan = new_plan(mode="sparse")
    for _ in range(2):
        run(ffn, x, wg, wu, wd, plan=plan)
        torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)   # about a second of GPU time queued before the call
    busy.record()
    y = run(ffn, x, wg, wu, wd, plan=plan)
    returned_early = not busy.query()
    torch.cuda.synchronize()
    assert plan.info()["path"] == "sparse" and plan.info()["flagged_rows"] > 0
    assert returned_early, "the call waited for the GPU"
    check(y, x, wg, wu, wd, True)


@pytest.mark.parametrize("backup_rows", [0, 16])
@pytest.mark.parametrize("up_list_min_m", [0, 1])
def test_graph_capture_with_flagged_rows(ffn, backup_rows, up_list_min_m):
    """Above decode_max_m a captured call has the eager call's exact backup: replays with more flagged rows than the
    captured block (heavy, whole tile, every neuron, NaN / +-Inf rows) are exact."""
    K, N, M = 2048, 5632, 300
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=51, adversarial=False)
    plan = new_plan(mode="sparse", backup_rows=backup_rows, up_list_min_m=up_list_min_m)
    static_x = x.clone()
    graph, static_y = captured(lambda: run(ffn, static_x, wg, wu, wd, plan=plan))
    assert plan.info()["path"] == "sparse" and plan.info()["backup_cap"] == backup_rows
    for seed in (52, 53):
        x2, _, _, _ = make_problem(M, K, N, 0.01, seed=seed)   # the adversarial rows
        x2[20::9, 3:] *= 6
        static_x.copy_(x2)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(static_y, x2, wg, wu, wd, True)


def test_module_from_linears(ffn):
    K, N = 576, 1536
    lin = [torch.nn.Linear(K, N, bias=False), torch.nn.Linear(K, N, bias=False), torch.nn.Linear(N, K, bias=False)]
    x, wg, wu, wd = make_problem(513, K, N, 0.02, seed=9, adversarial=False)
    for layer, w in zip(lin, (wg, wu, wd)):
        layer.weight.data = w.clone()
    m = ffn.TwELLGatedMLP.from_linears(*lin, track_stats=True)
    poison()
    y = m(x.view(3, 171, K))
    assert y.shape == (3, 171, K)
    check(y.view(-1, K), x, wg, wu, wd, True)
    assert int(m.nnz_stats[2]) == 513
    # weights edited in place: the cached transposed down weight must follow
    with torch.no_grad():
        m.down_proj.weight.mul_(2)
    y2 = m(x)
    check(y2, x, wg, wu, m.down_proj.weight, True)
    mn = ffn.TwELLMLP.from_linears(lin[1], lin[2])
    check(mn(x), x, None, wu, wd, False)


def test_down_cache_never_stale(ffn):
    """The plan's neuron-major W_d follows a new weight, a weight edited in place and a weight that reuses a freed
    weight's memory (fresh .detach() views every call, as modules pass)."""
    K, N, M = 576, 1536, 300
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=41, adversarial=False)
    plan = new_plan(mode="sparse")
    for i in range(3):
        wdi = (wd * (i + 1)).contiguous()
        check(run(ffn, x, wg, wu, wdi.detach(), plan=plan), x, wg, wu, wdi, True)
        with torch.no_grad():
            wdi.mul_(-1)
        check(run(ffn, x, wg, wu, wdi.detach(), plan=plan), x, wg, wu, wdi, True)
        del wdi


def test_bad_inputs_on_gpu(ffn):
    x, wg, wu, wd = make_problem(8, 576, 1536, 0.01, seed=1, adversarial=False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ffn.sparse_gated_ffn(x.half(), wg, wu, wd)
    with pytest.raises(RuntimeError, match="w_down"):
        ffn.sparse_gated_ffn(x, wg, wu, wd.t().contiguous())
    with pytest.raises(RuntimeError, match="K % 64"):
        ffn.sparse_gated_ffn(x[:, :500].contiguous(), wg[:, :500].contiguous(), wu[:, :500].contiguous(),
                             wd[:500].contiguous())
    with pytest.raises(ValueError, match="no_grad"):
        ffn.sparse_gated_ffn(x, wg.requires_grad_(), wu, wd)


def test_noncontiguous_input_is_copied(ffn):
    """A transposed view of x is read through a copy, as a PyTorch op would; the result is exact."""
    x, wg, wu, wd = make_problem(64, 576, 1536, 0.01, seed=2, adversarial=False)
    xt = x.t().contiguous().t()
    assert not xt.is_contiguous()
    for mode in ("sparse", "dense"):
        check(run(ffn, xt, wg, wu, wd, mode=mode), x, wg, wu, wd, True)


@pytest.mark.parametrize("gated", [True, False])
def test_relu_mul_stats_kernel(ffn, gated):
    """The dense path's fused relu(g) * u (in place): the same bits as torch's relu then mul on finite values
    (NaN where torch has NaN, 0 * Inf included), per-row active counts, and the exact dispatch measurement."""
    from sfl.kernels.loader import load_twell

    ext = load_twell()
    gen = torch.Generator(device=DEV).manual_seed(7)
    for rows, N, S in ((1, 256, 32), (13, 1536, 32), (3001, 5632, 32), (40, 8192, 8), (1057, 5632, 32)):
        ld = N + 64   # strided rows, written in place
        g = torch.randn(rows, ld, device=DEV, generator=gen).sub(1.5).to(BF)
        u = torch.randn(rows, ld, device=DEV, generator=gen).to(BF)
        if rows > 9:
            g[3] = float("nan")
            g[5, 7] = float("inf")
            g[6, 9] = float("-inf")
            u[8, 11] = float("inf")   # relu(g) = 0 there or not: torch gives NaN or Inf, so must we
            g[8, 11] = -1.0
            u[8, 12] = float("inf")
            g[8, 12] = 2.0
            g[7, :200] = 1.0          # tile 0 overflows S
            g[9] = -1.0               # nothing active
            g[2] = -0.0
        gv, uv = g[:, :N], u[:, :N]
        act = (gv.float() > 0) | torch.isnan(gv.float())
        want = F.relu(gv) * uv if gated else F.relu(gv)
        tiles = act.view(rows, N // 256, 256).sum(2)
        bad = (tiles > S).any(1) | (~torch.isfinite(gv.float())).any(1)
        tail_g, tail_u = g[:, N:].clone(), u[:, N:].clone()
        rownnz = torch.full((rows,), -7, device=DEV, dtype=torch.int32)
        stats = torch.zeros(2, device=DEV, dtype=torch.int64)
        ext.relu_mul_stats(gv, uv if gated else torch.empty(0, device=DEV, dtype=BF), uv if gated else gv, N, S, N,
                           rownnz, stats, torch.empty(0, device=DEV))
        got = uv if gated else gv
        nan_w = torch.isnan(want.float())
        assert torch.equal(torch.isnan(got.float()), nan_w), "NaN pattern differs from torch relu/mul"
        assert torch.equal(got.float()[~nan_w], want.float()[~nan_w]), "values differ from torch relu/mul"
        bits = lambda t: t.view(torch.int16)  # noqa: E731  (NaN-safe comparison)
        assert torch.equal(bits(g[:, N:]), bits(tail_g)) and torch.equal(bits(u[:, N:]), bits(tail_u)), \
            "wrote past N columns"
        assert torch.equal(rownnz.long(), act.sum(1))
        assert stats.tolist() == [int(act.sum(1)[~bad].sum()), int(bad.sum())]
        # training form: separate output, a row cap, per-row L1 sums (inputs untouched)
        g2, u2 = g.clone(), u.clone()
        g2v, u2v = g2[:, :N], u2[:, :N]
        keep = (g2v > 0) | torch.isnan(g2v)
        want2 = torch.where(keep, g2v, torch.zeros_like(g2v))
        want2 = want2 * u2v if gated else want2
        out = torch.full((rows, N), 7.0, device=DEV, dtype=BF)
        l1_row = torch.full((rows,), -1.0, device=DEV)
        stats2 = torch.zeros(2, device=DEV, dtype=torch.int64)
        cap = 20
        ext.relu_mul_stats(g2v, u2v if gated else torch.empty(0, device=DEV, dtype=BF), out, N, 256, cap,
                           torch.empty(0, device=DEV, dtype=torch.int32), stats2, l1_row)
        assert torch.equal(bits(g2), bits(g)) and torch.equal(bits(u2), bits(u)), "inputs modified"
        nan2 = torch.isnan(want2.float())
        assert torch.equal(torch.isnan(out.float()), nan2) and torch.equal(out.float()[~nan2], want2.float()[~nan2])
        l1_want = want2.float().abs().sum(1)
        fin = torch.isfinite(l1_want)
        assert torch.equal(torch.isfinite(l1_row), fin)
        assert torch.allclose(l1_row[fin], l1_want[fin], rtol=1e-5, atol=1e-6)
        bad2 = (act.sum(1) > cap) | (~torch.isfinite(gv.float())).any(1)
        assert stats2.tolist() == [int(act.sum(1)[~bad2].sum()), int(bad2.sum())]


def test_dense_path_is_torch_dense(ffn):
    """mode='dense' (fused relu*mul) gives exactly HF's three F.linear on every finite row; stats match."""
    for gated, N in ((True, 5632), (False, 8192)):
        x, wg, wu, wd = make_problem(1000, 2048, N, 0.02, seed=11, gated=gated)
        poison()
        stats = torch.zeros(3, device=DEV, dtype=torch.int64)
        y = run(ffn, x, wg, wu, wd, gated, stats=stats, mode="dense")
        ref = dense(x, wg, wu, wd, gated)
        fin = torch.isfinite(ref).all(1)
        assert torch.equal(torch.isfinite(y), torch.isfinite(ref))
        assert torch.equal(y[fin], ref[fin])
        check_stats(stats, F.relu(F.linear(x, wg if gated else wu)))


@pytest.mark.parametrize("M", [1, 64, 4096])
def test_explicit_dense_is_plain_torch(ffn, M):
    """mode='dense' without a plan runs plain torch (kernels.device.dense_ffn), bit for bit, for a row-major and a
    neuron-major w_down; the op's own dense path agrees to bf16 rounding (at decode sizes it runs its own kernels)."""
    from sfl.kernels.layout import keep_down_layout
    from sfl.kernels.twell import ops

    for gated, N in ((True, 5632), (False, 8192)):
        x, wg, wu, wd = make_problem(M, 2048, N, 0.02, seed=M, gated=gated)
        for w_down in (wd, keep_down_layout(wd.t().contiguous().t())):
            y = run(ffn, x, wg, wu, w_down, gated, mode="dense")
            a = F.relu(F.linear(x, wg if gated else wu))
            # bit for bit, NaN where torch gives NaN (make_problem's adversarial rows carry NaN/Inf inputs)
            torch.testing.assert_close(y, F.linear(a * F.linear(x, wu) if gated else a, w_down), rtol=0, atol=0,
                                       equal_nan=True)
            op = ops.ffn(x, wg if gated else None, wu, w_down, new_plan(gated, mode="dense"))
            fin = torch.isfinite(y).all(-1)
            assert float((op[fin].float() - y[fin].float()).norm() / y[fin].float().norm()) < 1e-2
            assert not bool(torch.isfinite(op[~fin]).all(-1).any())  # a non-finite row stays non-finite


def test_row_stats_kernel(ffn):
    from sfl.kernels.loader import load_twell

    ext = load_twell()
    counts = torch.randint(0, 300, (5000, 22), device=DEV, dtype=torch.int32)
    flag = (torch.rand(5000, device=DEV) < 0.1).int()
    out = torch.zeros(2, device=DEV, dtype=torch.int64)
    ext.row_stats(counts, flag, out)
    assert out.tolist() == [int((counts.long().sum(1) * (flag == 0)).sum()), int(flag.sum())]


def _set_activity(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Feature 0 carries the gate shift (make_problem): scaling it moves the activity of every row."""
    x = x.clone()
    x[:, 0] = scale
    return x


@pytest.mark.parametrize("M", [16, 3000])
def test_dispatch_history_follows_activity(ffn, M):
    """Auto dispatch: first call dense + measure; low activity -> sparse; a jump to high activity is run (exact)
    on the stale choice once, then dense; back to low -> sparse again. Exact on every call."""
    K, N = 2048, 5632
    x, wg, wu, wd = make_problem(M, K, N, 0.004, seed=31, adversarial=False)
    lo, hi = _set_activity(x, 1.0), _set_activity(x, 0.2)   # ~0.4% and ~20% active
    # sparse whenever the measured activity is <= 1%; the table alone (self-timing has its own test)
    plan = new_plan(crossover="1:0.01", self_timing=False, measure_every=1)   # every dense call measures
    seq = [(lo, "dense"), (lo, "sparse"), (lo, "sparse"), (hi, "sparse"), (hi, "dense"), (hi, "dense"),
           (lo, "dense"), (lo, "sparse")]
    for i, (xi, want) in enumerate(seq):
        poison()
        y = run(ffn, xi, wg, wu, wd, plan=plan)
        got = plan.info()["path"].replace("-syncfree", "")
        torch.cuda.synchronize()   # lets the asynchronous measurement land before the next call
        assert got == want, f"call {i}: path {got}, expected {want} ({plan.info()})"
        check(y, xi, wg, wu, wd, True)
    run(ffn, lo, wg, wu, wd, plan=plan)   # polls the last measurement
    info = plan.info()
    assert info["measurements"] >= len(seq) and info["p"] is not None and info["p"] < 0.01


def test_nongated_dense_relu_epilogue_is_torch_dense(ffn):
    """The non-gated dense call without statistics runs the ReLU in the first GEMM's epilogue: HF's bits on every
    finite row and HF's non-finite pattern (NaN / +-Inf rows), eager and replayed from a CUDA graph; a captured
    call before the layer has made its zero bias runs torch's relu, with the same bits."""
    for M, N in ((1, 8192), (64, 1536), (3000, 8192)):
        x, _, wu, wd = make_problem(M, 2048, N, 0.02, seed=13 + M, gated=False)
        ref = dense(x, None, wu, wd, False)
        fin = torch.isfinite(ref).all(1)

        def same_as_hf(y, how):
            assert torch.equal(torch.isfinite(y), torch.isfinite(ref)), f"M {M} {how}: non-finite pattern"
            assert torch.equal(y[fin], ref[fin]), f"M {M} {how}: not HF's bits"

        plan = new_plan(gated=False, mode="dense")
        poison()
        same_as_hf(run(ffn, x, None, wu, wd, False, plan=plan), "eager")
        assert plan.info()["path"] == "dense"
        graph, y = captured(lambda: run(ffn, x, None, wu, wd, False, plan=plan))
        y.fill_(float("nan"))
        graph.replay()
        same_as_hf(y, "replayed")
        if M < 1024:
            continue
        # auto: the one eager call measures (torch's relu inside relu_mul_stats, no zero bias made), the captured
        # call is dense without measuring: the fallback
        cold = new_plan(gated=False)
        run(ffn, x, None, wu, wd, False, plan=cold)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = run(ffn, x, None, wu, wd, False, plan=cold)
        assert cold.info()["path"] == "dense"
        y.fill_(float("nan"))
        graph.replay()
        same_as_hf(y, "captured, no bias yet")


def test_nongated_dense_measures_every_nth_call(ffn):
    """Non-gated auto: a layer measured above the crossover runs as HF does (torch's relu, same bits) and is
    re-measured only every measure_every dense calls; when the activity drops, it is seen at the next
    re-measurement and the layer goes sparse. Exact on every call."""
    M, K, N = 3000, 2048, 8192
    x, _, wu, wd = make_problem(M, K, N, 0.004, seed=37, gated=False, adversarial=False)
    lo, hi = _set_activity(x, 1.0), _set_activity(x, 0.2)
    plan = new_plan(crossover_nongated="1:0.01", self_timing=False, measure_every=4)
    paths = []
    for i in range(10):
        xi = hi if i < 6 else lo
        y = run(ffn, xi, None, wu, wd, False, plan=plan)
        paths.append(plan.info()["path"].replace("-syncfree", ""))
        torch.cuda.synchronize()
        ref = dense(xi, None, wu, wd, False)
        if paths[-1] == "dense":
            assert torch.equal(y, ref), f"call {i}: the dense path must give HF's bits"
        else:
            check(y, xi, None, wu, wd, False)
    # calls 0..5 high: measured at dense calls 0 (first call) and 4 only; calls 6.. low: dense until the next
    # re-measurement (dense call 8) lands, then sparse (which measures every call)
    assert paths[:9] == ["dense"] * 9 and paths[9] == "sparse", paths
    assert plan.info()["measurements"] >= 3, plan.info()


def test_dispatch_without_readback_keeps_old_estimate(ffn):
    """If the measurement has not landed yet (host ahead of GPU), the previous estimate is used: no sync."""
    K, N, M = 576, 1536, 2000
    x, wg, wu, wd = make_problem(M, K, N, 0.004, seed=32, adversarial=False)
    plan = new_plan(crossover="1:0.01")
    run(ffn, x, wg, wu, wd, plan=plan)   # first call: the plan's pinned slots and events (their allocation syncs)
    torch.cuda.synchronize()
    plan.reset()                         # forget the estimate, keep the slots
    torch.cuda._sleep(200_000_000)   # keep the GPU busy so no event completes during the calls below
    ys = [run(ffn, x, wg, wu, wd, plan=plan) for _ in range(3)]
    info = plan.info()
    torch.cuda.synchronize()
    assert info["dense_calls"] == 3 and info["measurements"] == 0, info   # nothing measured yet: dense, never waited
    for y in ys:
        check(y, x, wg, wu, wd, True)


@pytest.mark.parametrize("mode", ["dense", "auto-sparse", "auto-timed"])
def test_calls_have_no_host_sync(ffn, mode):
    """Dense and sync-free sparse calls (with their measurements, statistics and self-timing at decode sizes) never
    synchronize the host."""
    K, N = 576, 1536
    M = {"dense": 4096, "auto-sparse": 32, "auto-timed": 4}[mode]
    x, wg, wu, wd = make_problem(M, K, N, 0.004, seed=33, adversarial=False)
    plan = new_plan(crossover="1:0" if mode == "dense" else "1:0.05", self_timing=mode == "auto-timed")
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)
    for _ in range(2):   # build, pinned slots, a first measurement
        run(ffn, x, wg, wu, wd, plan=plan, stats=stats)
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            y = run(ffn, x, wg, wu, wd, plan=plan, stats=stats)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if mode != "auto-timed":   # timing picks either path
        assert plan.info()["path"] == ("dense" if mode == "dense" else "sparse-syncfree")
    check(y, x, wg, wu, wd, True)


def test_graph_capture_auto_uses_history(ffn):
    """Under capture, auto takes the choice of the history measured by earlier eager calls."""
    K, N, M = 2048, 5632, 8
    x, wg, wu, wd = make_problem(M, K, N, 0.004, seed=34, adversarial=False)
    plan = new_plan(crossover="1:0.01")
    static_x = x.clone()
    graph, static_y = captured(lambda: run(ffn, static_x, wg, wu, wd, plan=plan))
    assert plan.info()["path"] == "sparse-syncfree"
    x2, _, _, _ = make_problem(M, K, N, 0.004, seed=35, adversarial=False)
    static_x.copy_(x2)
    static_y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(static_y, x2, wg, wu, wd, True)


def test_decode_down_copy_only_where_a_capture_goes_sparse(ffn):
    """Eager decode-size calls keep W_d's neuron-major copy for a later capture, but not where the table sends this M
    dense at the known activity (23 MB per layer at the 1.5B shape); once a measurement puts the layer under its
    crossover, the next eager call makes it."""
    K, N, M = 2048, 5632, 8
    x, wg, wu, wd = make_problem(M, K, N, 0.004, seed=36, adversarial=False)
    above = new_plan(crossover="1:0.01", activity_hint=0.2)
    below = new_plan(crossover="1:0.01", activity_hint=0.004)
    check(run(ffn, x, wg, wu, wd, plan=above), x, wg, wu, wd, True)
    check(run(ffn, x, wg, wu, wd, plan=below), x, wg, wu, wd, True)
    torch.cuda.synchronize()
    assert above.info()["path"] == "dense" and above.info()["down_copy_bytes"] == 0
    assert below.info()["down_copy_bytes"] == N * K * 2
    run(ffn, x, wg, wu, wd, plan=above)  # its first call measured p = 0.004 < 0.01
    torch.cuda.synchronize()
    assert above.info()["p"] < 0.01 and above.info()["down_copy_bytes"] == N * K * 2


def test_neuron_major_w_down_is_read_without_a_copy(ffn):
    """W_d stored neuron-major (kernels/layout.py, the model's layout for mlp_impl="cuda"): every path gives the
    bits it gives with nn.Linear's row-major W_d (the sparse kernels read the same values; the dense path is
    F.linear on the same tensor), and the plan keeps no copy of W_d, on any path or in a captured call."""
    from sfl.kernels.layout import is_neuron_major

    K, N = 2048, 5632
    for M, mode in ((1, "sparse"), (8, "sparse"), (64, "sparse"), (4096, "sparse"), (4096, "dense")):
        x, wg, wu, wd = make_problem(M, K, N, 0.005, seed=83 + M, adversarial=M >= 12)
        wd_nm = wd.t().contiguous().t()
        assert is_neuron_major(wd_nm) and torch.equal(wd_nm, wd)
        want = run(ffn, x, wg, wu, wd, mode=mode)
        plan = new_plan(mode=mode)
        poison()
        y = run(ffn, x, wg, wu, wd_nm, plan=plan)
        torch.cuda.synchronize()
        # sparse: the bits of row-major W_d; dense: F.linear's bits on this W_d (cuBLAS may pick another kernel)
        want = want if mode == "sparse" else dense(x, wg, wu, wd_nm, True)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(y), fin) and torch.equal(y[fin], want[fin]), f"M {M} {mode}: bits differ"
        check(y, x, wg, wu, wd_nm, True)
        assert plan.info()["path"].startswith(mode) and plan.info()["down_copy_bytes"] == 0, plan.info()
        if M <= 64:  # decode sizes are what CUDA graphs capture
            graph, yc = captured(lambda: run(ffn, x, wg, wu, wd_nm, plan=plan))
            yc.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(yc[fin], want[fin]) and plan.info()["down_copy_bytes"] == 0


def hot_problem(M: int, K: int, N: int, H: int, seed: int, gated: bool = True):
    """make_problem's adversarial rows at ~1% activity, with the first H neurons firing on ~10% of tokens."""
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=seed, gated=gated)
    (wg if gated else wu)[:H, 0] = -1.2816   # P(Z > 1.2816) = 10%
    return x, wg, wu, wd


def cold_measurement(x, w, H: int, S: int) -> tuple[float, float]:
    """(p, f) a hot/cold layer measures: active entries of the rows no cold tile flags (a tile over S, or a
    non-finite gate in a cold column), over those rows x N; and the fraction of rows flagged."""
    g = F.linear(x, w)
    act = (F.relu(g) != 0)
    M, N = act.shape
    cold = act[:, H:].reshape(M, -1, 256).sum(2)
    flagged = (cold > S).any(1) | ~torch.isfinite(g[:, H:]).all(1)
    ok = ~flagged
    return float(act[ok].sum()) / (int(ok.sum()) * N), float(flagged.sum()) / M


@pytest.mark.parametrize("K,N,gated", [(576, 1536, True), (2048, 5632, True), (2048, 8192, False)])
@pytest.mark.parametrize("H", [256, 1024])
@pytest.mark.parametrize("M", [65, 1000, 4099])
def test_hot_cold_is_exact(ffn, K, N, gated, H, M):
    """KernelConfig.hot_neurons: the first H neurons as dense GEMMs, the rest through TwELL, above decode sizes. The
    output against fp32 (heavy, whole-tile, full, zero and NaN/±Inf rows; a whole-tile row hot when H = 1024), on
    both large-M step variants and both backup variants; the model's statistics count hot and cold entries; the
    measured activity counts every neuron and only cold tiles flag rows, on the sparse and the dense path alike."""
    x, wg, wu, wd = hot_problem(M, K, N, H, seed=M + K + H, gated=gated)
    w = wg if gated else wu
    for up_list_min_m, backup_rows in ((0, -1), (1, -1), (1, 0)):
        plan = new_plan(mode="sparse", hot_neurons=H, up_list_min_m=up_list_min_m, backup_rows=backup_rows)
        stats = torch.zeros(3, device=DEV, dtype=torch.int64)
        for _ in range(2):   # the second call reads the first one's measurement back
            poison()
            y = run(ffn, x, wg, wu, wd, gated, plan=plan, stats=stats)
            torch.cuda.synchronize()
            check(y, x, wg, wu, wd, gated)
        h = F.relu(F.linear(x, w))
        n = (h != 0).sum(1)
        assert stats.tolist() == [2 * int(n.sum()), int(n.max()), 2 * M]
        info = plan.info()
        assert info["path"] == "sparse" and info["hot_neurons"] == H, info
        assert info["hot_copy_bytes"] == (2 * H * K * 2 if gated else 0), info
        p, f = cold_measurement(x, w, H, 32)
        assert info["p"] == pytest.approx(p, rel=1e-9) and info["f"] == pytest.approx(f, rel=1e-9), (info, p, f)
    dplan = new_plan(hot_neurons=H, self_timing=False)   # auto: a first call runs dense and measures
    for _ in range(2):
        run(ffn, x, wg, wu, wd, gated, plan=dplan)
        torch.cuda.synchronize()
    info = dplan.info()
    assert info["path"] == "dense" and info["measurements"] >= 1, info
    assert info["p"] == pytest.approx(p, rel=1e-9) and info["f"] == pytest.approx(f, rel=1e-9), (info, p, f)


def test_hot_cold_captured_and_timed(ffn):
    """A captured hot/cold call replays the eager call's bits (the stacked hot rows kept by the plan, none made
    inside the graph); a captured call that finds no stacked copy makes its own and gives the same bits. Eager auto
    with hot neurons times both paths at large M and stays exact; decode sizes ignore hot_neurons; a layer with
    N <= hot_neurons is refused with the setting's name."""
    K, N, M, H = 2048, 5632, 1000, 512
    x, wg, wu, wd = hot_problem(M, K, N, H, seed=5)
    plan = new_plan(mode="sparse", hot_neurons=H)
    want = run(ffn, x, wg, wu, wd, plan=plan)
    graph, yc = captured(lambda: run(ffn, x, wg, wu, wd, plan=plan))
    yc.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(yc), fin) and torch.equal(yc[fin], want[fin])
    fresh = new_plan(mode="sparse", hot_neurons=H)
    run(ffn, x, wg, wu, wd, plan=fresh)
    wu2 = wu.clone()   # another W_u: the kept copy does not match, the capture stacks its own
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(ffn, x, wg, wu2, wd, plan=fresh)
    torch.cuda.current_stream().wait_stream(side)
    g2 = torch.cuda.CUDAGraph()
    wu2.add_(0)   # a new version: the copy the side-stream call kept is stale now
    with torch.cuda.graph(g2):
        y2 = run(ffn, x, wg, wu2, wd, plan=fresh)
    y2.fill_(float("nan"))
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(torch.isfinite(y2), fin) and torch.equal(y2[fin], want[fin])
    auto = new_plan(hot_neurons=H)
    for _ in range(8):
        check(run(ffn, x, wg, wu, wd, plan=auto), x, wg, wu, wd, True)
        torch.cuda.synchronize()
    buckets = {path for (_, path) in auto.info()["timings"]}
    assert buckets == {"dense", "sparse"}, auto.info()
    small = new_plan(mode="sparse", hot_neurons=H)
    xs = x[:16].contiguous()
    check(run(ffn, xs, wg, wu, wd, plan=small), xs, wg, wu, wd, True)
    assert small.info()["hot_neurons"] == 0 and small.info()["path"] == "sparse-syncfree"
    with pytest.raises(RuntimeError, match="hot_neurons=1536 must be below"):
        run(ffn, x[:, :576].contiguous(), wg[:1536, :576].contiguous(), wu[:1536, :576].contiguous(),
            wd[:576, :1536].contiguous(), mode="sparse", hot_neurons=1536)


def test_model_stats_accumulate_on_every_path(ffn):
    """The stats buffer adds up over calls on the dense, eager sparse, sync-free (TwELL, decode_rows) and
    fused-decode paths."""
    K, N = 576, 1536
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)
    hs = []
    for M, mode, extra in ((3000, "dense", {}), (3000, "sparse", {}), (40, "sparse", {}), (5, "sparse", {}),
                           (2, "sparse", {}), (40, "sparse", dict(rows_decode_max_m=0))):
        x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=M, adversarial=True)
        run(ffn, x, wg, wu, wd, stats=stats, mode=mode, **extra)
        hs.append(F.relu(F.linear(x, wg)))
    torch.cuda.synchronize()
    n = torch.cat([(h != 0).sum(1) for h in hs])
    assert stats.tolist() == [int(n.sum()), int(n.max()), n.numel()]


def test_op_under_torch_compile(ffn):
    """torch.compile(fullgraph=True) traces the op (fake implementation), gives the eager result, and does not
    recompile over repeated calls of one shape."""
    import torch._dynamo

    from sfl.kernels.twell import ops

    K, N, M = 576, 1536, 300
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=36)
    plan = new_plan(mode="sparse")
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)

    def f(x):
        return ops.ffn(x, wg, wu, wd, plan, stats) * 2

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs compiled by earlier tests count otherwise
    cf = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        ys = [cf(x) for _ in range(5)]
    torch.cuda.synchronize()
    check(ys[-1] / 2, x, wg, wu, wd, True)
    assert int(stats[2]) == 5 * M
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("M", [1, 6, 40, 300])
def test_op_under_compiled_cuda_graphs(ffn, M):
    """torch.compile(mode="reduce-overhead") (CUDA graphs through cudagraph trees) over a fresh plan: the warm-up call
    runs in the graph's memory pool, so what the plan keeps (W_d's neuron-major copy, the decode workspace, the
    measurement slots) must come from outside it, or recording fails ("tensors in the cudagraph pool not tracked as
    outputs"). The graph is really used (no cudagraph skip) and replays with new inputs stay exact."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from sfl.kernels.twell import ops

    K, N = 2048, 5632
    _, wg, wu, wd = make_problem(M, K, N, 0.01, seed=60 + M, adversarial=False)
    plan = new_plan(mode="sparse")

    class Layer(torch.nn.Module):  # weights and statistics as buffers: static addresses for the graph
        def __init__(self):
            super().__init__()
            for n, t in (("wg", wg), ("wu", wu), ("wd", wd), ("stats", torch.zeros(3, device=DEV, dtype=torch.int64))):
                self.register_buffer(n, t)

        def forward(self, x):
            return ops.ffn(x, self.wg, self.wu, self.wd, plan, self.stats)

    torch._dynamo.reset()
    counters.clear()
    layer = Layer()
    cf = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    try:
        with torch.no_grad():
            for seed in range(5):
                x, _, _, _ = make_problem(M, K, N, 0.01, seed=70 + seed, adversarial=False)
                y = cf(x).clone()
                torch.cuda.synchronize()
                check(y, x, wg, wu, wd, True)
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled call did not run as a CUDA graph"
    assert int(layer.stats[2]) == 5 * M
    # captured calls: the decode paths up to decode_max_m, above it the TwELL path with its device-side backup
    assert plan.info()["path"] == ("sparse" if M > 64 else "sparse-syncfree")


def test_capture_without_a_valid_down_copy(ffn):
    """A capture that finds no valid W_d copy in its plan (here: the plan's eager call saw another W_d) transposes W_d
    inside the graph and caches nothing from the graph's pool: replays stay exact, before and after an eager call
    rebuilds the plan's own copy."""
    K, N, M = 2048, 5632, 4
    x, wg, wu, wd = make_problem(M, K, N, 0.01, seed=81, adversarial=False)
    plan = new_plan(mode="sparse")
    run(ffn, x, wg, wu, wd.clone(), plan=plan)  # the plan's device state, and a W_d copy of another tensor
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run(ffn, static_x, wg, wu, wd, plan=plan)
    for seed in (82, 83):
        x2, _, _, _ = make_problem(M, K, N, 0.01, seed=seed, adversarial=False)
        static_x.copy_(x2)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(static_y, x2, wg, wu, wd, True)
        poison()
        check(run(ffn, x2, wg, wu, wd, plan=plan), x2, wg, wu, wd, True)  # eager: the plan's own copy


# ---------------------------------------------------------------- up_down: the large-M up and down in one kernel
@pytest.mark.parametrize("K,N,gated", SHAPES + [(2048, 17408, True)])
@pytest.mark.parametrize("S", [8, 32, 256])
def test_up_down_kernel(ffn, K, N, gated, S):
    """up_down (one block per row) from a TwELL of the bf16 gate output: every unflagged row within the bf16 budget
    of float64 math, and bit-identical to the split kernels (gated_up + down) where one share of the entries covers
    K (K >= 2048); flagged rows untouched (the eager path's backup writes them) or NaN (nan_fill). S = 256 runs
    3-5 windows of 8 tiles per row, N = 17408 at S = 32 two windows of 64 tiles."""
    from sfl.kernels.loader import load_twell

    ext = load_twell()
    M = 300
    x, wg, wu, wd = make_problem(M, K, N, 0.02 if S > 8 else 0.005, seed=K + N + S, gated=gated)
    x[20:40, 3:] *= 3   # more heavy rows: tiles above S = 8 / 32
    g = F.linear(x, wg if gated else wu)
    T = N // 256
    packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
    counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
    flag = torch.zeros(M, device=DEV, dtype=torch.int32)
    ext.compact(g, N, packed, counts, flag)
    wdt = wd.t().contiguous()
    none = torch.empty(0, device=DEV, dtype=BF)
    ok = ~flag.bool()
    assert ok.sum() >= 20 and (~ok).sum() >= 3, "the problem should have both kinds of rows"
    outs = {}
    for nan_fill in (0, 1):
        poison()
        y = torch.full((M, K), 3.0, device=DEV, dtype=BF)
        y[ok] = float("nan")   # every unflagged row must be written
        ext.up_down(x if gated else none, wu if gated else none, wdt, packed, counts, flag, y, nan_fill)
        torch.cuda.synchronize()
        outs[nan_fill] = y
        if nan_fill:
            assert torch.isnan(y[~ok]).all(), "flagged rows must be NaN-filled"
        else:
            assert (y[~ok] == 3.0).all(), "flagged rows must be left to the dense backup"
    y = outs[0]
    assert torch.equal(y[ok], outs[1][ok])
    ref32 = dense(x[ok].double(), wg.double() if gated else None, wu.double(), wd.double(), gated)
    ref16 = dense(x[ok], wg, wu, wd, gated)
    nrm = ref32.norm()
    err, err16 = ((y[ok].double() - ref32).norm() / nrm).item(), ((ref16.double() - ref32).norm() / nrm).item()
    assert err <= 2 * err16 + 1e-7, f"error {err:.3e} > 2 x bf16 PyTorch {err16:.3e}"
    if K >= 2048:
        hval = torch.empty(M, T, S, device=DEV, dtype=torch.float32) if gated else torch.empty(0, device=DEV)
        if gated:
            ext.gated_up(x, wu, packed, counts, flag, hval, T)
        y2 = torch.full((M, K), 3.0, device=DEV, dtype=BF)
        ext.down(wdt, packed, counts, flag, hval, y2, torch.empty(0, device=DEV), 4, T, 0)
        assert torch.equal(y[ok], y2[ok]), "up_down differs from gated_up + down"
    # up_list + down_slices (the path from up_list_min_m rows): each unflagged row's entries as a list in column
    # order, then y slice-major; the same sums as up_down at K >= 2048, within the budget everywhere
    lcol = torch.full((M, T * S), -7, device=DEV, dtype=torch.int32)
    lh = torch.full((M, T * S), float("nan"), device=DEV)
    lnnz = torch.full((M,), -7, device=DEV, dtype=torch.int32)
    ext.up_list(x if gated else none, wu if gated else none, packed, counts, flag, lcol, lh, lnnz, N)
    y3 = torch.full((M, K), 3.0, device=DEV, dtype=BF)
    y3[ok] = float("nan")
    ext.down_slices(wdt, lcol, lnnz, flag, lh, y3, 1)   # one row per block: the inference op's
    torch.cuda.synchronize()
    for rows in (2, 4):   # slices' other block shapes (4: the training op's): the same bits
        y4 = torch.full((M, K), 3.0, device=DEV, dtype=BF)
        y4[ok] = float("nan")
        ext.down_slices(wdt, lcol, lnnz, flag, lh, y4, rows)
        torch.cuda.synchronize()
        assert torch.equal(y4[ok], y3[ok]) and (y4[~ok] == 3.0).all(), f"slices, {rows} rows per block"
    assert (y3[~ok] == 3.0).all() and (lnnz[~ok] == -7).all(), "flagged rows must be left to the dense backup"
    assert torch.equal(lnnz[ok], counts.clamp(max=S).sum(1)[ok].int())
    h = F.relu(g).float()
    if gated:
        h = h * F.linear(x.float(), wu.float())
    for r in ok.nonzero().flatten()[:: max(1, int(ok.sum()) // 25)].tolist():   # ~25 rows: the lists themselves
        n = int(lnnz[r])
        cols = lcol[r, :n].long()
        assert torch.equal(cols, (g[r] > 0).nonzero().flatten()), f"row {r}: columns"
        torch.testing.assert_close(lh[r, :n], h[r, cols], rtol=2e-2, atol=1e-3)
    if K >= 2048:
        assert torch.equal(y3[ok], y[ok]), "up_list + down_slices differ from up_down"
    else:
        err3 = ((y3[ok].double() - ref32).norm() / nrm).item()
        assert err3 <= 2 * err16 + 1e-7, f"error {err3:.3e} > 2 x bf16 PyTorch {err16:.3e}"


# ---------------------------------------------------------------- compaction v2, grid cap, fused decode
def test_compact_equals_reference(ffn):
    """The persistent compaction writes exactly what reference.d2t writes, on adversarial rows, strided row views
    and row counts that are not multiples of the unroll."""
    from sfl.kernels import reference
    from sfl.kernels.loader import load_twell

    ext = load_twell()
    gen = torch.Generator(device=DEV).manual_seed(1234)
    for rows, N in ((1, 256), (7, 1536), (3001, 5632)) * 4:   # repeated draws: row 2 (NaN) is often unflagged
        g = torch.randn(rows, N + 64, device=DEV, generator=gen).mul(2).sub(2.5).to(BF)   # ~6% active, tiles overflow
        g[0, :N // 2] = 1.0
        if rows > 5:
            g[2, 5] = float("nan")
            g[3, 9] = float("inf")
            g[4] = -0.0
        view = g[:, :N]   # row stride N + 64: read in place
        outs = []
        for v in (2,):
            packed = torch.full((rows, N // 256, 32), -7, device=DEV, dtype=torch.int32)
            counts = torch.full((rows, N // 256), -7, device=DEV, dtype=torch.int32)
            flag = torch.zeros(rows, device=DEV, dtype=torch.int32)
            ext.compact(view, N, packed, counts, flag)
            outs.append((packed, counts, flag))
        # relu in bf16 by selection, keeping NaN payloads: a float round trip canonicalizes NaN (0x7fc0 -> 0x7fff
        # on CUDA) while the kernels store the input's bits; that difference was this test's intermittent failure
        keep = (view > 0) | torch.isnan(view)
        ref = reference.d2t(torch.where(keep, view, torch.zeros_like(view)), 256, 32)
        valid = ref.valid_mask()
        nonfinite = (~torch.isfinite(view.float())).any(1)
        for version, (packed, counts, flag) in zip((2,), outs):
            assert torch.equal(counts, ref.counts), f"compact v{version}: counts differ"
            assert torch.equal(flag.bool(), ref.overflow_mask() | nonfinite), f"compact v{version}: flags differ"
            bad = (packed != ref.packed) & valid
            where = bad.nonzero()[:8].tolist()
            assert not bad.any(), (f"compact v{version} (rows={rows}, N={N}): {int(bad.sum())} valid slots differ, "
                                   f"first [row, tile, slot] {where}: ours {packed[bad][:8].tolist()} "
                                   f"reference {ref.packed[bad][:8].tolist()}")


def _decode_problem(M: int, K: int, N: int, p: float, seed: int, gated: bool):
    """make_problem, plus the adversarial rows that make_problem only adds for M >= 12 (as many as M allows)."""
    x, wg, wu, wd = make_problem(M, K, N, p, seed=seed, gated=gated, adversarial=False)
    x = x.float()
    cases = [lambda r: r.zero_(), lambda r: r[3:].mul_(6), lambda r: r.__setitem__(1, 1.0),
             lambda r: r.__setitem__(2, 1.0), lambda r: r.__setitem__(7, float("nan")),
             lambda r: r.__setitem__(8, float("inf")), lambda r: r.__setitem__(9, float("-inf"))]
    for r, f in zip(range(1, M), cases):
        f(x[r])
    return x.to(BF).contiguous(), wg, wu, wd


@pytest.mark.parametrize("K,N,gated", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
def test_fused_decode_vs_fp32(ffn, K, N, gated, M):
    """Fused decode kernel (M <= 8): exact vs fp32 within the bf16 budget, non-finite rows as dense, every output
    element written (poisoned), nnz equal to the dense count up to entries within rounding of 0."""
    x, wg, wu, wd = _decode_problem(M, K, N, 0.01, seed=100 * M + K + N, gated=gated)
    poison()
    plan = new_plan(mode="sparse", fused_decode_max_m=8)
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)
    y = run(ffn, x, wg, wu, wd, gated, plan=plan, stats=stats)
    torch.cuda.synchronize()
    assert plan.info()["d2t"] == "decode-fused"
    check(y, x, wg, wu, wd, gated)
    first = wg if gated else wu
    h = F.relu(F.linear(x, first))
    g64 = x.double() @ first.double().t()
    near0 = (g64.abs() < 1e-3 * g64.abs().amax(1, keepdim=True).clamp_min(1e-30)).sum(1)
    diff = abs(int(stats[0]) - int((h != 0).sum()))
    assert diff <= int(near0.sum()), f"nnz differs beyond rounding: {diff}"
    assert int(stats[2]) == M


@pytest.mark.parametrize("M", [1, 2, 16, 64])
def test_decode_graph_replay(ffn, M):
    """The decode paths under CUDA-graph capture (M = 1, 2: the fused decode kernel; 16, 64: the cuBLAS gate GEMM
    and decode_rows, both inside the graph): replays with new inputs, a heavy row and (M > 1) a NaN row included,
    stay exact."""
    K, N = 2048, 5632
    x, wg, wu, wd = make_problem(M, K, N, 0.005, seed=40 + M, adversarial=False)
    static_x = x.clone()
    ffn.sparse_gated_ffn(static_x, wg, wu, wd, mode="sparse")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ffn.sparse_gated_ffn(static_x, wg, wu, wd, mode="sparse")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = ffn.sparse_gated_ffn(static_x, wg, wu, wd, mode="sparse")
    for seed in (51, 52, 53):
        x2, _, _, _ = make_problem(M, K, N, 0.005, seed=seed, adversarial=False)
        x2[0, 3:] *= 6
        if M > 1:
            x2[M - 1, 5] = float("nan")
        static_x.copy_(x2)
        static_y.fill_(float("nan") if seed % 2 else 1.0)
        graph.replay()
        torch.cuda.synchronize()
        check(static_y, x2, wg, wu, wd, True)


@pytest.mark.parametrize("gated", [True, False])
def test_fused_decode_workspace_reuse(ffn, gated):
    """The fused decode path keeps one workspace per plan, re-zeroed by each call's finish kernel: a sequence of calls
    of different sizes on one plan, non-finite and heavy rows included, stays exact call after call, and the
    statistics add up over the calls."""
    K, N = 2048, 5632 if gated else 8192
    plan = new_plan(mode="sparse", fused_decode_max_m=8)
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)
    total = 0
    for i, M in enumerate([8, 3, 8, 1, 6, 8]):
        x, wg, wu, wd = _decode_problem(M, K, N, 0.01, seed=300 + i, gated=gated)
        poison()
        y = run(ffn, x, wg, wu, wd, gated, plan=plan, stats=stats)
        torch.cuda.synchronize()
        assert plan.info()["d2t"] == "decode-fused"
        check(y, x, wg, wu, wd, gated)
        total += M
    assert int(stats[2]) == total


# ---------------------------------------------------------------- decode_rows: cuBLAS gate, one block per row slice
@pytest.mark.parametrize("K,N,gated", SHAPES)
@pytest.mark.parametrize("M,fused_max", [(1, 0), (3, 0), (9, 8), (33, 8), (64, 8), (200, 8)])
def test_rows_decode_vs_fp32(ffn, K, N, gated, M, fused_max):
    """decode_rows (sync-free, above fused_decode_max_m): exact vs fp32 within the bf16 budget, non-finite rows as
    dense (NaN-filled), every output element written (poisoned), the measured counts equal to dense's exactly (the
    gate values are the cuBLAS GEMM's bits). M = 1 .. 200 covers 8, 4, 2 and 1 K slices per row."""
    x, wg, wu, wd = _decode_problem(M, K, N, 0.01, seed=500 + 7 * M + K + N, gated=gated)
    if M >= 40:  # the adversarial rows again in rows 33..39
        x[33:40] = x[1:8]
    poison()
    plan = new_plan(mode="sparse", fused_decode_max_m=fused_max, decode_max_m=max(64, M), rows_decode_max_m=max(64, M))
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)
    y = run(ffn, x, wg, wu, wd, gated, plan=plan, stats=stats)
    torch.cuda.synchronize()
    assert plan.info()["d2t"] == "decode-rows"
    check(y, x, wg, wu, wd, gated)
    h = F.relu(F.linear(x, wg if gated else wu))
    nnz = (h != 0).sum(1)
    assert int(stats[0]) == int(nnz.sum()) and int(stats[1]) == int(nnz.max()) and int(stats[2]) == M


@pytest.mark.parametrize("K,N,gated", SHAPES)
@pytest.mark.parametrize("M,slices", [(1, 1), (9, 1), (64, 1), (5, 3), (33, 3)])
def test_rows_decode_slices(ffn, K, N, gated, M, slices):
    """decode_rows with a set number of K slices per row: 1 (no cluster; a thread owns several chunks at K >= 2048)
    and 3 (slices of unequal width, a cluster of 3): exact, and the statistics as dense's."""
    x, wg, wu, wd = _decode_problem(M, K, N, 0.01, seed=900 + 7 * M + K + N + slices, gated=gated)
    poison()
    plan = new_plan(mode="sparse", fused_decode_max_m=0, decode_rows_slices=slices)
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)
    y = run(ffn, x, wg, wu, wd, gated, plan=plan, stats=stats)
    torch.cuda.synchronize()
    assert plan.info()["d2t"] == "decode-rows"
    check(y, x, wg, wu, wd, gated)
    nnz = (F.relu(F.linear(x, wg if gated else wu)) != 0).sum(1)
    assert int(stats[0]) == int(nnz.sum()) and int(stats[2]) == M


@pytest.mark.parametrize("gated", [True, False])
def test_decode_paths_on_one_plan(ffn, gated):
    """The fused and row decode paths alternating on one plan (the fused path's workspace is re-zeroed by its own
    finish whatever ran between), and the TwELL sync-free path on the same inputs: a sequence of calls of different
    sizes, non-finite and heavy rows included, stays exact call after call, and the statistics add up."""
    K, N = 2048, 5632 if gated else 8192
    plan = new_plan(mode="sparse", fused_decode_max_m=8)
    twell = new_plan(mode="sparse", rows_decode_max_m=0)
    stats = torch.zeros(3, device=DEV, dtype=torch.int64)
    total = 0
    for i, M in enumerate([8, 40, 3, 64, 1, 17, 64, 9]):
        x, wg, wu, wd = _decode_problem(M, K, N, 0.01, seed=700 + i, gated=gated)
        poison()
        y = run(ffn, x, wg, wu, wd, gated, plan=plan, stats=stats)
        torch.cuda.synchronize()
        assert plan.info()["d2t"] == ("decode-fused" if M <= 8 else "decode-rows")
        check(y, x, wg, wu, wd, gated)
        total += M
        if M > 8:
            check(run(ffn, x, wg, wu, wd, gated, plan=twell), x, wg, wu, wd, gated)
            assert twell.info()["d2t"] in ("fused", "cublas")
    assert int(stats[2]) == total


def _auto_calls(ffn, x, wg, wu, wd, plan, calls: int, check_each: bool = False):
    """`calls` auto-dispatched gated calls, each synchronized (so timings and measurements land before the next);
    returns the path of every call and the last output."""
    paths = []
    for _ in range(calls):
        y = run(ffn, x, wg, wu, wd, plan=plan)
        paths.append(plan.info()["path"])
        torch.cuda.synchronize()
        if check_each:
            check(y, x, wg, wu, wd, True)
    return paths, y


def test_self_timing_leaves_a_slower_sparse_path(ffn):
    """A crossover table that is wrong for a layer (here: 'always sparse' at ~3% activity, where sparse is several
    times slower and no row overflows): auto probes dense, times both paths and settles on dense within a few
    calls; exact throughout."""
    K, N, M = 2048, 5632, 4096
    x, wg, wu, wd = make_problem(M, K, N, 0.03, seed=41, adversarial=False)
    plan = new_plan(crossover="1:1", flagged_dense_above=1.0)
    paths, _ = _auto_calls(ffn, x, wg, wu, wd, plan, 12, check_each=True)
    times = plan.info()["timings"]
    bucket = M.bit_length()
    assert paths[:2] == ["dense", "dense"] and "sparse" in paths[2:6], paths   # measure, dense probe, then sparse
    assert paths[-4:] == ["dense"] * 4, (paths, times)
    assert min(times[(bucket, "sparse")]) > min(times[(bucket, "dense")])


def test_self_timing_keeps_a_faster_sparse_path(ffn):
    """Where the table is right (0.25% activity at M = 65536, sparse ~1.4x faster), timing confirms it."""
    K, N, M = 2048, 5632, 65536
    x, wg, wu, wd = make_problem(M, K, N, 0.0025, seed=42, adversarial=False)
    plan = new_plan(crossover="1:0.01")
    paths, _ = _auto_calls(ffn, x, wg, wu, wd, plan, 10)
    assert paths[-4:] == ["sparse"] * 4, (paths, plan.info()["timings"])


@pytest.mark.parametrize("M", [4, 32])
def test_self_timing_at_decode_sizes(ffn, M):
    """Eager decode sizes time both paths, whatever the table says (here: dense at 3% activity), and then run the
    one measured faster on this layer; exact throughout."""
    K, N = 2048, 5632
    x, wg, wu, wd = make_problem(M, K, N, 0.03, seed=43 + M, adversarial=False)
    plan = new_plan()
    paths, _ = _auto_calls(ffn, x, wg, wu, wd, plan, 12, check_each=True)
    times = plan.info()["timings"]
    bucket = M.bit_length()
    assert len(times[(bucket, "dense")]) >= 2 and len(times[(bucket, "sparse")]) >= 2, (paths, times)
    faster = "sparse-syncfree" if min(times[(bucket, "sparse")]) < min(times[(bucket, "dense")]) else "dense"
    assert paths[-1] == faster, (paths, times)


# ---------------------------------------------------------------- fused d2t (d2t_gemm.cu, sm_90a)
def _fused_or_skip(x, w):
    from sfl.kernels.twell import ops

    ext = ops.load()
    if not ext.d2t_gemm_supported(x.device.index or 0):
        pytest.skip("the fused d2t needs an sm_90 GPU")
    return ext


def check_twell_vs_fp32(packed, counts, flag, x, w, S):
    """A TwELL of relu(x w^T) computed in any fp32 summation order, checked against float64 math:
    every count written, columns strictly ascending, stored values = bf16(g) up to one bf16 rounding of an fp32
    sum, activity exact except for entries within fp32 rounding of zero, flags = overflow | non-finite row."""
    M, N = x.shape[0], w.shape[0]
    T = N // 256
    g64 = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    finite = torch.isfinite(g64).all(1)
    assert (counts >= 0).all() and (counts <= 256).all(), "a count was not written (poison left)"
    # ambiguous entries: |g| below what fp32 accumulation order can change
    amb = (g64.abs() <= 1e-5 * mag + 1e-30) & finite[:, None]
    ref_active = (g64 > 0) & ~amb
    cnt_lo = ref_active.view(M, T, 256).sum(2)
    cnt_hi = cnt_lo + amb.view(M, T, 256).sum(2)
    ok_rows = finite
    assert ((counts[ok_rows] >= cnt_lo[ok_rows]) & (counts[ok_rows] <= cnt_hi[ok_rows])).all(), "counts differ"
    expect_flag = (counts > S).any(1) | ~finite
    assert torch.equal(flag.bool(), expect_flag), "flags differ from overflow | non-finite"
    # decode the stored words of finite rows' tiles that do not overflow (an overflowing tile's words are undefined,
    # FORMAT.md: the fused d2t does not write them)
    slot = torch.arange(S, device=x.device)
    valid = (slot[None, None, :] < counts[:, :, None]) & (counts <= S)[:, :, None] & finite[:, None, None]
    cols = packed & 0xFFFF
    vals = (packed >> 16).to(torch.int16).view(torch.bfloat16).double()
    assert (cols[valid] < 256).all(), "tile-local column out of range"
    prev = torch.cat([torch.full_like(cols[:, :, :1], -1), cols[:, :, :-1]], 2)
    assert (cols[valid] > prev[valid]).all(), "columns not strictly ascending"
    gcol = cols + (torch.arange(T, device=x.device) * 256)[None, :, None]
    rows = torch.arange(M, device=x.device)[:, None, None].expand_as(cols)
    r, gc, v = rows[valid], gcol[valid], vals[valid]
    ref = g64[r, gc]
    assert (v > 0).all() and (ref > -1e-5 * mag[r, gc] - 1e-30).all(), "a stored entry is not active"
    tol = 2.0 ** -8 * ref.abs() + 1e-5 * mag[r, gc] + 1e-30
    assert ((v - ref).abs() <= tol).all(), "stored value differs from bf16(g)"
    # unflagged rows: the stored set is the whole active set (every unambiguous active entry present)
    full = ~flag.bool()
    dense = torch.zeros(M, N, device=x.device, dtype=torch.bool)
    dense[r, gc] = True
    miss = ref_active & ~dense & full[:, None]
    assert not miss.any(), f"{int(miss.sum())} active entries of unflagged rows are missing"


FUSED_CASES = [(1, 576, 1536), (7, 2048, 5632), (129, 576, 1536), (1000, 2048, 5632), (300, 4096, 11008),
               (4096, 2048, 8192)]


@pytest.mark.parametrize("M,K,N", FUSED_CASES)
@pytest.mark.parametrize("S", [32, 256])
@pytest.mark.parametrize("overlap", [False, True])
def test_fused_d2t_vs_fp32(ffn, M, K, N, S, overlap):
    """The tensor-core d2t with the TwELL epilogue against float64 math, on adversarial rows (heavy, whole tile,
    all active, all zero, NaN/+-Inf), odd M (partial row tiles), poisoned outputs, both slot counts, both epilogues
    (ping-pong tiles whose consumer warps write TwELL / compaction warps overlapping the next tile)."""
    x, wg, _, _ = make_problem(M, K, N, 0.01, seed=M + K + S + int(overlap))
    ext = _fused_or_skip(x, wg)
    T = N // 256
    packed = torch.full((M, T, S), -7, device=DEV, dtype=torch.int32)
    counts = torch.full((M, T), -7, device=DEV, dtype=torch.int32)
    flag = torch.zeros(M, device=DEV, dtype=torch.int32)
    ext.d2t_gemm(x, wg, packed, counts, flag, overlap, 0)
    torch.cuda.synchronize()
    check_twell_vs_fp32(packed, counts, flag, x, wg, S)


@pytest.mark.parametrize("overlap,ctas", [(False, 1), (False, 3), (True, 1), (True, 3)])
def test_fused_d2t_persistent_grid(ffn, overlap, ctas):
    """Any persistent grid size gives the same TwELL as the full grid and the other epilogue (one CTA walks every
    tile, its warpgroups alternating in ping-pong; 3 share them unevenly)."""
    M, K, N = 700, 576, 1536
    x, wg, _, _ = make_problem(M, K, N, 0.03, seed=ctas)
    ext = _fused_or_skip(x, wg)
    outs = []
    for ov, c in ((overlap, ctas), (not overlap, 0)):
        packed = torch.full((M, N // 256, 32), -7, device=DEV, dtype=torch.int32)
        counts = torch.full((M, N // 256), -7, device=DEV, dtype=torch.int32)
        flag = torch.zeros(M, device=DEV, dtype=torch.int32)
        ext.d2t_gemm(x, wg, packed, counts, flag, ov, c)
        outs.append((packed, counts, flag))
    torch.cuda.synchronize()
    check_twell_vs_fp32(*outs[0], x, wg, 32)
    (p0, c0, f0), (p1, c1, f1) = outs
    assert torch.equal(c0, c1) and torch.equal(f0, f1)
    valid = (torch.arange(32, device=DEV)[None, None, :] < c0[:, :, None]) & (c0 <= 32)[:, :, None]
    assert torch.equal(p0[valid], p1[valid])


def test_fused_d2t_op_and_ffn_use_it(ffn):
    """twell_d2t and the FFN take the fused d2t by default on sm_90, and the result matches the cuBLAS d2t up
    to entries within rounding of zero; KernelConfig(d2t="cublas") switches back."""
    from sfl.kernels.config import KernelConfig

    M, K, N = 3000, 2048, 5632
    x, wg, wu, wd = make_problem(M, K, N, 0.005, seed=5)
    _fused_or_skip(x, wg)
    poison()
    fused = ffn.twell_d2t(x, wg, 32)
    torch.cuda.synchronize()
    check_twell_vs_fp32(*fused, x, wg, 32)
    plan = new_plan(mode="sparse")
    y = run(ffn, x, wg, wu, wd, plan=plan)
    torch.cuda.synchronize()
    assert plan.info()["d2t"] == "fused"
    check(y, x, wg, wu, wd, True)
    cub = ffn.twell_d2t(x, wg, 32, config=KernelConfig(d2t="cublas"))
    plan2 = new_plan(mode="sparse", d2t="cublas")
    y2 = run(ffn, x, wg, wu, wd, plan=plan2)
    torch.cuda.synchronize()
    assert plan2.info()["d2t"] == "cublas"
    check(y2, x, wg, wu, wd, True)
    differ = (fused[1] != cub[1]).sum().item()
    assert differ <= 0.001 * fused[1].numel(), f"{differ} tile counts differ between fused and cuBLAS d2t"


def test_unaligned_input_is_copied(ffn):
    """An x whose data pointer is not 16-byte aligned (contiguous, but at an odd element offset) is copied to an
    aligned buffer (the kernels use 16-byte loads) and the result is exact, on every path."""
    M, K, N = 1000, 576, 1536
    x, wg, wu, wd = make_problem(M + 1, K, N, 0.01, seed=9, adversarial=False)
    flat = x.reshape(-1)[1: 1 + M * K].view(M, K)   # contiguous, offset by one bf16 element
    assert flat.is_contiguous() and flat.data_ptr() % 16 != 0
    for rows, mode in ((3, "sparse"), (40, "sparse"), (M, "sparse"), (M, "dense")):   # decode sizes, TwELL, dense
        xs = flat[:rows]
        poison()
        y = ffn.sparse_gated_ffn(xs, wg, wu, wd, mode=mode)
        torch.cuda.synchronize()
        check(y, xs, wg, wu, wd, True)


# ---------------------------------------------------------------------------------------------------------------
# Non-finite values (kernels/FORMAT.md, "Non-finite values", CUDA table). Public API only, small shapes, one value
# injected into x or one weight entry. M = 2 / 4 and 40 / 200 reach the fused-decode, decode_rows and eager paths
# at the default thresholds; the assertions hold on whichever path runs.
_NONFINITE = {"+inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
_NF_NEURON, _NF_FEATURE = 6, 5   # the poisoned weight entry: neuron 6, feature 5 (features 0..2 steer activity)


def _nonfinite_problem(M: int, gated: bool, where: str, value: float, seed: int):
    """K 128, N 512, ~1% active (every tile far below S slots); `value` in two rows of x or in one weight entry."""
    x, wg, wu, wd = make_problem(M, 128, 512, 0.01, seed, gated=gated, adversarial=False)
    j, k = _NF_NEURON, _NF_FEATURE
    if where == "x":
        # feature k reaches one neuron positively: with x[1, k] = +Inf only neuron j is active in row 1 (g = +Inf),
        # the others have g = -Inf, and gated dense forms 0 * Inf = NaN there; a path that skipped them would
        # give +-Inf instead of NaN
        first = wg if gated else wu
        first[:, k] = -first[:, k].abs()
        first[j, k] = first[j, k].abs()
        x[1, k] = value
        x[M - 1, k + 3] = value
    elif where == "w_gate":
        wg[j, k] = value           # reaches neuron j's gate pre-activation in every row
    elif where in ("w_up", "w_down"):
        (wg if gated else wu)[j, 0] = 0.0   # neuron j active in about half the rows: both cases occur
        if where == "w_up":
            wu[j, k] = value
        else:
            wd[k, j] = value
    return x, wg, wu, wd


def _nonfinite_masks(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)


def _assert_rows_like_dense(y: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    """On the given rows: NaN, +Inf, -Inf exactly where the dense result has them, the finite rest close."""
    for a, b, name in zip(_nonfinite_masks(y[rows]), _nonfinite_masks(ref[rows]), ("NaN", "+Inf", "-Inf")):
        assert torch.equal(a, b), f"{what}: {name} at {int(a.sum())} entries, dense bf16 at {int(b.sum())}"
    fin = torch.isfinite(ref[rows])
    if fin.any():
        assert rel(y[rows][fin], ref[rows][fin]) < 2e-2, what


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ffn_call(ffn, x, wg, wu, wd, gated: bool, mode: str) -> torch.Tensor:
    if gated:
        return ffn.sparse_gated_ffn(x, wg, wu, wd, mode=mode)
    return ffn.sparse_nongated_ffn(x, wu, wd, mode=mode)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("where", ["x", "w_gate", "w_up", "w_down"])
@pytest.mark.parametrize("value", list(_NONFINITE))
@pytest.mark.parametrize("M", [4, 40, 200])
def test_nonfinite_dense_mode_like_torch(ffn, gated, where, value, M):
    """mode="dense" is the dense FFN: NaN, +Inf and -Inf exactly where bf16 PyTorch puts them, every row."""
    if where == "w_gate" and not gated:
        pytest.skip("the non-gated FFN has no w_gate")
    x, wg, wu, wd = _nonfinite_problem(M, gated, where, _NONFINITE[value], seed=M + 1)
    poison()
    y = _ffn_call(ffn, x, wg, wu, wd, gated, "dense")
    torch.cuda.synchronize()
    _assert_rows_like_dense(y, dense(x, wg, wu, wd, gated), torch.ones(M, dtype=torch.bool, device=DEV), "dense mode")


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("where", ["x", "w_gate", "w_up", "w_down"])
@pytest.mark.parametrize("value", list(_NONFINITE))
@pytest.mark.parametrize("M", [2, 4, 40, 200])
def test_nonfinite_sparse_mode_as_specified(ffn, gated, where, value, M):
    """mode="sparse", per FORMAT.md's CUDA table:
    - a row whose gate pre-activation has a non-finite entry is flagged: computed by the dense backup (exactly
      dense's NaN/+-Inf) above decode_max_m, or NaN-filled at decode sizes;
    - a non-finite w_up row j (gated) or w_down column j is not reproduced at inactive neurons: rows where j is
      active match dense, rows where it is inactive are finite (dense: NaN there, 0 * Inf);
    - every other row matches dense."""
    if where == "w_gate" and not gated:
        pytest.skip("the non-gated FFN has no w_gate")
    x, wg, wu, wd = _nonfinite_problem(M, gated, where, _NONFINITE[value], seed=M + 2)
    g = F.linear(x, wg if gated else wu)
    flagged = ~torch.isfinite(g).all(1)
    tiles = (F.relu(g[~flagged]) != 0).reshape(-1, 2, 256).sum(-1)
    assert tiles.numel() == 0 or int(tiles.max()) <= 24, "precondition: no tile near the slot limit S = 32 (no overflow row)"
    poison()
    y = _ffn_call(ffn, x, wg, wu, wd, gated, "sparse")
    torch.cuda.synchronize()
    ref = dense(x, wg, wu, wd, gated)
    for r in flagged.nonzero().flatten().tolist():
        row = torch.tensor([r], device=DEV)
        if not bool(torch.isnan(y[r]).all()):   # not NaN-filled: then it is the dense backup, exact
            _assert_rows_like_dense(y, ref, row, f"flagged row {r}")
    rest = ~flagged
    if where == "w_down" or (where == "w_up" and gated):
        active_j = F.relu(g[:, _NF_NEURON]) != 0
        _assert_rows_like_dense(y, ref, rest & active_j, "rows where the poisoned neuron is active")
        skipped = rest & ~active_j
        assert skipped.any() and bool(torch.isfinite(y[skipped]).all()), "rows where the poisoned neuron is inactive"
    else:
        _assert_rows_like_dense(y, ref, rest, "unflagged rows")
    if where == "x":   # the poisoned rows (1 and M - 1) are flagged, and (gated) dense is non-finite in every entry there
        assert flagged[1] and flagged[M - 1] and int(flagged.sum()) == len({1, M - 1})
        assert not gated or not bool(torch.isfinite(ref[flagged]).any())


def test_plan_freed_while_capturing_leaves_the_capture_intact(ffn):
    """A layer's plan whose handle dies while a CUDA graph is being captured (Python's cyclic GC runs at any time, for
    instance while inductor records another model's compiled step) is destroyed only after the capture: destroying it
    frees its pinned slot, and cudaFreeHost would invalidate the capture. The graph records and replays."""
    import gc

    from sfl.kernels.config import KernelConfig
    from sfl.kernels.twell import ops

    x, wg, wu, wd = make_problem(64, 128, 512, 0.05, seed=3, adversarial=False)
    plan = ops.Plan(KernelConfig())
    ffn.sparse_gated_ffn(x, wg, wu, wd, plan=plan)   # the C++ plan, its pinned slot and event
    torch.cuda.synchronize()
    a = torch.randn(1000, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b = a * 2
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b = a * 2
        del plan
        gc.collect()
    a.copy_(torch.arange(1000, device=DEV, dtype=torch.float32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(b, a * 2)
    later = ops.Plan(KernelConfig())   # a free outside any capture destroys the waiting plan too
    ffn.sparse_gated_ffn(x, wg, wu, wd, plan=later)
    del later
    torch.cuda.synchronize()
