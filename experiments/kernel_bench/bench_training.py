"""Benchmark: forward+backward of the ReLU FFN block with L1, dense autograd vs the sparse training op.

Per configuration (M tokens, activity p, heavy-row fraction), in one run:
- dense: bf16 autograd, three F.linear + relu + mul + L1 (as models' dense MLP), loss grads (gy, gl1);
  also dense without the L1 term (the nine GEMMs alone);
- ours forced sparse, and ours in mode="auto" (after the per-layer history has warmed up);
- CUDA events, warm-up, median of reps, an L2 flush before every repetition; each side alone, one call per repetition
  (the host's latency to the first kernel included), and auto against dense in a steady state (4 back-to-back calls
  per repetition, the two sides alternating);
- peak memory of one fwd+bwd and bytes kept for backward by the block (allocated after forward - before - y);
- outputs and all gradients checked in the same run: rel. error vs fp32 dense (M <= 16384) and vs bf16 dense.
One JSONL row per configuration (with provenance); a table is printed at the end.

    python -m sfl.experiments.kernel_bench.bench_training --out results/kernel_bench/training_h100.jsonl [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from sfl.kernels import reference as ref
from sfl.kernels.config import KernelConfig
from sfl.kernels.train import ops
from sfl.kernels.timing import PairTimer
from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

from ..trainer.provenance import collect

DEV = "cuda"
BF = torch.bfloat16


def make_case(M, K, N, p, heavy, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g)
    x[:, 0] = 1.0
    wg = torch.randn(N, K, device=DEV, generator=g) / K ** 0.5
    wu = torch.randn(N, K, device=DEV, generator=g) / K ** 0.5
    wd = torch.randn(K, N, device=DEV, generator=g) / N ** 0.5
    wg[:, 0] = -torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - p)).item()
    if heavy > 0:
        rows = torch.randperm(M, device=DEV, generator=g)[: max(1, int(round(heavy * M)))]
        x[rows, 1:] *= 4.0
    gy = torch.randn(M, K, device=DEV, generator=g).to(BF)
    return x.to(BF), [w.to(BF).contiguous() for w in (wg, wu, wd)], gy


def dense_block(x, wg, wu, wd, l1=True, count=False):
    a = F.relu(F.linear(x, wg))
    if count:  # what models' dense MLP also does every forward: per-token active counts for logging
        with torch.no_grad():
            (a != 0).sum(1, dtype=torch.int32)
    h = a * F.linear(x, wu)
    y = F.linear(h, wd)
    if not l1:
        return y, None
    return y, h.abs().sum(dtype=torch.float32) / (x.shape[0] * wu.shape[0])


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class TrainCase:
    """One configuration's inputs and the two sides' training steps: dense autograd on HF's nn.Linear layouts, ours
    through the training op with W_d in the model's layout for mlp_impl="cuda" (kernels/layout.py), the same values."""

    def __init__(self, M, K, N, p, heavy, cfg, down_layout):
        x, (wg, wu, wd), gy = make_case(M, K, N, p, heavy, seed=int(p * 1e5) + M + int(heavy * 1e4))
        self.params = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        wd_ours = self.params[3] if down_layout == "row_major" else wd.t().contiguous().t().requires_grad_(True)
        self.ours_params = self.params[:3] + [wd_ours]
        self.gy = gy
        self.gl1 = torch.tensor(1000.0, device=DEV)  # L1 gradient weight (makes the sign(h) term visible in grads)
        self.cfg = cfg
        self.st_auto = DispatchState()

    def dense_step(self, l1=True, count=False):
        for t in self.params:
            t.grad = None
        y, l = dense_block(*self.params, l1=l1, count=count)
        torch.autograd.backward([y, l] if l1 else [y], [self.gy, self.gl1] if l1 else [self.gy])

    def ours_step(self, mode, want_stats=False):
        for t in self.ours_params:
            t.grad = None
        y, l, stats = sparse_gated_ffn_train(*self.ours_params, config=self.cfg, mode=mode,
                                             state=self.st_auto if mode == "auto" else None,
                                             want_stats=want_stats)
        torch.autograd.backward([y, l], [self.gy, self.gl1])
        return stats

    def ours_sparse(self):
        """The forced-sparse forward: (y, l1, stats)."""
        return sparse_gated_ffn_train(*self.ours_params, config=self.cfg, mode="sparse")


GRAD_NAMES = ["y", "l1", "dx", "dw_gate", "dw_up", "dw_down"]


def check_errors(case: TrainCase, check_fp32: bool) -> tuple[dict, bool, dict]:
    """Output, L1 and all gradients of forced sparse against bf16 dense (and fp32 dense when check_fp32), in the
    same run: (errors, all finite, the op's stats)."""
    def outputs(fn, ps):
        for t in ps:
            t.grad = None
        y, l = fn()
        torch.autograd.backward([y, l], [case.gy.to(y.dtype), case.gl1])
        return [y.detach().float(), l.detach().float()] + [t.grad.detach().float() for t in ps]

    o_bf = outputs(lambda: dense_block(*case.params), case.params)
    st_sp = {}

    def sp():
        y, l, s = case.ours_sparse()
        st_sp.update(s)
        return y, l

    o_sp = outputs(sp, case.ours_params)
    err = {"vs_bf16_dense": {n: rel(a, b) for n, a, b in zip(GRAD_NAMES, o_sp, o_bf)}}
    if check_fp32:
        err.update(fp32_errors(case, o_sp, o_bf))
    finite = all(bool(torch.isfinite(t).all()) for t in o_sp)
    return err, finite, st_sp


def fp32_errors(case: TrainCase, o_sp: list, o_bf: list) -> dict:
    """Errors of ours and of bf16 dense against fp32 dense, and whether ours stays within twice bf16's."""
    p32 = [t.detach().float().requires_grad_(True) for t in case.params]
    y32, l32 = dense_block(*p32)
    torch.autograd.backward([y32, l32], [case.gy.float(), case.gl1])
    o32 = [y32.detach(), l32.detach()] + [t.grad for t in p32]
    err = {"ours_vs_fp32": {n: rel(a, b) for n, a, b in zip(GRAD_NAMES, o_sp, o32)},
           "bf16_dense_vs_fp32": {n: rel(a, b) for n, a, b in zip(GRAD_NAMES, o_bf, o32)}}
    err["within_2x_bf16"] = all(err["ours_vs_fp32"][n] <= 2 * err["bf16_dense_vs_fp32"][n] + 1e-6
                                for n in GRAD_NAMES)
    return err


def memory(case: TrainCase, fn_fwd) -> tuple[int, int]:
    """(bytes kept for backward by the block: allocated after forward - before - outputs, peak of one fwd+bwd)."""
    for t in case.ours_params + case.params[3:]:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y, l = fn_fwd()
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size() - l.numel() * l.element_size()
    torch.autograd.backward([y, l], [case.gy, case.gl1])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del y, l
    return kept, peak


def time_steps(case: TrainCase, timer, reps: int) -> dict:
    """Medians (ms) of each side alone, one call per repetition, then auto against dense in a steady state."""
    t = {"dense": timer.time(case.dense_step, reps),
         "dense_nol1": timer.time(lambda: case.dense_step(False), reps),
         "sparse": timer.time(lambda: case.ours_step("sparse"), reps)}
    for _ in range(3):  # history for auto
        case.ours_step("auto")
        torch.cuda.synchronize()
    t["auto"] = timer.time(lambda: case.ours_step("auto"), reps)
    t["auto_path"] = case.st_auto.last_path
    t["dense_cnt"] = timer.time(lambda: case.dense_step(count=True), reps)
    t["auto_cnt"] = timer.time(lambda: case.ours_step("auto", want_stats=True), reps)
    # steady state: 4 back-to-back calls per timed repetition, alternating with the dense side (as layers run in a
    # model, the host ahead of the GPU); the single-call times above also count the host's latency to the first
    # kernel after the flush
    t["st_auto"], t["st_dense"] = timer.time_pair(lambda: case.ours_step("auto"), case.dense_step, reps, calls=4)
    t["st_auto2"], t["st_nol1"] = timer.time_pair(lambda: case.ours_step("auto"), lambda: case.dense_step(False),
                                                  reps, calls=4)

    def fwd_only():
        with torch.no_grad():
            case.ours_sparse()
    t["fwd"] = timer.time(fwd_only, reps)
    return t


def run_config(M, K, N, p, heavy, reps, timer, check_fp32, cfg=None, down_layout="neuron_major"):
    """One configuration's row: errors, memory and times of dense autograd and the training op."""
    case = TrainCase(M, K, N, p, heavy, cfg, down_layout)
    err, finite, st_sp = check_errors(case, check_fp32)
    nnz = st_sp["nnz_per_token"].float()
    kept_d, peak_d = memory(case, lambda: dense_block(*case.params))
    kept_s, peak_s = memory(case, lambda: case.ours_sparse()[:2])
    t = time_steps(case, timer, reps)
    return {
        "M": M, "K": K, "N": N, "p": p, "heavy_frac": heavy, "down_layout": {"ours": down_layout, "dense": "row_major"},
        "nnz_mean": nnz.mean().item(), "nnz_max": nnz.max().item(), "backup_rows": int(st_sp["backup_rows"]),
        "ell_width": st_sp["width"],
        "dense_ms": t["dense"], "dense_noL1_ms": t["dense_nol1"], "sparse_ms": t["sparse"], "auto_ms": t["auto"],
        "auto_path": t["auto_path"], "sparse_fwd_nograd_ms": t["fwd"],
        "speedup_sparse": t["dense"] / t["sparse"], "speedup_auto": t["dense"] / t["auto"],
        "speedup_auto_vs_dense_noL1": t["dense_nol1"] / t["auto"],
        "steady_4calls_ms": {"auto_vs_dense": [t["st_auto"], t["st_dense"]],
                             "auto_vs_dense_noL1": [t["st_auto2"], t["st_nol1"]]},
        "speedup_auto_steady": t["st_dense"] / t["st_auto"],
        "speedup_auto_vs_dense_noL1_steady": t["st_nol1"] / t["st_auto2"],
        "dense_with_counts_ms": t["dense_cnt"], "auto_with_stats_ms": t["auto_cnt"],
        "speedup_auto_with_stats_vs_dense_with_counts": t["dense_cnt"] / t["auto_cnt"],
        "kept_bytes_dense": kept_d, "kept_bytes_sparse": kept_s, "kept_ratio": kept_d / max(1, kept_s),
        "op_kept_bytes": st_sp["kept_bytes"],
        "peak_bytes_dense": peak_d, "peak_bytes_sparse": peak_s,
        "errors": err, "finite": finite,
    }


def light_rows_case(M, K, N, p, seed=7):
    """make_case's inputs and the op's forward outputs at the ELL width a layer's second call takes (its plan's
    width after the first call's measurement): what the per-kernel timings (profile_phases, the lab A/Bs of single
    kernels) run the backward kernels on."""
    x, (wg, wu, wd), gy = make_case(M, K, N, p, 0.0, seed=seed)
    st, cfg = DispatchState(), KernelConfig()
    sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse", state=st, config=cfg)
    torch.cuda.synchronize()
    width = st.decide(cfg, True, "sparse", M, cfg.train_width)[1]
    out = ops.ffn_fwd(x, wg, wu, wd, width, cfg.train_width, 1.0 / (M * N), M, M, False, "cuda")
    return x, (wg, wu, wd), gy, out


def profile_phases(M, K, N, p, reps, timer):
    """Per-kernel times of the sparse path (CUDA events), with the bytes each must move, for the README."""
    ext = ops.load_ext()
    x, (wg, wu, wd), gy, out = light_rows_case(M, K, N, p)
    y, l1, ell_col, ell_a, ell_u, nnz, flag, brow, backup = out[:9]
    W = ell_col.shape[1]
    E = int(nnz.sum())
    wdt = wd.t().contiguous()
    g = torch.empty(M, N, device=DEV, dtype=BF)
    c_ = torch.empty(M, 128, device=DEV, dtype=torch.int32)
    a_ = torch.empty(M, 128, device=DEV, dtype=BF)
    z_ = torch.empty(M, device=DEV, dtype=torch.int32)
    f_ = torch.empty(M, device=DEV, dtype=torch.int32)
    yy = torch.empty(M, K, device=DEV, dtype=BF)
    ra = torch.empty(M, device=DEV)
    l1c = torch.ones(1, device=DEV)
    cg = torch.empty(M, W, device=DEV)
    cu = torch.empty(M, W, device=DEV)
    hh = torch.empty(M, W, device=DEV)
    dx = torch.empty(M, K, device=DEV, dtype=BF)
    hy = ops.saved_hybrid(ell_col, ell_a, nnz, brow, backup, N)
    perm, colptr = ref.csr_by_neuron(hy)
    dwg, dwu, dwd = (torch.empty(N, K, device=DEV, dtype=BF) for _ in range(3))
    kb = K * 2
    res = {"M": M, "p": p, "pairs": E, "ell_width": W}
    phases = {
        "gate_gemm": (lambda: torch.mm(x, wg.t(), out=g), 2 * M * K * N / 1e12, "TFLOP"),
        "compact": (lambda: ext.compact(g, N, c_, a_, z_, f_), M * N * 2 / 1e9, "GB"),
        "fwd_rows": (lambda: ext.fwd_rows(True, x, wu, wdt, ell_col, ell_a, nnz, flag, ell_u, yy, ra),
                     E * 2 * kb / 1e9, "GB"),
        "bwd_rows": (lambda: ext.bwd_rows(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu,
                                          dx), E * 3 * kb / 1e9, "GB"),
        "fwd_block": (lambda: ext.fwd_block(True, x, wu, wdt, ell_col, ell_a, nnz, flag, ell_u, yy, ra),
                      E * 2 * kb / 1e9, "GB"),
        "fwd_coefficients": (lambda: ext.fwd_block(True, x, wu, wdt, ell_col, ell_a, nnz, flag, ell_u, yy[:0], ra,
                                                   hh), E * kb / 1e9, "GB"),
        "y_slices": (lambda: ext.dx_slices(False, wdt, wdt, ell_col, nnz, flag, hh, hh, yy, 1), E * kb / 1e9, "GB"),
        "bwd_block": (lambda: ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu,
                                            dx), E * 3 * kb / 1e9, "GB"),
        "bwd_coefficients": (lambda: ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg,
                                                   cu, dx[:0]), E * kb / 1e9, "GB"),
        "dx_slices": (lambda: ext.dx_slices(True, wg, wu, ell_col, nnz, flag, cg, cu, dx, 1), E * 2 * kb / 1e9, "GB"),
        "csr_by_neuron": (lambda: ref.csr_by_neuron(hy), 0.0, "-"),
        "csr_by_neuron_kernel": (lambda: ext.csr_by_neuron(ell_col, nnz, flag, N), 0.0, "-"),
        "transpose_wd_torch": (lambda: wd.t().contiguous(), K * N * 4 / 1e9, "GB"),
        "transpose_wd_kernel": (lambda: ext.transpose(wd), K * N * 4 / 1e9, "GB"),
        "dense_gemm_same_shape": (lambda: torch.mm(x, wu.t(), out=g), 2 * M * K * N / 1e12, "TFLOP"),
    }
    a = torch.relu(g)
    phases["count_ne_sum_i32"] = (lambda: (a != 0).sum(1, dtype=torch.int32), M * N * 2 / 1e9, "GB")
    phases["count_nonzero"] = (lambda: torch.count_nonzero(a, dim=1), M * N * 2 / 1e9, "GB")
    phases["count_kernel"] = (lambda: ext.count(a), M * N * 2 / 1e9, "GB")
    phases["l1_abs_sum"] = (lambda: a.abs().sum(dtype=torch.float32), M * N * 2 / 1e9, "GB")
    # the backward the op runs since the neuron-major backward: dwd_dh (dW_dT and the light entries' dh dot products, neuron-major
    # over dy slices), dh_coef (cg, cu from them), dx_slices, dw's part 0 (dW_g, dW_u over x slices)
    nb_op = ops.dw_chunks(M)
    part = torch.empty((K // 8 + 31) // 32, M * W, device=DEV)
    phases["dwd_dh"] = (lambda: ext.dwd_dh(nb_op, gy, wdt, perm, colptr, ell_a, ell_u, None, dwd, part),
                        E * kb / 1e9, "GB")
    phases["dh_coef"] = (lambda: ext.dh_coef(True, part, K, perm, colptr, ell_a, ell_u, l1c, cg, cu), 0.0, "-")
    phases["dw_part0"] = (lambda: ext.dw(True, nb_op, x, gy, perm, colptr, ell_a, ell_u, cg, cu, None, None, None,
                                         dwg, dwu, dwd, 0, 1), E * kb / 1e9, "GB")
    for nb in (1, 2, 4, 8):  # dw walks K slices of 256 nb columns; ops.dw_chunks picks nb from M
        phases[f"dw_nb{nb}"] = (lambda nb=nb: ext.dw(True, nb, x, gy, perm, colptr, ell_a, ell_u, cg, cu, None,
                                                       None, None, dwg, dwu, dwd), E * 2 * kb / 1e9, "GB")
    for name, (fn, amount, unit) in phases.items():
        t = timer.time(fn, reps)
        res[name + "_ms"] = t
        if unit != "-":
            res[name + "_" + unit + "_per_s"] = amount / (t / 1e3)
    return res


def t_fmt(v):
    return f"{v:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ms", type=str, default="4096,16384,65536")
    ap.add_argument("--down-layout", choices=["neuron_major", "row_major"], default="neuron_major",
                    help="W_d's storage for our op: the model's (mlp_impl='cuda', kernels/layout.py) or nn.Linear's; "
                         "dense autograd always gets nn.Linear's, as HF users have it")
    args = ap.parse_args(argv)

    cfg = KernelConfig.from_env()  # SFL_KERNEL_TRAIN_* overrides, read once (the op reads no environment)
    prov = collect({"kernel_config": cfg.to_dict()})
    K, N = 2048, 5632
    Ms = [int(m) for m in args.ms.split(",")]
    cases = [(0.005, 0.0), (0.01, 0.0), (0.02, 0.0), (0.05, 0.0), (0.005, 0.01), (0.01, 0.01)]
    if args.quick:
        Ms, cases = [16384], [(0.005, 0.0), (0.01, 0.0), (0.05, 0.0), (0.005, 0.01)]
    timer = PairTimer()
    rows = []
    with open(args.out, "a") as f:
        for p in (0.005, 0.01):
            r = profile_phases(16384, K, N, p, args.reps, timer)
            r["kind"] = "phase_profile"
            r["provenance"] = prov
            f.write(json.dumps(r) + "\n")
            print("profile", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                                         if k not in ("provenance",)}), flush=True)
        for M in Ms:
            for p, heavy in cases:
                t0 = time.time()
                r = run_config(M, K, N, p, heavy, args.reps, timer, check_fp32=M <= 16384, cfg=cfg,
                               down_layout=args.down_layout)
                r["kind"] = "fwd_bwd"
                r["provenance"] = prov
                r["wall_s"] = time.time() - t0
                f.write(json.dumps(r) + "\n")
                f.flush()
                rows.append(r)
                e = r["errors"]
                print(f"M={M} p={p} heavy={heavy}: dense {r['dense_ms']:.2f} (noL1 {r['dense_noL1_ms']:.2f}) "
                      f"sparse {r['sparse_ms']:.2f} auto {r['auto_ms']:.2f} [{r['auto_path']}] "
                      f"x{r['speedup_sparse']:.2f}/x{r['speedup_auto']:.2f} (vs noL1 x"
                      f"{r['speedup_auto_vs_dense_noL1']:.2f}; steady x{r['speedup_auto_steady']:.2f} / noL1 x"
                      f"{r['speedup_auto_vs_dense_noL1_steady']:.2f}) kept x{r['kept_ratio']:.1f} "
                      f"| counts: dense {t_fmt(r['dense_with_counts_ms'])} auto {t_fmt(r['auto_with_stats_ms'])} "
                      f"backup {r['backup_rows']} w {r['ell_width']} ok2x {e.get('within_2x_bf16')} "
                      f"({r['wall_s']:.0f}s)", flush=True)
                torch.cuda.empty_cache()
    print("\n| M | p | heavy | nnz mean/max | backup rows | dense ms (no L1) | sparse ms | auto ms (path) | "
          "speedup sparse / auto | kept MB dense / ours | peak MB dense / ours | 2x bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['M']} | {r['p']:.3f} | {r['heavy_frac']} | {r['nnz_mean']:.0f} / {r['nnz_max']:.0f} | "
              f"{r['backup_rows']} | {r['dense_ms']:.2f} ({r['dense_noL1_ms']:.2f}) | {r['sparse_ms']:.2f} | "
              f"{r['auto_ms']:.2f} ({r['auto_path']}) | {r['speedup_sparse']:.2f}x / {r['speedup_auto']:.2f}x | "
              f"{r['kept_bytes_dense'] / 2**20:.0f} / {r['kept_bytes_sparse'] / 2**20:.1f} | "
              f"{r['peak_bytes_dense'] / 2**20:.0f} / {r['peak_bytes_sparse'] / 2**20:.0f} | "
              f"{r['errors'].get('within_2x_bf16')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
