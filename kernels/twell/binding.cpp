// Torch-facing wrappers of the single TwELL kernels, for tests, benchmarks and the training op's dense path: check
// tensors, take raw pointers and the CURRENT torch stream, call the extern "C" launchers (launchers.h), turn any CUDA
// error into a Python exception. The inference op itself (dispatch, workspaces, backup) is runtime.cpp.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "launchers.h"
#include "../common/slices.h"

// the loader passes -DSFL_SRC_HASH=<hex> (no quotes: shell/ninja quoting differs); stringified here
#define SFL_STR2(x) #x
#define SFL_STR(x) SFL_STR2(x)
#ifndef SFL_SRC_HASH
#define SFL_SRC_HASH unknown
#endif

namespace {

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "TwELL kernel '", what, "' failed: ", cudaGetErrorString(e),
              " (invalid value = unsupported shape/knob; see kernels/README.md)");
}

void req(const at::Tensor& t, const char* name, at::ScalarType dt, int dim) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dt, name, " must be ", c10::toString(dt), ", got ", t.scalar_type());
  // integers go through std::to_string, as in runtime.cpp (streaming one into the message crashed there)
  TORCH_CHECK(t.dim() == dim, name, " must have ", std::to_string(dim), " dims, got ", std::to_string(t.dim()));
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (call .contiguous())");
}

int32_t* i32(const at::Tensor& t) { return t.data_ptr<int32_t>(); }

// g: [rows, ld] bf16 (row-major, unit column stride; rows may be a view of a larger scratch buffer).
void compact(const at::Tensor& g, int64_t N, at::Tensor packed, at::Tensor counts, at::Tensor flag) {
  TORCH_CHECK(g.is_cuda() && g.scalar_type() == at::kBFloat16 && g.dim() == 2 && g.stride(1) == 1,
              "compact: g must be a CUDA bf16 [rows, N] tensor with unit column stride");
  TORCH_CHECK(g.size(1) >= N, "compact: g has fewer than N columns");
  const int64_t rows = g.size(0);
  req(packed, "packed", at::kInt, 3);
  req(counts, "counts", at::kInt, 2);
  req(flag, "flag", at::kInt, 1);
  TORCH_CHECK(packed.size(0) == rows && counts.size(0) == rows && flag.size(0) == rows, "compact: row mismatch");
  TORCH_CHECK(packed.size(1) * 256 == N && counts.size(1) == packed.size(1), "compact: tile mismatch");
  const c10::cuda::CUDAGuard guard(g.device());
  check(twell_compact_launch(g.data_ptr(), g.stride(0), (int)rows, (int)N, (int)packed.size(2), i32(packed), i32(counts),
               i32(flag), c10::cuda::getCurrentCUDAStream().stream()),
        "compact");
}

void gated_up(const at::Tensor& x, const at::Tensor& wu, const at::Tensor& packed, const at::Tensor& counts,
              const at::Tensor& flag, at::Tensor hval, int64_t tiles_per_warp) {
  req(x, "x", at::kBFloat16, 2);
  req(wu, "w_up", at::kBFloat16, 2);
  req(packed, "packed", at::kInt, 3);
  req(counts, "counts", at::kInt, 2);
  req(flag, "flag", at::kInt, 1);
  req(hval, "hval", at::kFloat, 3);
  const int64_t M = x.size(0), K = x.size(1), N = wu.size(0);
  TORCH_CHECK(wu.size(1) == K, "w_up must be [N, K]");
  TORCH_CHECK(packed.size(0) == M && packed.size(1) * 256 == N && hval.sizes() == packed.sizes(),
              "gated_up: packed/hval shape mismatch");
  const c10::cuda::CUDAGuard guard(x.device());
  check(twell_gated_up_launch(x.data_ptr(), wu.data_ptr(), (int)M, (int)K, (int)N, (int)packed.size(2),
                              (int)tiles_per_warp, i32(packed), i32(counts), i32(flag), hval.data_ptr<float>(),
                              c10::cuda::getCurrentCUDAStream().stream()),
        "gated_up");
}

// hval: fp32 [M, T, S] (gated) or an empty tensor (non-gated: values from packed). yacc: fp32 [M, K] zeroed when
// tiles_per_warp < n_tiles (atomic split), else may be empty.
void down(const at::Tensor& wdt, const at::Tensor& packed, const at::Tensor& counts, const at::Tensor& flag,
          const at::Tensor& hval, at::Tensor y, at::Tensor yacc, int64_t nb, int64_t tiles_per_warp,
          int64_t nan_fill) {
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(packed, "packed", at::kInt, 3);
  req(counts, "counts", at::kInt, 2);
  req(flag, "flag", at::kInt, 1);
  req(y, "y", at::kBFloat16, 2);
  const int64_t M = y.size(0), K = y.size(1), N = wdt.size(0);
  TORCH_CHECK(wdt.size(1) == K, "w_down_t must be [N, K] (w_down transposed)");
  TORCH_CHECK(packed.size(0) == M && packed.size(1) * 256 == N, "down: packed shape mismatch");
  const float* hv = nullptr;
  if (hval.numel() > 0) {
    req(hval, "hval", at::kFloat, 3);
    TORCH_CHECK(hval.sizes() == packed.sizes(), "down: hval shape mismatch");
    hv = hval.data_ptr<float>();
  }
  float* acc = nullptr;
  if (yacc.numel() > 0) {
    req(yacc, "yacc", at::kFloat, 2);
    TORCH_CHECK(yacc.sizes() == y.sizes(), "down: yacc shape mismatch");
    acc = yacc.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(y.device());
  check(twell_down_launch(wdt.data_ptr(), (int)M, (int)K, (int)N, (int)packed.size(2), (int)nb, (int)tiles_per_warp,
                          (int)nan_fill, i32(packed), i32(counts), i32(flag), hv, y.data_ptr(), acc,
                          c10::cuda::getCurrentCUDAStream().stream()),
        "down");
}

// up and down in one kernel (the op's large-M path): x/w_up empty for the non-gated op (h = the stored value).
void up_down(const at::Tensor& x, const at::Tensor& wu, const at::Tensor& wdt, const at::Tensor& packed,
             const at::Tensor& counts, const at::Tensor& flag, at::Tensor y, int64_t nan_fill) {
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(packed, "packed", at::kInt, 3);
  req(counts, "counts", at::kInt, 2);
  req(flag, "flag", at::kInt, 1);
  req(y, "y", at::kBFloat16, 2);
  const int64_t M = y.size(0), K = y.size(1), N = wdt.size(0);
  TORCH_CHECK(wdt.size(1) == K, "w_down_t must be [N, K] (w_down transposed)");
  TORCH_CHECK(packed.size(0) == M && packed.size(1) * 256 == N && counts.size(0) == M && counts.size(1) == packed.size(1),
              "up_down: packed/counts shape mismatch");
  const bool gated = x.numel() > 0;
  if (gated) {
    req(x, "x", at::kBFloat16, 2);
    req(wu, "w_up", at::kBFloat16, 2);
    TORCH_CHECK(x.sizes() == y.sizes() && wu.size(0) == N && wu.size(1) == K, "up_down: x/w_up shape mismatch");
  }
  const c10::cuda::CUDAGuard guard(y.device());
  check(twell_up_down_launch(gated ? x.data_ptr() : nullptr, gated ? wu.data_ptr() : nullptr, wdt.data_ptr(), (int)M,
                             (int)K, (int)N, (int)packed.size(2), (int)nan_fill, i32(packed), i32(counts), i32(flag),
                             y.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()),
        "up_down");
}

// the large-M path's two steps (what the runtime runs from up_list_min_m rows): up_list writes each unflagged row's
// entries (column, h) into lcol / lh [M, T * S] and their count into lnnz; down_slices sums y = sum h W_dT[j]
// slice-major (common/slices.cu). x/w_up empty for the non-gated op.
void up_list(const at::Tensor& x, const at::Tensor& wu, const at::Tensor& packed, const at::Tensor& counts,
             const at::Tensor& flag, at::Tensor lcol, at::Tensor lh, at::Tensor lnnz, int64_t N) {
  req(packed, "packed", at::kInt, 3);
  req(counts, "counts", at::kInt, 2);
  req(flag, "flag", at::kInt, 1);
  req(lcol, "lcol", at::kInt, 2);
  req(lh, "lh", at::kFloat, 2);
  req(lnnz, "lnnz", at::kInt, 1);
  const int64_t M = packed.size(0), T = packed.size(1), S = packed.size(2);
  TORCH_CHECK(T * 256 == N && counts.size(0) == M && counts.size(1) == T && flag.size(0) == M &&
                  lcol.size(0) == M && lcol.size(1) == T * S && lh.sizes() == lcol.sizes() && lnnz.size(0) == M,
              "up_list: shapes (lcol / lh must be [M, n_tiles * S])");
  const bool gated = x.numel() > 0;
  int64_t K = 64;  // non-gated: K unused but checked
  if (gated) {
    req(x, "x", at::kBFloat16, 2);
    req(wu, "w_up", at::kBFloat16, 2);
    K = x.size(1);
    TORCH_CHECK(x.size(0) == M && wu.size(0) == N && wu.size(1) == K, "up_list: x/w_up shape mismatch");
  }
  const c10::cuda::CUDAGuard guard(packed.device());
  check(twell_up_list_launch(gated ? x.data_ptr() : nullptr, gated ? wu.data_ptr() : nullptr, (int)M, (int)K, (int)N,
                             (int)S, i32(packed), i32(counts), i32(flag), i32(lcol), lh.data_ptr<float>(), i32(lnnz),
                             c10::cuda::getCurrentCUDAStream().stream()),
        "up_list");
}

void down_slices(const at::Tensor& wdt, const at::Tensor& lcol, const at::Tensor& lnnz, const at::Tensor& flag,
                 const at::Tensor& lh, at::Tensor y, int64_t rows) {
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(lcol, "lcol", at::kInt, 2);
  req(lh, "lh", at::kFloat, 2);
  req(lnnz, "lnnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  req(y, "y", at::kBFloat16, 2);
  const int64_t M = y.size(0), K = y.size(1);
  TORCH_CHECK(wdt.size(1) == K && lcol.size(0) == M && lh.sizes() == lcol.sizes() && lnnz.size(0) == M &&
                  flag.size(0) == M, "down_slices: shapes");
  const c10::cuda::CUDAGuard guard(y.device());
  check(sfl_slices_launch(wdt.data_ptr(), nullptr, (int)M, (int)K, (int)lcol.size(1), i32(lcol), i32(lnnz), i32(flag),
                          lh.data_ptr<float>(), nullptr, y.data_ptr(), (int)rows,
                          c10::cuda::getCurrentCUDAStream().stream()),
        "down_slices (rows per block 1, 2 or 4; 0: the default)");
}

void finalize(const at::Tensor& yacc, const at::Tensor& flag, at::Tensor y, int64_t nan_fill) {
  req(yacc, "yacc", at::kFloat, 2);
  req(flag, "flag", at::kInt, 1);
  req(y, "y", at::kBFloat16, 2);
  TORCH_CHECK(yacc.sizes() == y.sizes() && flag.size(0) == y.size(0), "finalize: shape mismatch");
  const c10::cuda::CUDAGuard guard(y.device());
  check(twell_finalize_launch(yacc.data_ptr<float>(), i32(flag), (int)y.size(0), (int)y.size(1), (int)nan_fill,
                              y.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()),
        "finalize");
}

// Dense path: out = relu(g) * u (gated, u non-empty) or relu(g); out may be g or u (in place). g/u/out
// [rows, >=N] bf16 with unit column stride. rownnz int32 [rows] (or empty: skipped); stats int64 [2] zeroed by
// the caller (or empty): += (active entries of unflagged rows, flagged rows), flagged = a 256-column tile with
// more than S active entries, a row with more than row_cap, or a non-finite gate value. l1_row fp32 [rows]
// (or empty): per-row sums of |out|.
void relu_mul_stats(const at::Tensor& g, const at::Tensor& u, at::Tensor out, int64_t N, int64_t S,
                    int64_t row_cap, at::Tensor rownnz, at::Tensor stats, at::Tensor l1_row, int64_t flag_from) {
  auto mat = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.stride(1) == 1 &&
                    t.size(0) == g.size(0) && t.size(1) >= N,
                "relu_mul_stats: ", name, " must be a CUDA bf16 [rows, >=N] tensor with unit column stride");
  };
  mat(g, "g");
  mat(out, "out");
  const int64_t rows = g.size(0);
  const void* up = nullptr;
  int64_t ldu = 0;
  if (u.numel() > 0) {
    mat(u, "u");
    up = u.data_ptr();
    ldu = u.stride(0);
  }
  int32_t* rn = nullptr;
  if (rownnz.numel() > 0) {
    req(rownnz, "rownnz", at::kInt, 1);
    TORCH_CHECK(rownnz.size(0) == rows, "relu_mul_stats: rownnz must be [rows]");
    rn = i32(rownnz);
  }
  unsigned long long* st = nullptr;
  if (stats.numel() > 0) {
    req(stats, "stats", at::kLong, 1);
    TORCH_CHECK(stats.size(0) == 2, "relu_mul_stats: stats must be int64 [2]");
    st = reinterpret_cast<unsigned long long*>(stats.data_ptr<int64_t>());
  }
  float* lp = nullptr;
  if (l1_row.numel() > 0) {
    req(l1_row, "l1_row", at::kFloat, 1);
    TORCH_CHECK(l1_row.size(0) == rows, "relu_mul_stats: l1_row must be fp32 [rows]");
    lp = l1_row.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(g.device());
  check(twell_relu_mul_stats_launch(g.data_ptr(), g.stride(0), up, ldu, out.data_ptr(), out.stride(0), (int)rows,
                                    (int)N, (int)S, (int)std::min<int64_t>(row_cap, INT32_MAX), (int)flag_from, rn, st,
                                    lp, nullptr,
                                    c10::cuda::getCurrentCUDAStream().stream()),
        "relu_mul_stats");
}

// out: int64 [2], zeroed by the caller; += (sum of counts over unflagged rows, number of flagged rows). extra
// (int32 [rows], or None): more active entries per row, added to its count.
void row_stats(const at::Tensor& counts, const at::Tensor& flag, at::Tensor out,
               const c10::optional<at::Tensor>& extra) {
  req(counts, "counts", at::kInt, 2);
  req(flag, "flag", at::kInt, 1);
  req(out, "out", at::kLong, 1);
  TORCH_CHECK(flag.size(0) == counts.size(0) && out.size(0) == 2, "row_stats: shape mismatch");
  if (extra.has_value()) {
    req(*extra, "extra", at::kInt, 1);
    TORCH_CHECK(extra->size(0) == counts.size(0), "row_stats: extra must be int32 [rows]");
  }
  const c10::cuda::CUDAGuard guard(counts.device());
  check(twell_row_stats_launch(i32(counts), i32(flag), extra.has_value() ? i32(*extra) : nullptr,
                               (int)counts.size(0), (int)(counts.size(1) * 256),
                               reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()), nullptr,
                               c10::cuda::getCurrentCUDAStream().stream()),
        "row_stats");
}

// Fused decode (rows <= 8): gate GEMV + ReLU + (gated) up + down into the zeroed fp32 yacc [M, K]; nnz/flag int32
// [M] zeroed. wu empty = non-gated (wg is then W_up). finalize() converts yacc to bf16 (flagged rows NaN).
void decode_fused(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wdt,
                  at::Tensor yacc, at::Tensor nnz, at::Tensor flag) {
  req(x, "x", at::kBFloat16, 2);
  req(wg, "w_gate", at::kBFloat16, 2);
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(yacc, "yacc", at::kFloat, 2);
  req(nnz, "nnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  const int64_t M = x.size(0), K = x.size(1), N = wg.size(0);
  TORCH_CHECK(M <= 8, "decode_fused: at most 8 rows, got ", std::to_string(M));
  TORCH_CHECK(wg.size(1) == K && wdt.size(0) == N && wdt.size(1) == K, "decode_fused: weight shape mismatch");
  TORCH_CHECK(yacc.size(0) == M && yacc.size(1) == K && nnz.size(0) == M && flag.size(0) == M,
              "decode_fused: output shape mismatch");
  const void* wup = nullptr;
  if (wu.numel() > 0) {
    req(wu, "w_up", at::kBFloat16, 2);
    TORCH_CHECK(wu.sizes() == wg.sizes(), "decode_fused: w_up must be [N, K]");
    wup = wu.data_ptr();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  check(twell_decode_fused_launch(x.data_ptr(), wg.data_ptr(), wup, wdt.data_ptr(), (int)M, (int)K, (int)N,
                                  yacc.data_ptr<float>(), i32(nnz), i32(flag),
                                  c10::cuda::getCurrentCUDAStream().stream()),
        "decode_fused");
}

// Fused d2t (d2t_gemm.cu, sm_90a): the gate GEMM on the tensor cores with the TwELL epilogue; no dense g.
// x [M, K], w [N, K] bf16 contiguous and 16-byte aligned; packed [M, N/256, S] and counts [M, N/256] are fully
// written; flag [M] must be zeroed by the caller. overlap: the epilogue variant (true: compaction warps overlap
// the next tile's mainloop; false: ping-pong tiles, the consumer warps write TwELL themselves). max_ctas > 0 caps
// the persistent grid (0: one CTA per SM).
void d2t_gemm(const at::Tensor& x, const at::Tensor& w, at::Tensor packed, at::Tensor counts, at::Tensor flag,
              bool overlap, int64_t max_ctas) {
  req(x, "x", at::kBFloat16, 2);
  req(w, "w_gate", at::kBFloat16, 2);
  req(packed, "packed", at::kInt, 3);
  req(counts, "counts", at::kInt, 2);
  req(flag, "flag", at::kInt, 1);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "d2t_gemm: w_gate must be [N, K] with K = x.size(1)");
  TORCH_CHECK(K % 64 == 0 && N % 256 == 0, "d2t_gemm: needs K % 64 == 0 and N % 256 == 0, got K=", std::to_string(K),
              " N=", std::to_string(N));
  TORCH_CHECK(packed.size(0) == M && packed.size(1) * 256 == N && counts.size(0) == M && counts.size(1) * 256 == N &&
                  flag.size(0) == M,
              "d2t_gemm: packed/counts/flag shape mismatch");
  TORCH_CHECK(M <= INT32_MAX && N <= INT32_MAX, "d2t_gemm: too many rows");
  TORCH_CHECK((reinterpret_cast<uintptr_t>(x.data_ptr()) | reinterpret_cast<uintptr_t>(w.data_ptr())) % 16 == 0,
              "d2t_gemm: x and w_gate must be 16-byte aligned (call .clone() on an offset view)");
  const c10::cuda::CUDAGuard guard(x.device());
  check(twell_d2t_gemm_launch(x.data_ptr(), w.data_ptr(), (int)M, (int)N, (int)K, (int)packed.size(2), i32(packed),
                              i32(counts), i32(flag), overlap ? 1 : 0, (int)max_ctas,
                              c10::cuda::getCurrentCUDAStream().stream()),
        "d2t_gemm");
}

bool d2t_gemm_supported(int64_t device) { return twell_d2t_gemm_supported((int)device) != 0; }

std::string source_hash() { return SFL_STR(SFL_SRC_HASH); }

}  // namespace

namespace sfl_runtime {  // runtime.cpp
void plan_free(int64_t id);
void plan_reset(int64_t id);
py::dict plan_info(int64_t id);
std::tuple<bool, int64_t, int64_t> train_decide(int64_t id, const std::string& spec, bool gated, int64_t mode,
                                                int64_t M, int64_t width, bool in_backward);
void train_measure(int64_t id, const std::string& spec, bool gated, const at::Tensor& stats, int64_t rows, int64_t n,
                   int64_t light_at, int64_t flagged_at, int64_t widest_at);
void plan_poll(int64_t id);
}  // namespace sfl_runtime

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compact", &compact, "bf16 gate pre-activation rows -> ReLU -> TwELL (packed, counts, flag)");
  m.def("d2t_gemm", &d2t_gemm, "fused d2t (sm_90a): tensor-core gate GEMM whose epilogue writes TwELL");
  m.def("d2t_gemm_supported", &d2t_gemm_supported, "whether this device can run d2t_gemm (sm_90 + tensor-map encoder)");
  m.def("decode_fused", &decode_fused, "rows <= 8: fused gate GEMV + up + down into an fp32 accumulator");
  m.def("gated_up", &gated_up, "h = g * (x . W_u[j]) for every stored TwELL entry (fp32)");
  m.def("down", &down, "y = TwELL(h) @ W_d^T (fp32 accumulate)");
  m.def("up_down", &up_down, "y = TwELL(h) @ W_d^T with h = g * (x . W_u[j]) (gated) in one kernel, one block per row");
  m.def("up_list", &up_list, "the large-M up step: each row's TwELL entries and h = g * (x . W_u[j]) as a compact list");
  m.def("down_slices", &down_slices, "the large-M down step: y = sum h W_dT[j] over up_list's entries, slice-major");
  m.def("finalize", &finalize, "fp32 accumulator -> bf16 output");
  m.def("relu_mul_stats", &relu_mul_stats,
        "dense path: relu(g) * u (or relu(g)) in one pass, measuring activity (and the L1 sum)",
        py::arg("g"), py::arg("u"), py::arg("out"), py::arg("N"), py::arg("S"), py::arg("row_cap"), py::arg("rownnz"),
        py::arg("stats"), py::arg("l1_row"), py::arg("flag_from") = 0);
  m.def("row_stats", &row_stats, "sum of counts over unflagged rows and number of flagged rows (dispatch history)",
        py::arg("counts"), py::arg("flag"), py::arg("out"), py::arg("extra") = py::none());
  m.def("plan_free", &sfl_runtime::plan_free, "release a layer's plan (its module is gone)");
  m.def("plan_reset", &sfl_runtime::plan_reset, "forget a layer's measured activity and timings");
  m.def("plan_info", &sfl_runtime::plan_info, "a layer's dispatch state and last call (tests, benchmark logs)");
  m.def("plan_poll", &sfl_runtime::plan_poll, "take in a plan's measurement if it has landed (never waits)");
  m.def("train_decide", &sfl_runtime::train_decide,
        "the training op's next call on a plan: (sparse, ELL width, backup block rows)");
  m.def("train_measure", &sfl_runtime::train_measure,
        "a training call's measurement (device stats, or the op's pinned summary) into its plan's history");
  m.def("source_hash", &source_hash, "hash of the sources this library was built from");
}
