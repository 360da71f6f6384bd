"""Semantics of the pure-PyTorch format reference (kernels/reference.py, spec in kernels/FORMAT.md).

Round trips d2t/t2d and d2h/h2d on random sparse matrices with adversarial rows, the word
layout, FFNs through each format against the dense FFN, and input validation. CPU only, fast.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfl.kernels import reference as ref
from sfl.kernels.reference import (
    Hybrid,
    TwELL,
    activation_stats,
    canonical,
    d2h,
    d2t,
    gated_ffn_dense,
    gated_ffn_hybrid,
    gated_ffn_twell,
    h2d,
    nongated_ffn_dense,
    nongated_ffn_hybrid,
    nongated_ffn_twell,
    pack_words,
    t2d,
    unpack_words,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ----------------------------------------------------------------------------------------
# random sparse matrices with adversarial rows
# ----------------------------------------------------------------------------------------
@st.composite
def sparse_matrices(draw):
    """(h [M, N], tile_n, slots): random sparsity plus optional full rows/tiles, empty rows,
    NaN/inf/negative values and -0.0 (which is *not* active)."""
    tile_n = draw(st.sampled_from([8, 16, 32]))
    n = tile_n * draw(st.integers(1, 4))
    m = draw(st.sampled_from([1, 2, 3, 5, 8, 13, 31]))
    slots = draw(st.integers(1, tile_n))
    density = draw(st.sampled_from([0.0, 0.03, 0.15, 0.5, 1.0]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    extras = draw(st.sets(st.sampled_from(["full_row", "full_tile", "empty_row", "nan", "inf", "negative", "negzero"])))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    vals = torch.randn(m, n, generator=g)
    if "negative" not in extras:
        vals = vals.abs() + 1e-3  # post-ReLU-like values, bounded away from 0 after any cast
    h = torch.where(torch.rand(m, n, generator=g) < density, vals, torch.zeros(()))
    r = int(torch.randint(m, (1,), generator=g))
    c = int(torch.randint(n, (1,), generator=g))
    if "full_row" in extras:
        h[r] = vals[r]
    if "full_tile" in extras:  # one tile active for every row
        t0 = (c // tile_n) * tile_n
        h[:, t0:t0 + tile_n] = vals[:, t0:t0 + tile_n]
    if "empty_row" in extras:
        h[(r + 1) % m] = 0
    if "nan" in extras:
        h[r, c] = float("nan")
    if "inf" in extras:
        h[(r + 2) % m, (c + 3) % n] = float("-inf")
    if "negzero" in extras:
        h[r, (c + 1) % n] = -0.0
    return h.to(dtype), tile_n, slots


def _true_tile_counts(h: torch.Tensor, tile_n: int) -> np.ndarray:
    """Independent oracle (numpy): active (!= 0, NaN active) entries per (row, tile)."""
    a = h.float().numpy()
    active = (a != 0) | np.isnan(a)
    return active.reshape(a.shape[0], -1, tile_n).sum(-1)


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exact equality with NaN == NaN (and -0.0 == 0.0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------
# words
# ----------------------------------------------------------------------------------------
@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)), min_size=1, max_size=64))
def test_pack_unpack_roundtrip_any_bf16_bits(pairs):
    bits = torch.tensor([b for b, _ in pairs], dtype=torch.int32)
    cols = torch.tensor([c for _, c in pairs], dtype=torch.int32)
    vals = bits.to(torch.int16).view(torch.bfloat16)  # every bf16 pattern incl. NaN, inf, -0
    words = pack_words(vals, cols)
    assert words.dtype == torch.int32
    # layout: unsigned 32-bit word == bits << 16 | col
    assert [w & 0xFFFFFFFF for w in words.tolist()] == [(b << 16) | c for b, c in pairs]
    v2, c2 = unpack_words(words)
    assert v2.dtype == torch.bfloat16 and c2.dtype == torch.int32
    assert torch.equal(v2.view(torch.int16), vals.view(torch.int16))
    assert torch.equal(c2, cols)


def test_pack_rejects_wide_column():
    with pytest.raises(ValueError, match="65535"):
        pack_words(torch.ones(1), torch.tensor([65536]))


def test_worked_example_from_format_md():
    h = torch.zeros(2, 16)
    h[0, 1], h[0, 6], h[0, 9] = 1.5, 0.25, 3.0
    h[1, 0], h[1, 2], h[1, 5], h[1, 12] = 1.0, 2.0, 0.5, -2.0
    tw = d2t(h, tile_n=8, slots=2)
    assert tw.counts.tolist() == [[2, 1], [3, 1]]
    assert tw.overflow_rows().tolist() == [1]
    assert [w & 0xFFFFFFFF for w in tw.packed[0].flatten().tolist()] == [0x3FC00001, 0x3E800006, 0x40400001, 0]
    assert tw.packed[1, 1, 0].item() == -1073741820  # 0xC0000004: -2.0 at local column 4 (sign bit set)
    with pytest.raises(ValueError, match="overflow"):
        t2d(tw)
    _assert_same(t2d(tw, backup=(torch.tensor([1]), h[1:2])), h.bfloat16())


# ----------------------------------------------------------------------------------------
# TwELL round trip
# ----------------------------------------------------------------------------------------
@SETTINGS
@given(sparse_matrices())
def test_twell_roundtrip(case):
    h, tile_n, slots = case
    m, n = h.shape
    tw = d2t(h, tile_n, slots)
    counts = _true_tile_counts(h, tile_n)
    assert tw.packed.shape == (m, n // tile_n, slots) and tw.packed.dtype == torch.int32
    assert np.array_equal(tw.counts.numpy(), counts)  # true counts, never capped
    overflow = np.nonzero((counts > slots).any(1))[0]
    assert tw.overflow_rows().tolist() == overflow.tolist()
    assert tw.nbytes == 4 * m * (n // tile_n) * (slots + 1)

    rows = tw.overflow_rows()
    _assert_same(t2d(tw, backup=(rows, h[rows])), h.to(torch.bfloat16))
    if overflow.size:
        with pytest.raises(ValueError, match="overflow"):
            t2d(tw)
        if overflow.size > 1:  # a backup missing one overflow row is also refused
            with pytest.raises(ValueError, match="overflow"):
                t2d(tw, backup=(rows[1:], h[rows[1:]]))
    else:
        _assert_same(t2d(tw), h.to(torch.bfloat16))

    # reference writes valid slots in ascending column order and zero-fills the rest
    ok = ~tw.overflow_mask()
    assert torch.equal(canonical(tw).packed[ok], tw.packed[ok])


@SETTINGS
@given(sparse_matrices(), st.integers(0, 2**31 - 1))
def test_twell_slot_order_is_irrelevant(case, seed):
    """A producer may fill a tile's slots in any order: canonical() and t2d() see the same."""
    h, tile_n, slots = case
    tw = d2t(h, tile_n, slots)
    g = torch.Generator().manual_seed(seed)
    # permute the valid slots of each (row, tile) among themselves; scribble on invalid slots
    noise = torch.rand(tw.packed.shape, generator=g)
    key = torch.where(tw.valid_mask(), noise, 2.0 + noise)
    shuffled = torch.gather(tw.packed, -1, key.argsort(-1))
    junk = torch.randint(-2**31, 2**31 - 1, tw.packed.shape, generator=g, dtype=torch.int64).to(torch.int32)
    valid_after = torch.gather(tw.valid_mask(), -1, key.argsort(-1))
    shuffled = torch.where(valid_after, shuffled, junk)
    tw2 = TwELL(shuffled, tw.counts.clone(), tw.n_cols, tile_n, slots)
    assert torch.equal(canonical(tw2).packed, canonical(tw).packed)
    rows = tw.overflow_rows()
    _assert_same(t2d(tw2, backup=(rows, h[rows])), t2d(tw, backup=(rows, h[rows])))


def test_twell_corrupt_column_is_detected():
    h = torch.zeros(1, 16)
    h[0, 3] = 1.0
    tw = d2t(h, tile_n=16, slots=4)
    tw.packed[0, 0, 0] = pack_words(torch.ones(1), torch.tensor([40]))[0]
    with pytest.raises(ValueError, match="corrupt"):
        t2d(tw)


# ----------------------------------------------------------------------------------------
# Hybrid round trip
# ----------------------------------------------------------------------------------------
@SETTINGS
@given(sparse_matrices(), st.integers(1, 140))
def test_hybrid_roundtrip(case, width):
    h, _, _ = case
    m, n = h.shape
    hy = d2h(h, width)
    true_nnz = _true_tile_counts(h, n).sum(1)
    assert hy.ell_col.dtype == torch.int32 and hy.ell_val.dtype == h.dtype and hy.nnz.dtype == torch.int32
    assert np.array_equal(hy.nnz.numpy(), true_nnz)
    heavy = np.nonzero(true_nnz > width)[0]
    assert hy.backup_rows.dtype == torch.int64 and hy.backup_rows.tolist() == heavy.tolist()
    assert hy.backup.shape == (heavy.size, n)
    _assert_same(h2d(hy), h)  # lossless, any number of heavy rows
    # light rows: columns ascending, exactly the active ones; padding -1 / 0
    for r in np.nonzero(true_nnz <= width)[0][:4]:
        k = int(true_nnz[r])
        a = h[r].float()
        expect = torch.nonzero((a != 0) | a.isnan()).flatten().to(torch.int32)
        assert torch.equal(hy.ell_col[r, :k], expect)
        assert (hy.ell_col[r, k:] == -1).all() and (hy.ell_val[r, k:] == 0).all()
    assert torch.equal(canonical(hy).ell_col, hy.ell_col)


def test_hybrid_inconsistent_backup_rows_refused():
    h = torch.zeros(3, 8)
    h[1] = 1.0
    hy = d2h(h, width=2)
    assert hy.backup_rows.tolist() == [1]
    bad = Hybrid(hy.ell_col, hy.ell_val, hy.nnz, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8), 8, 2)
    with pytest.raises(ValueError, match="backup_rows"):
        h2d(bad)


# ----------------------------------------------------------------------------------------
# FFN through the formats == dense FFN
# ----------------------------------------------------------------------------------------
def _bf16_gemm_leaks_nan() -> bool:
    """True where the CPU bf16 GEMM (oneDNN) smears a NaN into the row before it. Seen with torch 2.11
    (oneDNN 3.10): with an inner dim > 32 and not a multiple of 32 and >= 17 rows, output row r-1 reads
    past its end into row r, so a NaN/Inf in row r of the input makes output row r-1 NaN too."""
    a = torch.zeros(64, 48, dtype=torch.bfloat16)
    a[5, 0] = float("nan")
    return int(torch.nn.functional.linear(a, torch.ones(8, 48, dtype=torch.bfloat16)).isnan().any(dim=1).sum()) != 1


@pytest.fixture(autouse=True, scope="module")
def _sound_bf16_gemm():
    """The NaN checks below compare against the dense FFN (F.linear), which must itself keep NaN in its row;
    the format paths' dense rows use F.linear too. Where oneDNN's bf16 GEMM does not, use the other CPU GEMMs."""
    was = torch.backends.mkldnn.enabled
    if _bf16_gemm_leaks_nan():
        torch.backends.mkldnn.enabled = False
        assert not _bf16_gemm_leaks_nan()
    yield
    torch.backends.mkldnn.enabled = was


def _ffn_problem(g: torch.Generator, m: int, k: int, n: int, dtype: torch.dtype, patterns: set[str]):
    """x [m, k] and weights where feature 0 of x is a per-row 'bias' input, so each row's
    activity is controlled: normal rows ~2% active, heavy rows ~25%, dense rows ~all."""
    x = torch.randn(m, k, generator=g)
    w_gate = torch.randn(n, k, generator=g) / k**0.5
    w_up = torch.randn(n, k, generator=g) / k**0.5
    w_down = torch.randn(k, n, generator=g) / n**0.5
    x[:, 0] = 1.0
    w_gate[:, 0] = -2.0  # pre-activation ~ N(-2, 1): ~2% active
    w_up[:, 0] = -2.0  # same sparsity for the non-gated FFN (relu(x w_up^T))
    r = torch.randperm(m, generator=g)
    if "heavy" in patterns:
        x[r[: max(1, m // 4)], 0] = 0.3  # ~25% active
    if "dense_row" in patterns:
        x[r[0], 0] = -3.0  # ~all active
    if "whole_tile" in patterns:  # columns 0..7 (a whole tile for tile_n <= 8) active in all rows
        w_gate[:8, 0] = 4.0
        w_up[:8, 0] = 4.0
    if "zero_row" in patterns:
        x[r[-1]] = 0.0
    if "nan" in patterns:
        x[r[min(1, m - 1)], 1] = float("nan")
    return [t.to(dtype) for t in (x, w_gate, w_up, w_down)]


def _run(fmt: str, gated: bool, x, wg, wu, wd, tile_n, slots, width, method):
    if fmt == "twell":
        if gated:
            return gated_ffn_twell(x, wg, wu, wd, tile_n, slots, method=method)
        return nongated_ffn_twell(x, wu, wd, tile_n, slots, method=method)
    if gated:
        return gated_ffn_hybrid(x, wg, wu, wd, width, method=method)
    return nongated_ffn_hybrid(x, wu, wd, width, method=method)


def _dense(gated: bool, x, wg, wu, wd):
    return gated_ffn_dense(x, wg, wu, wd) if gated else nongated_ffn_dense(x, wu, wd)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(["twell", "hybrid"]),
    gated=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    method=st.sampled_from(["csr", "gather"]),
    m=st.sampled_from([1, 2, 7, 33, 64]),
    k=st.sampled_from([8, 24, 64]),
    tile_n=st.sampled_from([8, 16, 32]),
    n_tiles=st.integers(1, 4),
    slots_div=st.sampled_from([1, 2, 4, 8]),
    width=st.sampled_from([1, 4, 16, 200]),
    patterns=st.sets(st.sampled_from(["heavy", "dense_row", "whole_tile", "zero_row", "nan"])),
    seed=st.integers(0, 2**31 - 1),
)
def test_ffn_through_format_matches_dense(fmt, gated, dtype, method, m, k, tile_n, n_tiles, slots_div, width, patterns, seed):
    n = tile_n * n_tiles
    slots = tile_n // slots_div
    g = torch.Generator().manual_seed(seed)
    x, wg, wu, wd = _ffn_problem(g, m, k, n, dtype, patterns)
    y = _run(fmt, gated, x, wg, wu, wd, tile_n, slots, width, method)
    y_dense = _dense(gated, x, wg, wu, wd)
    assert y.dtype == dtype and y.shape == (m, k)
    # NaN propagates exactly like the dense path (a NaN in x makes the whole row NaN)
    assert torch.equal(y.isnan(), y_dense.isnan())
    ok = ~y_dense.isnan().any(dim=1)
    if dtype == torch.float32:
        scale = y_dense[ok].abs().max() if ok.any() else torch.tensor(0.0)
        err = (y[ok] - y_dense[ok]).abs().max() if ok.any() else torch.tensor(0.0)
        assert err <= 1e-5 * scale + 1e-30, f"fp32 rel err {float(err / scale):.2e}"
    else:
        # flash-attention rule: error vs an fp64 truth at most 2x the dense bf16 path's own error
        truth = _dense(gated, *(t.double() for t in (x, wg, wu, wd)))
        err_fmt = (y[ok].double() - truth[ok]).abs().max() if ok.any() else 0.0
        err_dense = (y_dense[ok].double() - truth[ok]).abs().max() if ok.any() else 0.0
        scale = truth[ok].abs().max() if ok.any() else 0.0
        assert err_fmt <= 2 * err_dense + 1e-3 * scale + 1e-6, f"{err_fmt} vs dense {err_dense}"


@pytest.mark.parametrize("method", ["csr", "gather"])
@pytest.mark.parametrize("gated", [False, True])
def test_ffn_nan_row_stays_in_its_row(gated, method):
    """The hypothesis example that failed on torch 2.11 (twell, bf16, m=33, k=24, n=48, NaN in x row 4): the
    dense FFN made row 3 NaN as well (its bf16 GEMM, see _bf16_gemm_leaks_nan). Exactly the NaN row is NaN,
    in the format paths and in the dense path."""
    g = torch.Generator().manual_seed(0)
    x, wg, wu, wd = _ffn_problem(g, 33, 24, 48, torch.bfloat16, {"nan"})
    want = x.isnan().any(dim=1, keepdim=True).expand(33, 24)
    assert int(want[:, 0].sum()) == 1
    assert torch.equal(_dense(gated, x, wg, wu, wd).isnan(), want)
    for fmt in ("twell", "hybrid"):
        assert torch.equal(_run(fmt, gated, x, wg, wu, wd, 16, 16, 1, method).isnan(), want), fmt


@pytest.mark.parametrize("fmt", ["twell", "hybrid"])
@pytest.mark.parametrize("gated", [True, False])
def test_ffn_adversarial_fixed_case(fmt, gated):
    """All adversarial patterns at once, with overflow certain (slots=2, width=4), fp32 and bf16."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, wg, wu, wd = _ffn_problem(g, 48, 32, 64, dtype, {"heavy", "dense_row", "whole_tile", "zero_row", "nan"})
        y = _run(fmt, gated, x, wg, wu, wd, 16, 2, 4, None)
        y_dense = _dense(gated, x, wg, wu, wd)
        torch.testing.assert_close(y, y_dense, equal_nan=True, rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-5 if dtype == torch.float32 else 2e-2)
        assert y.isnan().any(dim=1).sum() == 1  # only the NaN row


def test_ffn_zero_activity_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    x, wg, wu, wd = _ffn_problem(g, 24, 16, 32, torch.float32, set())
    x3 = x.reshape(2, 3, 4, 16)
    y = gated_ffn_twell(x3, wg, wu, wd, tile_n=16, slots=4)
    assert y.shape == (2, 3, 4, 16)
    torch.testing.assert_close(y, gated_ffn_dense(x3, wg, wu, wd), rtol=1e-5, atol=1e-6)
    # nothing active at all -> exact zeros
    y0 = nongated_ffn_hybrid(torch.zeros(5, 16), wu, wd, width=2)
    assert torch.equal(y0, torch.zeros(5, 16))


def test_ffn_stats_match_activation_stats():
    g = torch.Generator().manual_seed(2)
    x, wg, wu, wd = _ffn_problem(g, 40, 16, 64, torch.float32, {"heavy", "dense_row"})
    h = torch.relu(x @ wg.T)
    _, st_tw = gated_ffn_twell(x, wg, wu, wd, tile_n=16, slots=4, return_stats=True)
    st_h = activation_stats(h, tile_n=16, slots=4)
    assert torch.equal(st_tw["nnz_per_token"], st_h["nnz_per_token"])
    assert st_tw["nnz_per_token"].dtype == torch.int32
    assert st_tw["n_overflow_rows"] == st_h["n_overflow_rows"] > 0
    _, st_hy = gated_ffn_hybrid(x, wg, wu, wd, width=8, return_stats=True)
    assert torch.equal(st_hy["nnz_per_token"], st_h["nnz_per_token"])
    assert st_hy["n_overflow_rows"] == int((st_h["nnz_per_token"] > 8).sum())


def test_activation_stats_hand_example():
    h = torch.zeros(3, 8)
    h[0, :4] = 1.0  # tile 0 holds 4 > slots=3: overflow
    h[1, 5] = float("nan")  # NaN is active
    h[2, 1] = -0.0  # -0.0 is not
    s = activation_stats(h.reshape(3, 1, 8), tile_n=4, slots=3)  # leading dims are flattened
    assert s["nnz_per_token"].tolist() == [4, 1, 0]
    assert s["nnz_mean"] == pytest.approx(5 / 3) and s["nnz_max"] == 4
    assert s["tile_max_count"].tolist() == [4, 1] and s["max_tile_count"] == 4
    assert s["n_overflow_rows"] == 1 and s["overflow_frac"] == pytest.approx(1 / 3)
    assert s["neuron_active"].tolist() == [True] * 4 + [False, True, False, False]
    assert s["dead_neurons"] == 3 and s["dead_frac"] == pytest.approx(3 / 8)


def test_csr_and_gather_backends_agree():
    g = torch.Generator().manual_seed(3)
    x, wg, wu, wd = _ffn_problem(g, 64, 32, 128, torch.float64, {"heavy"})
    a = gated_ffn_twell(x, wg, wu, wd, tile_n=32, slots=8, method="csr")
    b = gated_ffn_twell(x, wg, wu, wd, tile_n=32, slots=8, method="gather")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a, gated_ffn_dense(x, wg, wu, wd), rtol=1e-12, atol=1e-12)


def test_containers_move_and_size():
    h = torch.relu(torch.randn(6, 32, generator=torch.Generator().manual_seed(4)))
    tw = d2t(h, tile_n=16, slots=4).to("cpu")
    assert tw.n_tiles == 2 and tw.compression == 4.0 and tw.nbytes == 4 * 6 * 2 * 4 + 4 * 6 * 2
    hy = d2h(h, width=8).to("cpu")
    assert hy.nbytes == sum(t.numel() * t.element_size() for t in (hy.ell_col, hy.ell_val, hy.nnz, hy.backup_rows, hy.backup))


# ----------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------
_X, _WG, _WU, _WD = torch.randn(4, 8), torch.randn(32, 8), torch.randn(32, 8), torch.randn(8, 32)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: d2t(torch.zeros(2, 24), tile_n=16, slots=4), r"multiple of tile_n=16.*tile_n=8"),
        (lambda: d2t(torch.zeros(2, 32), tile_n=16, slots=17), r"slots must be in \[1, tile_n=16\]"),
        (lambda: d2t(torch.zeros(2, 32), tile_n=16, slots=0), "slots must be"),
        (lambda: d2t(torch.zeros(2, 1 << 17), tile_n=1 << 17, slots=4), "16-bit"),
        (lambda: d2t(torch.zeros(2, 3, 32), tile_n=16, slots=4), "2-D"),
        (lambda: d2t(torch.zeros(2, 32, dtype=torch.int32), tile_n=16, slots=4), "floating-point"),
        (lambda: d2h(torch.zeros(2, 32), width=0), "width"),
        (lambda: t2d(d2t(torch.ones(2, 16), tile_n=16, slots=4), backup=(torch.tensor([0]), torch.ones(1, 8))), r"\[R, N\]"),
        (lambda: t2d(d2t(torch.ones(2, 16), tile_n=16, slots=4), backup=(torch.tensor([0, 0]), torch.ones(2, 16))), "repeat"),
        (lambda: t2d(d2t(torch.ones(2, 16), tile_n=16, slots=4), backup=(torch.tensor([5]), torch.ones(1, 16))), r"\[0, 2\)"),
        (lambda: TwELL(torch.zeros(2, 2, 4, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int32), 32, 16, 4), "int32"),
        (lambda: TwELL(torch.zeros(2, 2, 4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), 32, 16, 4), "counts"),
        (lambda: gated_ffn_twell(_X, _WG, _WU, _WD.t()), "down_proj.weight"),
        (lambda: gated_ffn_twell(_X, _WG, _WU.t(), _WD), r"w_up must have shape \[N, K\]"),
        (lambda: gated_ffn_dense(_X, _WG.double(), _WU, _WD), "dtype"),
        (lambda: nongated_ffn_hybrid(_X.bfloat16(), _WU, _WD), "dtype"),
        (lambda: gated_ffn_twell(_X, _WG, _WU, _WD, tile_n=12, slots=4), "multiple of tile_n=12"),
        (lambda: nongated_ffn_twell(_X, _WU, _WD, tile_n=16, slots=32), "slots must be"),
        (lambda: gated_ffn_hybrid(_X, _WG, _WU, _WD, width=-1), "width"),
        (lambda: gated_ffn_twell(_X.long(), _WG, _WU, _WD), "floating-point"),
        (lambda: activation_stats(torch.zeros(4, 30), tile_n=16, slots=4), "multiple of tile_n"),
        (lambda: canonical(torch.zeros(2)), "TwELL or Hybrid"),
    ],
)
def test_bad_inputs_raise_helpful_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reference_on_gpu_matches_cpu():
    g = torch.Generator().manual_seed(5)
    x, wg, wu, wd = _ffn_problem(g, 256, 64, 512, torch.bfloat16, {"heavy", "dense_row", "nan"})
    y_cpu = gated_ffn_twell(x, wg, wu, wd)
    y_gpu = gated_ffn_twell(*(t.cuda() for t in (x, wg, wu, wd)))
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, equal_nan=True, rtol=2e-2, atol=2e-2)
    h = torch.relu(x @ wg.T).cuda()
    tw = d2t(h)
    assert torch.equal(tw.packed.cpu(), d2t(h.cpu()).packed)
    rows = tw.overflow_rows()
    _assert_same(t2d(tw, backup=(rows, h[rows])).cpu(), h.cpu().bfloat16())
    _assert_same(h2d(d2h(h, 16)).cpu(), h.cpu())


def test_module_exports():
    for name in ref.__all__:
        assert hasattr(ref, name), name


@pytest.mark.parametrize("fmt", ["twell", "hybrid"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ffn_through_format_gradients_match_dense(fmt, gated, dtype):
    """The reference is differentiable (used by the model's 'reference' MLP path)."""
    g = torch.Generator().manual_seed(6)
    # light rows only (all through the sparse path), then with heavy / overflowing rows
    for patterns in (set(), {"heavy", "dense_row"}):
        ins = [t.requires_grad_() for t in _ffn_problem(g, 40, 16, 64, dtype, patterns)]
        used = ins if gated else [ins[0], ins[2], ins[3]]
        cot = torch.randn(40, 16, generator=g).to(dtype)
        y = _run(fmt, gated, *ins, 16, 4, 8, None)
        grads = torch.autograd.grad(y, used, cot)
        grads_dense = torch.autograd.grad(_dense(gated, *ins), used, cot)
        for a, b in zip(grads, grads_dense):
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            rel = (a.float() - b.float()).norm() / b.float().norm()
            assert rel <= tol, f"relative gradient error {float(rel):.2e} ({patterns})"


# ----------------------------------------------------------------------------------------
# non-finite values: NaN and +-Inf exactly where the dense FFN puts them (FORMAT.md)
# ----------------------------------------------------------------------------------------
_NONFINITE = {"+inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def _assert_same_nonfinite(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float) -> None:
    a, b = a.detach().double(), b.detach().double()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        got, want = test(a), test(b)
        assert torch.equal(got, want), f"{what}: {test.__name__} at {int(got.sum())} entries, dense {int(want.sum())}"
    ok = torch.isfinite(b)
    assert (a[ok] - b[ok]).norm() <= rtol * b[ok].norm() + 1e-12, what


def _inject(x, wg, wu, wd, where: str, value: float) -> None:
    if where == "x":
        x[3, 5] = value
        x[9, 2] = value
    elif where == "w_gate":
        wg[6, 5] = value  # reaches neuron 6's pre-activation in every row
    elif where == "w_up":
        wu[6, 5] = value
    elif where == "w_down":
        wd[5, 6] = value


@pytest.mark.parametrize("fmt", ["twell", "hybrid"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("where", ["x", "w_gate", "w_up", "w_down"])
@pytest.mark.parametrize("value", list(_NONFINITE))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ffn_nonfinite_like_dense(fmt, gated, where, value, dtype):
    """Forward through each format, and autograd through it, put NaN/+-Inf where the dense FFN does. Two layouts:
    lossless (slots = tile_n, width >= N: only the non-finite rule sends rows dense) and tight (slots 2, width 4)."""
    if where == "w_gate" and not gated:
        pytest.skip("the non-gated FFN has no w_gate")
    g = torch.Generator().manual_seed(7)
    for slots, width in ((16, 64), (2, 4)):
        x, wg, wu, wd = _ffn_problem(g, 16, 8, 64, torch.float64, {"heavy"})
        _inject(x, wg, wu, wd, where, _NONFINITE[value])
        ins = [t.to(dtype).requires_grad_() for t in (x, wg, wu, wd)]
        used = ins if gated else [ins[0], ins[2], ins[3]]
        y = _run(fmt, gated, *ins, 16, slots, width, None)
        y_dense = _dense(gated, *ins)
        rtol = 1e-10 if dtype == torch.float64 else 3e-2
        _assert_same_nonfinite(y, y_dense, f"y (slots {slots}, width {width})", rtol)
        cot = torch.randn(16, 8, generator=g).to(dtype)
        grads = torch.autograd.grad(y, used, cot)
        grads_dense = torch.autograd.grad(y_dense, used, cot)
        for i, (a, b) in enumerate(zip(grads, grads_dense)):
            _assert_same_nonfinite(a, b, f"grad {i} (slots {slots}, width {width})", rtol)


def test_dense_rows_mask_rule():
    """The rule itself: rows with a non-finite pre-activation; every row when w_up or w_down is not finite."""
    g = torch.zeros(4, 8)
    g[1, 2] = float("inf")
    g[3, 0] = float("nan")
    x, w_up, w_down = torch.ones(4, 3), torch.ones(8, 3), torch.ones(3, 8)
    assert ref.dense_rows_mask(g, w_up, w_down, x).tolist() == [False, True, False, True]
    x[0] = 2e38  # finite x and w_up, but x w_up^T overflows float32 in row 0: dense forms 0 * Inf there
    assert ref.dense_rows_mask(g, w_up, w_down, x).tolist() == [True, True, False, True]
    assert ref.dense_rows_mask(g, None, w_down, x).tolist() == [False, True, False, True]  # non-gated: no u
    x[0] = 1.0
    g[2, 5] = float("-inf")  # -Inf is inactive after relu, but dense forms 0 * u there too
    assert ref.dense_rows_mask(g, None, w_down, x).tolist() == [False, True, True, True]
    w_down[1, 7] = float("nan")
    assert ref.dense_rows_mask(g, w_up, w_down, x).all()
    w_down[1, 7] = 1.0
    w_up[0, 0] = float("-inf")
    assert ref.dense_rows_mask(g, w_up, w_down, x).all()
    assert ref.dense_rows_mask(g, None, w_down, x).tolist() == [False, True, True, True]  # non-gated: w_up is g's


@pytest.mark.parametrize("path", ["twell", "hybrid", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_up_overflow_at_inactive_neuron_like_dense(path, dtype):
    """Finite x and weights whose u = x w_up^T overflows at a neuron inactive in every row: dense forms 0 * Inf
    = NaN there, so the rows where u overflows are NaN throughout, and the reference must put NaN (and +-Inf)
    in exactly those entries, forward and backward."""
    g = torch.Generator().manual_seed(0)
    m, k, n = 6, 8, 32
    x = torch.randn(m, k, generator=g).abs()
    x[::2, 1:] *= 1e-3  # even rows: u of the big neuron stays finite
    x[:, 0] = 1.0
    w_gate = torch.randn(n, k, generator=g) / 3
    w_gate[:, 0] = -1.5  # few active neurons: every row is light (no dense backup of its own)
    w_up = torch.randn(n, k, generator=g) / 3
    w_down = torch.randn(k, n, generator=g) / 5
    w_gate[3] = -1.0  # neuron 3 is inactive in every row ...
    w_up[3] = torch.finfo(dtype).max / 2  # ... and its u overflows in the odd rows
    ins = [t.to(dtype).requires_grad_() for t in (x, w_gate, w_up, w_down)]
    cot = torch.randn(m, k, generator=g).to(dtype)
    if path == "train":
        plain = [t.detach() for t in ins]
        y, _, saved = ref.train_ffn_forward(*plain, width=8)
        grads = ref.train_ffn_backward(cot, torch.zeros(()), *plain, saved)
    else:
        y = gated_ffn_twell(*ins, tile_n=16, slots=16) if path == "twell" else gated_ffn_hybrid(*ins, width=8)
        grads = torch.autograd.grad(y, ins, cot)
    y_dense = gated_ffn_dense(*ins)
    assert torch.isnan(y_dense).all(dim=1).tolist() == [False, True] * 3
    _assert_same_nonfinite(y, y_dense, f"y ({path}, {dtype})", 3e-2)
    for i, (a, b) in enumerate(zip(grads, torch.autograd.grad(y_dense, ins, cot))):
        _assert_same_nonfinite(a, b, f"grad {i} ({path}, {dtype})", 3e-2)


def test_hybrid_extra_dense_rows_round_trip():
    """d2h(keep_dense=...) puts extra rows in the backup; h2d still reproduces h; a missing heavy row is refused."""
    h = torch.zeros(4, 8)
    h[0, 1] = 2.0
    h[1, :5] = 1.0  # heavy at width 3
    h[2, 3] = float("inf")
    hy = d2h(h, 3, keep_dense=torch.tensor([False, False, True, False]))
    assert hy.backup_rows.tolist() == [1, 2] and hy.backup_mask().tolist() == [False, True, True, False]
    assert not hy.valid_mask()[2].any()
    _assert_same(h2d(hy), h)
    with pytest.raises(ValueError, match="keep_dense"):
        d2h(h, 3, keep_dense=torch.tensor([1, 0, 0, 0]))
    bad = Hybrid(hy.ell_col, hy.ell_val, hy.nnz, torch.tensor([2]), hy.backup[1:], 8, 3)
    with pytest.raises(ValueError, match="heavy row"):
        h2d(bad)
