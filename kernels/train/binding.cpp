// Torch-facing glue for the sparse training kernels: checks tensors, takes raw pointers and the CURRENT torch
// stream, calls the extern "C" launchers in train_kernels.cu (and common/backup_rows.cu), and turns any CUDA error
// into a Python exception.
// The op (sfl_train::ffn_fwd / ffn_bwd, registered at the end) runs its steps here; its dispatch lives in
// kernels/train_ffn.py.
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>

#include "../common/backup_rows.h"
#include "../common/slices.h"

extern "C" {
cudaError_t sfltrain_compact_launch(const void* g, long long ldg, int rows, int N, int W, int Wm, int32_t* ell_col,
                                    void* ell_a, int32_t* nnz, int32_t* flag, int64_t* summary,
                                    cudaStream_t stream);
cudaError_t sfltrain_count_launch(const void* a, long long lda, int rows, int N, int32_t* nnz, cudaStream_t stream);
cudaError_t sfltrain_fwd_rows_launch(int gated, const void* x, const void* wu, const void* wdt, int M, int K, int W,
                                     const int32_t* ell_col, const void* ell_a, const int32_t* nnz,
                                     const int32_t* flag, float* ell_u, void* y, float* rowabs,
                                     cudaStream_t stream);
cudaError_t sfltrain_fwd_block_launch(int gated, const void* x, const void* wu, const void* wdt, int M, int K, int W,
                                      const int32_t* ell_col, const void* ell_a, const int32_t* nnz,
                                      const int32_t* flag, float* ell_u, void* y, float* rowabs, float* hout,
                                      cudaStream_t stream);
cudaError_t sfltrain_bwd_block_launch(int gated, const void* dy, const void* wg, const void* wu, const void* wdt,
                                      int M, int K, int W, const int32_t* ell_col, const void* ell_a,
                                      const float* ell_u, const int32_t* nnz, const int32_t* flag, const float* l1c,
                                      float* cg, float* cu, void* dx, cudaStream_t stream);
cudaError_t sfltrain_bwd_rows_launch(int gated, const void* dy, const void* wg, const void* wu, const void* wdt,
                                     int M, int K, int W, const int32_t* ell_col, const void* ell_a,
                                     const float* ell_u, const int32_t* nnz, const int32_t* flag, const float* l1c,
                                     float* cg, float* cu, void* dx, cudaStream_t stream);
cudaError_t sfltrain_dense_bwd_launch(int gated, void* dh, const void* g, const void* u, const void* h, void* du,
                                      long long n, const float* gl1, float scale, cudaStream_t stream);
cudaError_t sfltrain_dw_launch(int gated, int nb, const void* x, const void* dy, int N, int K, int W,
                               const int64_t* perm, const int64_t* colptr, const void* ell_a, const float* ell_u,
                               const float* cg, const float* cu, const void* add_g, const void* add_u,
                               const void* add_d, void* dwg, void* dwu, void* dwdt, int part0, int parts,
                               cudaStream_t stream);
cudaError_t sfltrain_dwd_dh_launch(int nb, const void* dy, const void* wdt, int N, int K, int W, const int64_t* perm,
                                   const int64_t* colptr, const void* ell_a, const float* ell_u, const void* add_d,
                                   void* dwdt, float* part, long long pstride, cudaStream_t stream);
cudaError_t sfltrain_dh_coef_launch(int gated, const float* part, long long pstride, int K, const int64_t* perm,
                                    const int64_t* colptr, int N, const void* ell_a, const float* ell_u,
                                    const float* l1c, float* cg, float* cu, cudaStream_t stream);
cudaError_t sfltrain_last_active_launch(const void* a, long long lda, int rows, int N, int64_t* last,
                                        cudaStream_t stream);
cudaError_t sfltrain_last_active_ell_launch(const int32_t* ell_col, int W, const int32_t* nnz, const int32_t* flag,
                                            int rows, int N, int64_t* last, cudaStream_t stream);
cudaError_t sfltrain_transpose_launch(const void* src, long long lds, int R, int C, void* dst, cudaStream_t stream);
int sfltrain_csr_rows_per_block(int M);
long long sfltrain_csr_smem_bytes(int N, int W);
cudaError_t sfltrain_csr_by_neuron_launch(const int32_t* ell_col, int W, const int32_t* nnz, const int32_t* flag,
                                          int M, int N, int32_t* cnt, int64_t* total, int64_t* colptr,
                                          int64_t* perm, cudaStream_t stream);
}

// the loader passes -DSFL_SRC_HASH=<hex> (no quotes: shell/ninja quoting differs); stringified here
#define SFL_STR2(x) #x
#define SFL_STR(x) SFL_STR2(x)
#ifndef SFL_SRC_HASH
#define SFL_SRC_HASH unknown
#endif

namespace {

// rows per block of common/slices.cu for the forward's y (over W_dT) and the backward's dx (over W_g and W_u): one,
// so a block retires with its own row's entries (2-3% / 1% faster than 4 at M 8192-65536, the same bits;
// kernels/train/README.md)
constexpr int kFwdSlicesRows = 1, kBwdSlicesRows = 1;

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "sparse training kernel '", what, "' failed: ", cudaGetErrorString(e),
              " (invalid value = unsupported shape/knob; see kernels/train/README.md)");
}

void req(const at::Tensor& t, const char* name, at::ScalarType dt, int dim) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dt, name, " must be ", c10::toString(dt), ", got ", t.scalar_type());
  // integers go through std::to_string, as in runtime.cpp (streaming one into the message crashed there)
  TORCH_CHECK(t.dim() == dim, name, " must have ", std::to_string(dim), " dims, got ", std::to_string(t.dim()));
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (call .contiguous())");
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
int32_t* i32(const at::Tensor& t) { return t.data_ptr<int32_t>(); }
const void* opt(const c10::optional<at::Tensor>& t, const char* name, int64_t N, int64_t K) {
  if (!t.has_value() || !t->defined() || t->numel() == 0) return nullptr;
  req(*t, name, at::kBFloat16, 2);
  TORCH_CHECK(t->size(0) == N && t->size(1) == K, name, " must be [N, K]");
  return t->data_ptr();
}

// g: bf16 [rows, >=N] with unit column stride (a view of the chunk scratch); outputs are row slices.
// summary (optional): int32 [2] accumulating (flagged rows, widest light row); the caller zeroes it once per call.
// summary (optional int64 [4]): see compact_kernel; measure_width: the configured width (>= the ELL's, 0: the ELL's)
// the dispatch measurement counts against.
void compact(const at::Tensor& g, int64_t N, at::Tensor ell_col, at::Tensor ell_a, at::Tensor nnz, at::Tensor flag,
             const c10::optional<at::Tensor>& summary, int64_t measure_width) {
  TORCH_CHECK(g.is_cuda() && g.scalar_type() == at::kBFloat16 && g.dim() == 2 && g.stride(1) == 1,
              "compact: g must be a CUDA bf16 [rows, N] tensor with unit column stride");
  const int64_t rows = g.size(0);
  req(ell_col, "ell_col", at::kInt, 2);
  req(ell_a, "ell_a", at::kBFloat16, 2);
  req(nnz, "nnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  TORCH_CHECK(ell_col.size(0) == rows && ell_a.sizes() == ell_col.sizes() && nnz.size(0) == rows &&
                  flag.size(0) == rows, "compact: row mismatch");
  int64_t* sp = nullptr;
  if (summary.has_value() && summary->defined()) {
    req(*summary, "summary", at::kLong, 1);
    TORCH_CHECK(summary->numel() == 4, "compact: summary must be int64 [4]");
    sp = summary->data_ptr<int64_t>();
  }
  if (measure_width <= 0) measure_width = ell_col.size(1);  // default: measure against the ELL's own width
  TORCH_CHECK(measure_width >= ell_col.size(1), "compact: measure_width must be >= the ELL width");
  const c10::cuda::CUDAGuard guard(g.device());
  check(sfltrain_compact_launch(g.data_ptr(), g.stride(0), (int)rows, (int)N, (int)ell_col.size(1), (int)measure_width,
                                i32(ell_col), ell_a.data_ptr(), i32(nnz), i32(flag), sp, stream()),
        "compact");
}

// block: one block per light row (fwd_block) instead of one warp (fwd_rows). fwd_block with an empty y: the
// coefficients only (u, the L1 row sums and h = a u into `h`, fp32 [M, W]); dx_slices then sums y slice-major.
void fwd_impl(bool block, bool gated, const at::Tensor& x, const at::Tensor& wu, const at::Tensor& wdt,
              const at::Tensor& ell_col, const at::Tensor& ell_a, const at::Tensor& nnz, const at::Tensor& flag,
              at::Tensor ell_u, at::Tensor y, at::Tensor rowabs, at::Tensor h) {
  req(x, "x", at::kBFloat16, 2);
  req(wu, "w_up", at::kBFloat16, 2);
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(ell_col, "ell_col", at::kInt, 2);
  req(ell_a, "ell_a", at::kBFloat16, 2);
  req(nnz, "nnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  req(y, "y", at::kBFloat16, 2);
  req(rowabs, "rowabs", at::kFloat, 1);
  const int64_t M = x.size(0), K = x.size(1);
  const bool with_y = y.numel() > 0;
  TORCH_CHECK(wu.size(1) == K && wdt.size(1) == K && wdt.size(0) == wu.size(0), "fwd_rows: weight shapes");
  TORCH_CHECK(ell_col.size(0) == M && (with_y ? y.sizes() == x.sizes() : block) && rowabs.size(0) == M,
              "fwd_rows: rows (an empty y only for fwd_block)");
  float* hp = nullptr;
  if (!with_y) {
    TORCH_CHECK(h.defined(), "fwd_block: an empty y needs h (fp32, the ELL's shape) for the coefficients");
    req(h, "h", at::kFloat, 2);
    TORCH_CHECK(h.sizes() == ell_col.sizes(), "fwd_block: h shape (the ELL's)");
    hp = h.data_ptr<float>();
  }
  float* up = nullptr;
  if (gated) {
    req(ell_u, "ell_u", at::kFloat, 2);
    TORCH_CHECK(ell_u.sizes() == ell_col.sizes(), "fwd_rows: ell_u shape");
    up = ell_u.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  void* yp = with_y ? y.data_ptr() : nullptr;
  if (block)
    check(sfltrain_fwd_block_launch(gated ? 1 : 0, x.data_ptr(), wu.data_ptr(), wdt.data_ptr(), (int)M, (int)K,
                                    (int)ell_col.size(1), i32(ell_col), ell_a.data_ptr(), i32(nnz), i32(flag), up, yp,
                                    rowabs.data_ptr<float>(), hp, stream()),
          "fwd_block");
  else
    check(sfltrain_fwd_rows_launch(gated ? 1 : 0, x.data_ptr(), wu.data_ptr(), wdt.data_ptr(), (int)M, (int)K,
                                   (int)ell_col.size(1), i32(ell_col), ell_a.data_ptr(), i32(nnz), i32(flag), up, yp,
                                   rowabs.data_ptr<float>(), stream()),
          "fwd_rows");
}

void bwd_impl(bool block, bool gated, const at::Tensor& dy, const at::Tensor& wg, const at::Tensor& wu,
              const at::Tensor& wdt, const at::Tensor& ell_col, const at::Tensor& ell_a, const at::Tensor& ell_u,
              const at::Tensor& nnz, const at::Tensor& flag, const at::Tensor& l1c, at::Tensor cg, at::Tensor cu,
              at::Tensor dx) {
  req(dy, "dy", at::kBFloat16, 2);
  req(wu, "w_up", at::kBFloat16, 2);
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(ell_col, "ell_col", at::kInt, 2);
  req(ell_a, "ell_a", at::kBFloat16, 2);
  req(nnz, "nnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  req(l1c, "l1c", at::kFloat, 1);
  req(cg, "cg", at::kFloat, 2);
  req(dx, "dx", at::kBFloat16, 2);
  const int64_t M = dy.size(0), K = dy.size(1);
  const bool with_dx = dx.numel() > 0;  // bwd_block: an empty dx = the coefficients only (dx_slices adds them up)
  TORCH_CHECK(cg.sizes() == ell_col.sizes() && (with_dx ? dx.sizes() == dy.sizes() : block) && ell_col.size(0) == M,
              "bwd_rows: shapes");
  const void* wgp = nullptr;
  const float* up = nullptr;
  float* cup = nullptr;
  if (gated) {
    req(wg, "w_gate", at::kBFloat16, 2);
    req(ell_u, "ell_u", at::kFloat, 2);
    req(cu, "cu", at::kFloat, 2);
    TORCH_CHECK(ell_u.sizes() == ell_col.sizes() && cu.sizes() == ell_col.sizes(), "bwd_rows: shapes");
    wgp = wg.data_ptr();
    up = ell_u.data_ptr<float>();
    cup = cu.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(dy.device());
  auto* launch = block ? sfltrain_bwd_block_launch : sfltrain_bwd_rows_launch;
  check(launch(gated ? 1 : 0, dy.data_ptr(), wgp, wu.data_ptr(), wdt.data_ptr(), (int)M, (int)K, (int)ell_col.size(1),
               i32(ell_col), ell_a.data_ptr(), up, i32(nnz), i32(flag), l1c.data_ptr<float>(), cg.data_ptr<float>(),
               cup, with_dx ? dx.data_ptr() : nullptr, stream()),
        block ? "bwd_block" : "bwd_rows");
}

// rows: rows per block of common/slices.cu (1, 2 or 4; 0: its default, 4)
void dx_slices(bool gated, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& ell_col, const at::Tensor& nnz,
               const at::Tensor& flag, const at::Tensor& cg, const at::Tensor& cu, at::Tensor dx, int64_t rows) {
  req(wu, "w_up", at::kBFloat16, 2);
  req(ell_col, "ell_col", at::kInt, 2);
  req(nnz, "nnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  req(cg, "cg", at::kFloat, 2);
  req(dx, "dx", at::kBFloat16, 2);
  const int64_t M = dx.size(0), K = dx.size(1);
  TORCH_CHECK(cg.sizes() == ell_col.sizes() && ell_col.size(0) == M && nnz.size(0) == M && flag.size(0) == M &&
                  wu.size(1) == K, "dx_slices: shapes");
  if (gated) {
    req(wg, "w_gate", at::kBFloat16, 2);
    req(cu, "cu", at::kFloat, 2);
    TORCH_CHECK(cu.sizes() == ell_col.sizes() && wg.sizes() == wu.sizes(), "dx_slices: shapes");
  }
  const c10::cuda::CUDAGuard guard(dx.device());
  // gated: dx = sum cg W_g[j] + cu W_u[j]; non-gated: sum cg W_u[j] (common/slices.cu)
  check(sfl_slices_launch(gated ? wg.data_ptr() : wu.data_ptr(), gated ? wu.data_ptr() : nullptr, (int)M, (int)K,
                          (int)ell_col.size(1), i32(ell_col), i32(nnz), i32(flag), cg.data_ptr<float>(),
                          gated ? cu.data_ptr<float>() : nullptr, dx.data_ptr(), (int)rows, stream()),
        "dx_slices (rows per block 1, 2 or 4; 0: the default)");
}

void dw(bool gated, int64_t nb, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& perm,
        const at::Tensor& colptr, const at::Tensor& ell_a, const at::Tensor& ell_u, const at::Tensor& cg,
        const at::Tensor& cu, const c10::optional<at::Tensor>& add_g, const c10::optional<at::Tensor>& add_u,
        const c10::optional<at::Tensor>& add_d, at::Tensor dwg, at::Tensor dwu, at::Tensor dwdt, int64_t part0,
        int64_t parts) {
  req(x, "x", at::kBFloat16, 2);
  req(dy, "dy", at::kBFloat16, 2);
  req(perm, "perm", at::kLong, 1);
  req(colptr, "colptr", at::kLong, 1);
  req(ell_a, "ell_a", at::kBFloat16, 2);
  req(cg, "cg", at::kFloat, 2);
  req(dwu, "dw_up", at::kBFloat16, 2);
  req(dwdt, "dw_down_t", at::kBFloat16, 2);
  const int64_t K = x.size(1), N = dwu.size(0);
  TORCH_CHECK(dy.size(1) == K && dwu.size(1) == K && dwdt.size(0) == N && dwdt.size(1) == K, "dw: shapes");
  TORCH_CHECK(colptr.size(0) == N + 1, "dw: colptr must be [N + 1]");
  const float* up = nullptr;
  const float* cup = nullptr;
  void* gp = nullptr;
  if (gated) {
    req(ell_u, "ell_u", at::kFloat, 2);
    req(cu, "cu", at::kFloat, 2);
    req(dwg, "dw_gate", at::kBFloat16, 2);
    TORCH_CHECK(dwg.sizes() == dwu.sizes(), "dw: dw_gate shape");
    up = ell_u.data_ptr<float>();
    cup = cu.data_ptr<float>();
    gp = dwg.data_ptr();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  check(sfltrain_dw_launch(gated ? 1 : 0, (int)nb, x.data_ptr(), dy.data_ptr(), (int)N, (int)K, (int)ell_a.size(1),
                           perm.data_ptr<int64_t>(), colptr.data_ptr<int64_t>(), ell_a.data_ptr(), up,
                           cg.data_ptr<float>(), cup, gated ? opt(add_g, "add_g", N, K) : nullptr,
                           opt(add_u, "add_u", N, K), opt(add_d, "add_d", N, K), gp, dwu.data_ptr(),
                           dwdt.data_ptr(), (int)part0, (int)parts, stream()),
        "dw (parts: 0, 1 or both)");
}

// dW_dT (with the addend add_d) and the light entries' dh partial dot products, slice by slice: part
// [ceil(K / 256), at least the light entries] fp32, column q = CSR position (train_kernels.cu, dwd_dh_kernel; fewer
// columns than entries stop dh_coef with a device trap)
void dwd_dh(int64_t nb, const at::Tensor& dy, const at::Tensor& wdt, const at::Tensor& perm, const at::Tensor& colptr,
            const at::Tensor& ell_a, const c10::optional<at::Tensor>& ell_u, const c10::optional<at::Tensor>& add_d,
            at::Tensor dwdt, at::Tensor part) {
  req(dy, "dy", at::kBFloat16, 2);
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(perm, "perm", at::kLong, 1);
  req(colptr, "colptr", at::kLong, 1);
  req(ell_a, "ell_a", at::kBFloat16, 2);
  req(dwdt, "dw_down_t", at::kBFloat16, 2);
  req(part, "part", at::kFloat, 2);
  const int64_t K = dy.size(1), N = wdt.size(0), W = ell_a.size(1);
  TORCH_CHECK(wdt.size(1) == K && dwdt.sizes() == wdt.sizes() && colptr.size(0) == N + 1 &&
                  part.size(0) == (K / 8 + 31) / 32,
              "dwd_dh: shapes");
  const float* up = nullptr;
  if (ell_u.has_value() && ell_u->defined() && ell_u->numel() > 0) {
    req(*ell_u, "ell_u", at::kFloat, 2);
    TORCH_CHECK(ell_u->sizes() == ell_a.sizes(), "dwd_dh: ell_u shape");
    up = ell_u->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(dy.device());
  check(sfltrain_dwd_dh_launch((int)nb, dy.data_ptr(), wdt.data_ptr(), (int)N, (int)K, (int)W,
                               perm.data_ptr<int64_t>(), colptr.data_ptr<int64_t>(), ell_a.data_ptr(), up,
                               opt(add_d, "add_d", N, K), dwdt.data_ptr(), part.data_ptr<float>(), part.size(1),
                               stream()),
        "dwd_dh (nb 1, 2, 4 or 8)");
}

// The light entries' coefficients (bwd_block's cg, cu [M, W]) from dwd_dh's partial dot products; l1c: fp32 [1]
void dh_coef(bool gated, const at::Tensor& part, int64_t K, const at::Tensor& perm, const at::Tensor& colptr,
             const at::Tensor& ell_a, const at::Tensor& ell_u, const at::Tensor& l1c, at::Tensor cg, at::Tensor cu) {
  req(part, "part", at::kFloat, 2);
  req(ell_a, "ell_a", at::kBFloat16, 2);
  req(l1c, "l1c", at::kFloat, 1);
  req(cg, "cg", at::kFloat, 2);
  TORCH_CHECK(cg.sizes() == ell_a.sizes() && part.size(0) == (K / 8 + 31) / 32, "dh_coef: shapes");
  if (gated) {
    req(ell_u, "ell_u", at::kFloat, 2);
    req(cu, "cu", at::kFloat, 2);
    TORCH_CHECK(ell_u.sizes() == ell_a.sizes() && cu.sizes() == ell_a.sizes(), "dh_coef: shapes");
  }
  const c10::cuda::CUDAGuard guard(part.device());
  check(sfltrain_dh_coef_launch(gated ? 1 : 0, part.data_ptr<float>(), part.size(1), (int)K,
                                perm.data_ptr<int64_t>(), colptr.data_ptr<int64_t>(), (int)(colptr.size(0) - 1),
                                ell_a.data_ptr(), gated ? ell_u.data_ptr<float>() : nullptr, l1c.data_ptr<float>(),
                                cg.data_ptr<float>(), gated ? cu.data_ptr<float>() : nullptr, stream()),
        "dh_coef");
}

// Dense path backward elementwise (fused): dh [M, N] bf16 in/out (becomes dg), g/h (and u, du when gated) same
// shape, contiguous; gl1: fp32 scalar on the device (the L1 output's gradient), scale: the L1 scale.
void dense_bwd(at::Tensor dh, const at::Tensor& g, const at::Tensor& u, const at::Tensor& h, at::Tensor du,
               const at::Tensor& gl1, double scale) {
  const bool gated = u.numel() > 0;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&dh, &g, &h}) req(*t, "dense_bwd tensor", at::kBFloat16, 2);
  TORCH_CHECK(g.sizes() == dh.sizes() && h.sizes() == dh.sizes(), "dense_bwd: g, h and dh must have one shape");
  if (gated) {
    req(u, "u", at::kBFloat16, 2);
    req(du, "du", at::kBFloat16, 2);
    TORCH_CHECK(u.sizes() == dh.sizes() && du.sizes() == dh.sizes(), "dense_bwd: u/du shape mismatch");
  }
  TORCH_CHECK(gl1.is_cuda() && gl1.scalar_type() == at::kFloat && gl1.numel() == 1 && gl1.is_contiguous(),
              "dense_bwd: gl1 must be one fp32 CUDA value");
  const c10::cuda::CUDAGuard guard(dh.device());
  check(sfltrain_dense_bwd_launch(gated ? 1 : 0, dh.data_ptr(), g.data_ptr(), gated ? u.data_ptr() : nullptr,
                                  h.data_ptr(), gated ? du.data_ptr() : nullptr, dh.numel(), gl1.data_ptr<float>(),
                                  (float)scale, stream()),
        "dense_bwd");
}

// a: bf16 [rows, N] with unit column stride -> nnz int32 [rows] (a != 0, -0.0 excluded, NaN included)
at::Tensor count(const at::Tensor& a) {
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kBFloat16 && a.dim() == 2 && a.stride(1) == 1,
              "count: a must be a CUDA bf16 [rows, N] tensor with unit column stride");
  auto nnz = at::empty({a.size(0)}, a.options().dtype(at::kInt));
  const c10::cuda::CUDAGuard guard(a.device());
  check(sfltrain_count_launch(a.data_ptr(), a.stride(0), (int)a.size(0), (int)a.size(1), i32(nnz), stream()),
        "count");
  return nnz;
}

// a: bf16 [rows, N] with unit column stride -> int64 [N]: the last row where each column is relu-active (> 0 or
// NaN), -1 where none is.
at::Tensor last_active(const at::Tensor& a) {
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kBFloat16 && a.dim() == 2 && a.stride(1) == 1,
              "last_active: a must be a CUDA bf16 [rows, N] tensor with unit column stride");
  auto last = at::empty({a.size(1)}, a.options().dtype(at::kLong));
  const c10::cuda::CUDAGuard guard(a.device());
  check(sfltrain_last_active_launch(a.data_ptr(), a.stride(0), (int)a.size(0), (int)a.size(1),
                                    last.data_ptr<int64_t>(), stream()),
        "last_active");
  return last;
}

// dst [n, K] = src rows idx (a zero row where idx < 0): the backup block's input.
at::Tensor gather_rows(const at::Tensor& src, const at::Tensor& idx) {
  req(src, "src", at::kBFloat16, 2);
  req(idx, "idx", at::kLong, 1);
  TORCH_CHECK(src.is_contiguous(), "gather_rows: src must be contiguous");
  auto dst = at::empty({idx.size(0), src.size(1)}, src.options());
  const c10::cuda::CUDAGuard guard(src.device());
  check(sfl_gather_rows_launch(src.data_ptr(), idx.data_ptr<int64_t>(), (int)idx.size(0), (int)src.size(1),
                               dst.data_ptr(), stream()),
        "gather_rows");
  return dst;
}

// The backup block's rows back into the batch (block row i with idx[i] >= 0): y[idx[i]] = yb[i], rowabs[idx[i]] =
// sum |hb[i]|, and when `last` is defined (int64 [N]) last[j] = max(last[j], idx[i]) where ab[i, j] is active.
void scatter_rows(const at::Tensor& yb, const at::Tensor& hb, const at::Tensor& ab, const at::Tensor& idx,
                  at::Tensor y, at::Tensor rowabs, at::Tensor last) {
  req(yb, "yb", at::kBFloat16, 2);
  req(hb, "hb", at::kBFloat16, 2);
  req(ab, "ab", at::kBFloat16, 2);
  req(idx, "idx", at::kLong, 1);
  req(y, "y", at::kBFloat16, 2);
  req(rowabs, "rowabs", at::kFloat, 1);
  const int64_t n = idx.size(0);
  TORCH_CHECK(yb.is_contiguous() && hb.is_contiguous() && ab.is_contiguous() && y.is_contiguous() &&
                  yb.size(0) == n && hb.size(0) == n && ab.sizes() == hb.sizes() && yb.size(1) == y.size(1) &&
                  rowabs.size(0) == y.size(0),
              "scatter_rows: yb [n, K], hb and ab [n, N] contiguous, y [M, K], rowabs [M], idx [n]");
  int64_t* lp = nullptr;
  if (last.defined() && last.numel() > 0) {
    req(last, "last", at::kLong, 1);
    TORCH_CHECK(last.size(0) == hb.size(1), "scatter_rows: last must be [N]");
    lp = last.data_ptr<int64_t>();
  }
  const c10::cuda::CUDAGuard guard(y.device());
  check(sfl_scatter_rows_launch(yb.data_ptr(), hb.data_ptr(), ab.data_ptr(), idx.data_ptr<int64_t>(), (int)n,
                                (int)yb.size(1), (int)hb.size(1), y.data_ptr(), rowabs.data_ptr<float>(), lp,
                                stream()),
        "scatter_rows");
}

// The flagged rows rows[start .. *count) of x computed densely on CUDA cores into y and rowabs (and `last`, int64 [N],
// when defined): the capacity-overflow path of the sync-free forward. grid: CTAs (each loops over rows).
void dense_rows_fwd(bool gated, const at::Tensor& x, const at::Tensor& wf, const at::Tensor& wu, const at::Tensor& wdt,
                    const at::Tensor& rows, const at::Tensor& count, int64_t start, at::Tensor y, at::Tensor rowabs,
                    at::Tensor last, int64_t grid) {
  req(x, "x", at::kBFloat16, 2);
  req(wf, "w_first", at::kBFloat16, 2);
  req(wu, "w_up", at::kBFloat16, 2);
  req(wdt, "w_down_t", at::kBFloat16, 2);
  req(rows, "rows", at::kLong, 1);
  req(count, "count", at::kLong, 1);
  req(y, "y", at::kBFloat16, 2);
  req(rowabs, "rowabs", at::kFloat, 1);
  const int64_t M = x.size(0), K = x.size(1), N = wf.size(0);
  TORCH_CHECK(wf.size(1) == K && wu.size(1) == K && wdt.size(1) == K && wdt.size(0) == N && wu.size(0) == N,
              "dense_rows_fwd: weight shapes");
  TORCH_CHECK(rows.size(0) == M && y.size(0) == M && y.size(1) == K && rowabs.size(0) == M, "dense_rows_fwd: rows");
  int64_t* lp = nullptr;
  if (last.defined() && last.numel() > 0) {
    req(last, "last", at::kLong, 1);
    TORCH_CHECK(last.size(0) == N, "dense_rows_fwd: last must be [N]");
    lp = last.data_ptr<int64_t>();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  check(sfl_dense_rows_fwd_launch(gated, x.data_ptr(), wf.data_ptr(), wu.data_ptr(), wdt.data_ptr(), (int)M,
                                  (int)K, (int)N, rows.data_ptr<int64_t>(), count.data_ptr<int64_t>(), (int)start,
                                  nullptr, y.data_ptr(), rowabs.data_ptr<float>(), lp, (int)grid, stream()),
        "dense_rows_fwd");
}

// The same from the sparse path's ELL (ell_col int32 [M, W], nnz, flag int32 [M]) over its light rows: int64 [N].
at::Tensor last_active_ell(const at::Tensor& ell_col, const at::Tensor& nnz, const at::Tensor& flag, int64_t N) {
  req(ell_col, "ell_col", at::kInt, 2);
  req(nnz, "nnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  TORCH_CHECK(ell_col.is_contiguous() && nnz.size(0) == ell_col.size(0) && flag.size(0) == ell_col.size(0),
              "last_active_ell: ell_col must be contiguous [M, W], nnz and flag [M]");
  TORCH_CHECK(N >= 0 && N < (1LL << 31), "last_active_ell: N out of range");
  auto last = at::empty({N}, ell_col.options().dtype(at::kLong));
  const c10::cuda::CUDAGuard guard(ell_col.device());
  check(sfltrain_last_active_ell_launch(ell_col.data_ptr<int32_t>(), (int)ell_col.size(1), nnz.data_ptr<int32_t>(),
                                        flag.data_ptr<int32_t>(), (int)ell_col.size(0), (int)N,
                                        last.data_ptr<int64_t>(), stream()),
        "last_active_ell");
  return last;
}

// src: bf16 [R, C] with unit column stride -> [C, R] contiguous (R, C and the row stride multiples of 8).
at::Tensor transpose(const at::Tensor& src) {
  TORCH_CHECK(src.is_cuda() && src.scalar_type() == at::kBFloat16 && src.dim() == 2 && src.stride(1) == 1,
              "transpose: src must be a CUDA bf16 [R, C] tensor with unit column stride");
  auto dst = at::empty({src.size(1), src.size(0)}, src.options());
  const c10::cuda::CUDAGuard guard(src.device());
  check(sfltrain_transpose_launch(src.data_ptr(), src.stride(0), (int)src.size(0), (int)src.size(1), dst.data_ptr(),
                                  stream()),
        "transpose");
  return dst;
}

// W_d stored neuron-major (kernels/layout.py: [K, N] with strides (1, K), 16-byte aligned): its transpose is the
// [N, K] tensor the kernels read, with no copy; and the op returns dW_d in the same strides.
bool neuron_major(const at::Tensor& w_down) {
  return w_down.t().is_contiguous() && reinterpret_cast<uintptr_t>(w_down.data_ptr()) % 16 == 0;
}

// W_d^T [N, K] contiguous: w_down itself when stored neuron-major, else a transposed copy (contiguous w_down)
at::Tensor down_t(const at::Tensor& w_down) {
  TORCH_CHECK(w_down.is_cuda() && w_down.scalar_type() == at::kBFloat16 && w_down.dim() == 2,
              "w_down must be a CUDA bf16 [K, N] tensor");
  return neuron_major(w_down) ? w_down.t() : transpose(w_down);
}

// The light ELL entries sorted by neuron: (perm int64 [M * W], colptr int64 [N + 1]); entries of neuron j are
// perm[colptr[j]:colptr[j + 1]] in ascending row order (the reference csr_by_neuron's order). perm past colptr[N]
// is not written.
bool csr_supported(int64_t N, int64_t W) { return sfltrain_csr_smem_bytes((int)N, (int)W) <= 200 * 1024; }

std::tuple<at::Tensor, at::Tensor> csr_by_neuron(const at::Tensor& ell_col, const at::Tensor& nnz,
                                                 const at::Tensor& flag, int64_t N) {
  req(ell_col, "ell_col", at::kInt, 2);
  req(nnz, "nnz", at::kInt, 1);
  req(flag, "flag", at::kInt, 1);
  const int64_t M = ell_col.size(0), W = ell_col.size(1);
  TORCH_CHECK(nnz.size(0) == M && flag.size(0) == M, "csr_by_neuron: nnz and flag must be [M]");
  TORCH_CHECK(W >= 1 && csr_supported(N, W), "csr_by_neuron: N = ", std::to_string(N), ", W = ", std::to_string(W),
              " needs more shared memory than the kernel takes (use the reference csr_by_neuron)");
  const int64_t rb = sfltrain_csr_rows_per_block((int)M), B = (M + rb - 1) / rb;
  auto i64 = ell_col.options().dtype(at::kLong);
  auto perm = at::empty({M * W}, i64);
  auto colptr = at::empty({N + 1}, i64);
  auto total = at::empty({N}, i64);
  auto cnt = at::empty({std::max<int64_t>(1, B * N)}, ell_col.options());
  const c10::cuda::CUDAGuard guard(ell_col.device());
  check(sfltrain_csr_by_neuron_launch(i32(ell_col), (int)W, i32(nnz), i32(flag), (int)M, (int)N, i32(cnt),
                                      total.data_ptr<int64_t>(), colptr.data_ptr<int64_t>(), perm.data_ptr<int64_t>(),
                                      stream()),
        "csr_by_neuron");
  return {perm, colptr};
}

// The op's forward on the "cuda" backend in two calls (kernels/train/ops.py, ffn_fwd, says what the steps are
// for; kernels/train/README.md, Forward), between which the caller records the event after which `host` is final
// (the backward waits for it: recorded at the end of the forward instead, the backward's first launches waited
// for the whole forward). As ~30 torch calls from Python the forward took 1.6 ms of host time per call on the H100
// machine, against 0.7 ms for dense autograd's (lab/speed/host_time_train_op.py).
//
// ffn_fwd_gate: the gate GEMM in chunks of rows into one reused scratch, each compacted to ELL; the device summary
// and (host_copy) its pinned copy `host`, queued. Returns ell_col, ell_a, nnz, flag, summary, host (zeros in plain
// CPU memory without host_copy).
std::vector<at::Tensor> ffn_fwd_gate(const at::Tensor& first, const at::Tensor& x, int64_t width, int64_t measure_width,
                                     int64_t chunk_rows, bool host_copy) {
  req(x, "x", at::kBFloat16, 2);
  req(first, "w_first", at::kBFloat16, 2);
  TORCH_CHECK(width >= 1 && measure_width >= width, "ffn_fwd_gate: need 1 <= width <= measure_width");
  const int64_t M = x.size(0), N = first.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opt = x.options();
  const auto i32o = opt.dtype(at::kInt);
  at::Tensor ell_col = at::empty({M, width}, i32o), ell_a = at::empty({M, width}, opt);
  at::Tensor nnz = at::empty({M}, i32o), flag = at::empty({M}, i32o);
  at::Tensor summary = at::empty({4}, opt.dtype(at::kLong));
  check(cudaMemsetAsync(summary.data_ptr(), 0, 4 * sizeof(int64_t), stream()), "memset");
  if (M > 0) {
    const int64_t chunk = std::max<int64_t>(1, std::min(chunk_rows, M));
    at::Tensor scratch = at::empty({chunk, N}, opt);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t n = std::min(chunk, M - c0);
      at::Tensor g = scratch.narrow(0, 0, n);
      at::mm_out(g, x.narrow(0, c0, n), first.t());
      compact(g, N, ell_col.narrow(0, c0, n), ell_a.narrow(0, c0, n), nnz.narrow(0, c0, n), flag.narrow(0, c0, n),
              summary, measure_width);
    }
  }
  if (!host_copy)  // a captured call: its replays would write a pinned buffer that no event tells the host about
    return {ell_col, ell_a, nnz, flag, summary, at::zeros({4}, at::TensorOptions().dtype(at::kLong))};
  at::Tensor host = at::empty({4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  host.copy_(summary, /*non_blocking=*/true);
  return {ell_col, ell_a, nnz, flag, summary, host};
}

// ffn_fwd_rows: the rest, from ffn_fwd_gate's outputs. Returns y, l1 (fp32, scaled), ell_u, backup_rows and backup
// (empty: the backward recomputes those rows), last (int64 [N], or empty without want_last).
std::vector<at::Tensor> ffn_fwd_rows(const c10::optional<at::Tensor>& w_gate, const at::Tensor& x,
                                     const at::Tensor& w_up, const at::Tensor& w_down, const at::Tensor& ell_col,
                                     const at::Tensor& ell_a, const at::Tensor& nnz, const at::Tensor& flag,
                                     const at::Tensor& summary, double scale, int64_t backup_cap, bool want_last,
                                     int64_t sms) {
  const bool gated = w_gate.has_value() && w_gate->defined();
  const at::Tensor& first = gated ? *w_gate : w_up;
  req(x, "x", at::kBFloat16, 2);
  req(summary, "summary", at::kLong, 1);
  const int64_t M = x.size(0), K = x.size(1), N = w_up.size(0), width = ell_col.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opt = x.options();
  const auto i64o = opt.dtype(at::kLong), f32o = opt.dtype(at::kFloat);
  const at::Tensor wdt = down_t(w_down);  // neuron-major: an active neuron's W_d column is a contiguous row
  at::Tensor y = at::empty({M, K}, opt), rowabs = at::empty({M}, f32o);
  at::Tensor ell_u = at::empty({gated ? M : 0, gated ? width : 0}, f32o), h = at::empty({M, width}, f32o);
  // the light rows: u, h = a u and the L1 row sums one block per row, then y = sum h W_d[:, j] slice-major
  fwd_impl(true, gated, x, w_up, wdt, ell_col, ell_a, nnz, flag, ell_u, y.narrow(0, 0, 0), rowabs, h);
  dx_slices(false, wdt, wdt, ell_col, nnz, flag, h, h, y, kFwdSlicesRows);
  at::Tensor last = want_last ? last_active_ell(ell_col, nnz, flag, N) : at::empty({0}, i64o);
  int64_t* lp = want_last ? last.data_ptr<int64_t>() : nullptr;
  const int64_t cap = std::min(M, std::max<int64_t>(0, backup_cap)), two_per_sm = 2 * std::max<int64_t>(1, sms);
  if (M > 0 && cap == 0) {  // no block: dense_rows_fwd's CTAs scan the flags in chunks of 256 rows (no list)
    check(sfl_dense_rows_fwd_launch(gated, x.data_ptr(), first.data_ptr(), w_up.data_ptr(), wdt.data_ptr(), (int)M,
                                    (int)K, (int)N, nullptr, nullptr, 0, i32(flag), y.data_ptr(),
                                    rowabs.data_ptr<float>(), lp, (int)std::min((M + 255) / 256, two_per_sm),
                                    stream()),
          "dense_rows_fwd");
  } else if (M > 0) {  // the first cap flagged rows by cuBLAS on a gathered block (unused rows zero), the rest on CUDA cores
    const at::Tensor rows = at::nonzero_static(flag, M, -1).squeeze(1);
    const at::Tensor idx = rows.narrow(0, 0, cap);
    const at::Tensor xb = gather_rows(x, idx);
    const at::Tensor ab = at::relu(at::linear(xb, first));
    const at::Tensor hb = gated ? ab * at::linear(xb, w_up) : ab;  // reference.dense_rows_forward's ops
    scatter_rows(at::linear(hb, w_down), hb, ab, idx, y, rowabs, last);
    if (cap < M)  // one CTA per overflow row, up to two per SM; none runs unless the count exceeds cap
      check(sfl_dense_rows_fwd_launch(gated, x.data_ptr(), first.data_ptr(), w_up.data_ptr(), wdt.data_ptr(), (int)M,
                                      (int)K, (int)N, rows.data_ptr<int64_t>(), summary.data_ptr<int64_t>(), (int)cap,
                                      nullptr, y.data_ptr(), rowabs.data_ptr<float>(), lp,
                                      (int)std::min(M - cap, two_per_sm), stream()),
            "dense_rows_fwd");
  }
  at::Tensor l1 = rowabs.sum(at::kFloat).mul(scale);
  return {y, l1, ell_u, at::empty({0}, i64o), at::empty({0, N}, opt), last};
}

// ffn_bwd: the op's backward on the "cuda" backend in one call (kernels/train/ops.py, ffn_bwd, and
// kernels/train/README.md, Backward), with no host read: every shape is known from the arguments, so a training step
// can be captured in a CUDA graph. backup_cap: the forward's cuBLAS block of flagged rows (the first backup_cap of
// them, as in the forward; eager and captured calls alike, so that a replay computes the eager step's bits); rows
// past it by dense_rows_bwd on CUDA cores (their count stays on the device). entries: a bound on the light entries
// (the forward's summary, when the caller has it on the host), or -1 for their capacity M x W; perm / colptr: the
// CSR by neuron when the caller computed it (the kernel needs more shared memory than it takes), else undefined and
// computed here; nb: dw's K-slice width, resolved. Returns dx, dW_g (empty when
// non-gated), dW_u, dW_d in nn.Linear layout.
std::vector<at::Tensor> ffn_bwd(const at::Tensor& dy_in, const at::Tensor& gl1, const at::Tensor& x,
                                const c10::optional<at::Tensor>& w_gate, const at::Tensor& w_up,
                                const at::Tensor& w_down, const at::Tensor& ell_col, const at::Tensor& ell_a,
                                const at::Tensor& ell_u, const at::Tensor& nnz, const at::Tensor& flag,
                                int64_t backup_cap, int64_t entries, double scale, int64_t nb, int64_t sms,
                                const c10::optional<at::Tensor>& perm_in, const c10::optional<at::Tensor>& colptr_in) {
  const bool gated = w_gate.has_value() && w_gate->defined();
  const at::Tensor& first = gated ? *w_gate : w_up;
  req(x, "x", at::kBFloat16, 2);
  req(flag, "flag", at::kInt, 1);
  const int64_t M = x.size(0), K = x.size(1), N = w_up.size(0), W = ell_col.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto f32o = x.options().dtype(at::kFloat);
  const at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  const at::Tensor c = (gl1.reshape({1}).to(at::kFloat) * scale).contiguous();  // dL/d|h|, read on the device
  at::Tensor dx = at::empty({M, K}, x.options());
  // the flagged rows, ascending (-1 after the last), and their count, on the device
  const at::Tensor rows = at::nonzero_static(flag, M, -1).squeeze(1);
  const at::Tensor count = flag.ne(0).sum(at::kLong).reshape({1});
  const int64_t cap = std::min(M, std::max<int64_t>(0, backup_cap));
  // the first cap flagged rows: dense autograd's ops (reference.dense_rows_backward, op for op) on a gathered block
  // (unused rows zero: they add nothing), activations recomputed from x; their weight-gradient contributions become
  // the dw kernel's addends
  c10::optional<at::Tensor> add_g, add_u, add_d;
  if (cap > 0) {
    const at::Tensor idx = rows.narrow(0, 0, cap);
    const at::Tensor xb = gather_rows(x, idx), dyb = gather_rows(dy, idx);
    const at::Tensor ab = at::relu(at::linear(xb, first));
    const at::Tensor u = gated ? at::linear(xb, w_up) : at::Tensor();
    const at::Tensor h = gated ? ab * u : ab;
    const at::Tensor dh = at::matmul(dyb, w_down) + c.reshape({}).to(h.scalar_type()) * h.sgn();
    const at::Tensor da = gated ? dh * u : dh;
    const at::Tensor dg = at::where(ab.le(0), at::zeros_like(da), da);
    at::Tensor dxb = at::matmul(dg, first);
    if (gated) {
      const at::Tensor du = dh * ab;
      dxb = dxb + at::matmul(du, w_up);
      add_g = at::matmul(dg.t(), xb);
      add_u = at::matmul(du.t(), xb);
    } else {
      add_u = at::matmul(dg.t(), xb);
    }
    add_d = at::matmul(h.t(), dyb);
    dxb = dxb.contiguous();
    check(sfl_scatter_rows_launch(dxb.data_ptr(), nullptr, nullptr, idx.data_ptr<int64_t>(), (int)cap, (int)K,
                                  (int)N, dx.data_ptr(), nullptr, nullptr, stream()),
          "scatter_rows");
  }
  const at::Tensor wdt = down_t(w_down);
  at::Tensor perm, colptr;
  if (perm_in.has_value() && perm_in->defined()) {
    perm = *perm_in;
    colptr = *colptr_in;
  } else {
    std::tie(perm, colptr) = csr_by_neuron(ell_col, nnz, flag, N);
  }
  at::Tensor dwg = at::empty({gated ? N : 0, K}, x.options()), dwu = at::empty({N, K}, x.options());
  at::Tensor dwdt = at::empty({N, K}, x.options());
  // neuron-major over dy, one L2-sized K slice at a time: dW_dT, and the light entries' dh = dy_r . W_dT[j] in
  // partial sums per 256 columns (the dy slices dW_dT reads anyway; W_dT[j]'s slice read once per neuron)
  // one column per light entry: `entries`, the forward's summary count of the non-zeros of finite rows up to the
  // configured width, bounds them (every light row is such a row); M * W if it is larger or unknown (-1)
  at::Tensor part = at::empty({(K / 8 + 31) / 32, entries < 0 ? M * W : std::min(M * W, entries)}, f32o);
  dwd_dh(nb, dy, wdt, perm, colptr, ell_a, ell_u, add_d, dwdt, part);
  at::Tensor cg = at::empty({M, W}, f32o), cu = at::empty({gated ? M : 0, gated ? W : 0}, f32o);
  dh_coef(gated, part, K, perm, colptr, ell_a, ell_u, c, cg, cu);
  part.reset();
  // dx one L2-sized K slice of W_g / W_u at a time, then dW_g / dW_u neuron-major over x
  dx_slices(gated, first, w_up, ell_col, nnz, flag, cg, cu, dx, kBwdSlicesRows);
  dw(gated, nb, x, dy, perm, colptr, ell_a, ell_u, cg, cu, add_g, add_u, c10::nullopt, gated ? dwg : dwu, dwu, dwdt,
     0, 1);
  if (cap < M)  // the flagged rows past the block: dx written, their dW added; no CTA works unless the count exceeds cap
    check(sfl_dense_rows_bwd_launch(gated, x.data_ptr(), dy.data_ptr(), first.data_ptr(), w_up.data_ptr(),
                                    wdt.data_ptr(), (int)M, (int)K, (int)N, rows.data_ptr<int64_t>(),
                                    count.data_ptr<int64_t>(), (int)cap, c.data_ptr<float>(), dx.data_ptr(),
                                    (gated ? dwg : dwu).data_ptr(), gated ? dwu.data_ptr() : nullptr, dwdt.data_ptr(),
                                    (int)std::min(M - cap, 2 * std::max<int64_t>(1, sms)), stream()),
          "dense_rows_bwd");
  return {dx, dwg, dwu, neuron_major(w_down) ? dwdt.t() : transpose(dwdt)};  // dW_d [K, N] in w_down's strides
}

// ---- the registered ops sfl_train::ffn_fwd / ffn_bwd (schemas and fakes in kernels/train/ops.py): the "cuda"
// backend of the training op, one dispatcher call per half, no Python in between.

bool capturing() {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream(), &st), "capture status");
  return st != cudaStreamCaptureStatusNone;
}

int64_t sm_count(const at::Tensor& t) {
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, t.get_device()), "device attribute");
  return n;
}

// The forward's pinned summary is final once the event recorded right after its copy has completed. The backward
// looks the event up by the buffer's address; an address handed out again replaces it. (The dispatch, on the
// layer's plan in kernels/twell/runtime.cpp, records its own event after the op.)
std::mutex g_ready_mu;
std::unordered_map<const void*, cudaEvent_t> g_ready;

void record_ready(const at::Tensor& host) {
  cudaEvent_t ev;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event create");
  check(cudaEventRecord(ev, stream()), "event record");
  std::lock_guard<std::mutex> lock(g_ready_mu);
  auto it = g_ready.find(host.data_ptr());
  if (it != g_ready.end()) {
    cudaEventDestroy(it->second);
    it->second = ev;
  } else {
    g_ready.emplace(host.data_ptr(), ev);
  }
}

// The light-entry bound of the forward's summary (waiting for its event, complete by the time a backward runs), or
// -1 (their capacity) while capturing, when nothing may be read on the host.
int64_t light_entries(const at::Tensor& host) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_ready_mu);
    auto it = g_ready.find(host.data_ptr());
    if (it != g_ready.end()) {
      ev = it->second;
      g_ready.erase(it);
    }
  }
  if (capturing()) {
    if (ev != nullptr) cudaEventDestroy(ev);
    return -1;
  }
  if (ev != nullptr) {
    check(cudaEventSynchronize(ev), "event synchronize");
    cudaEventDestroy(ev);
  } else if (host.is_pinned()) {  // no event known for this buffer: wait for everything queued (exact, slower)
    check(cudaStreamSynchronize(stream()), "stream synchronize");
  }
  return host.data_ptr<int64_t>()[2];
}

// reference.csr_by_neuron in ATen ops (a stable sort), where the counting sort's shared memory does not fit.
std::tuple<at::Tensor, at::Tensor> csr_by_neuron_sorted(const at::Tensor& ell_col, const at::Tensor& nnz,
                                                        const at::Tensor& flag, int64_t N) {
  const at::Tensor slot = at::arange(ell_col.size(1), ell_col.options()).unsqueeze(0);
  const at::Tensor valid = slot.lt(nnz.unsqueeze(1)).logical_and(flag.eq(0).unsqueeze(1));
  const at::Tensor keys = at::where(valid, ell_col, at::full({}, N, ell_col.options())).flatten();
  const auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor colptr = at::searchsorted(std::get<0>(sorted), at::arange(N + 1, keys.options()));
  return {std::get<1>(sorted), colptr};
}

using FwdOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

FwdOut ffn_fwd_op(const at::Tensor& x, const c10::optional<at::Tensor>& w_gate, const at::Tensor& w_up,
                  const at::Tensor& w_down, int64_t width, int64_t measure_width, double scale, int64_t chunk_rows,
                  int64_t backup_cap, bool want_last) {
  const c10::cuda::CUDAGuard guard(x.device());  // the event and the capture status on x's stream
  const bool gated = w_gate.has_value() && w_gate->defined();
  const bool capture = capturing();  // a captured forward's summary is read by no one: no copy, no event
  auto gate = ffn_fwd_gate(gated ? *w_gate : w_up, x, width, std::max(width, measure_width),
                           std::max<int64_t>(1, chunk_rows), !capture);
  if (!capture) record_ready(gate[5]);
  auto rows = ffn_fwd_rows(w_gate, x, w_up, w_down, gate[0], gate[1], gate[2], gate[3], gate[4], scale, backup_cap,
                           want_last, sm_count(x));
  // y, l1, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup (empty: the backward recomputes them), host, last
  return {rows[0], rows[1], gate[0], gate[1], rows[2], gate[2], gate[3], rows[3], rows[4], gate[5], rows[5]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ffn_bwd_op(
    const at::Tensor& dy, const at::Tensor& gl1, const at::Tensor& x, const c10::optional<at::Tensor>& w_gate,
    const at::Tensor& w_up, const at::Tensor& w_down, const at::Tensor& ell_col, const at::Tensor& ell_a,
    const at::Tensor& ell_u, const at::Tensor& nnz, const at::Tensor& flag, const at::Tensor& host, double scale,
    int64_t dw_nb, int64_t backup_cap) {
  TORCH_CHECK(dw_nb >= 1, "ffn_bwd: dw_nb must be resolved (ops.dw_chunks)");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = w_up.size(0);
  const int64_t entries = light_entries(host);
  c10::optional<at::Tensor> perm, colptr;
  if (!csr_supported(N, ell_col.size(1))) {  // the counting sort's shared memory does not fit: a stable sort
    auto pc = csr_by_neuron_sorted(ell_col, nnz, flag, N);
    perm = std::get<0>(pc);
    colptr = std::get<1>(pc);
  }
  auto g = ffn_bwd(dy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, backup_cap, entries, scale,
                   dw_nb, sm_count(x), perm, colptr);
  return {g[0], g[1], g[2], g[3]};
}

std::string source_hash() { return SFL_STR(SFL_SRC_HASH); }

}  // namespace

TORCH_LIBRARY_IMPL(sfl_train, CUDA, m) {
  m.impl("ffn_fwd", &ffn_fwd_op);
  m.impl("ffn_bwd", &ffn_bwd_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compact", &compact, "bf16 gate pre-activation rows -> ReLU -> ELL (ell_col, ell_a, nnz, flag)",
        pybind11::arg("g"), pybind11::arg("N"), pybind11::arg("ell_col"), pybind11::arg("ell_a"), pybind11::arg("nnz"),
        pybind11::arg("flag"), pybind11::arg("summary") = pybind11::none(), pybind11::arg("measure_width") = 0);
  m.def("fwd_rows", [](bool gated, const at::Tensor& x, const at::Tensor& wu, const at::Tensor& wdt,
                       const at::Tensor& ell_col, const at::Tensor& ell_a, const at::Tensor& nnz, const at::Tensor& flag,
                       at::Tensor ell_u, at::Tensor y, at::Tensor rowabs) {
    fwd_impl(false, gated, x, wu, wdt, ell_col, ell_a, nnz, flag, ell_u, y, rowabs, at::Tensor());
  }, "light rows, one warp each: u, h = a u, y = h W_d^T, per-row sum |h|");
  m.def("fwd_block", [](bool gated, const at::Tensor& x, const at::Tensor& wu, const at::Tensor& wdt,
                        const at::Tensor& ell_col, const at::Tensor& ell_a, const at::Tensor& nnz, const at::Tensor& flag,
                        at::Tensor ell_u, at::Tensor y, at::Tensor rowabs, const c10::optional<at::Tensor>& h) {
    fwd_impl(true, gated, x, wu, wdt, ell_col, ell_a, nnz, flag, ell_u, y, rowabs, h ? *h : at::Tensor());
  }, "fwd_rows with one block per light row (the same results); an empty y: the coefficients only, h = a u into h "
     "(dx_slices over W_d^T then sums y)",
  pybind11::arg("gated"), pybind11::arg("x"), pybind11::arg("wu"), pybind11::arg("wdt"), pybind11::arg("ell_col"),
  pybind11::arg("ell_a"), pybind11::arg("nnz"), pybind11::arg("flag"), pybind11::arg("ell_u"), pybind11::arg("y"),
  pybind11::arg("rowabs"), pybind11::arg("h") = pybind11::none());
  m.def("bwd_rows", [](bool gated, const at::Tensor& dy, const at::Tensor& wg, const at::Tensor& wu,
                       const at::Tensor& wdt, const at::Tensor& ell_col, const at::Tensor& ell_a,
                       const at::Tensor& ell_u, const at::Tensor& nnz, const at::Tensor& flag, const at::Tensor& l1c,
                       at::Tensor cg, at::Tensor cu, at::Tensor dx) {
    bwd_impl(false, gated, dy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu, dx);
  }, "light rows, one warp each: dh, per-entry dgate / dup coefficients, dx");
  m.def("bwd_block", [](bool gated, const at::Tensor& dy, const at::Tensor& wg, const at::Tensor& wu,
                        const at::Tensor& wdt, const at::Tensor& ell_col, const at::Tensor& ell_a,
                        const at::Tensor& ell_u, const at::Tensor& nnz, const at::Tensor& flag, const at::Tensor& l1c,
                        at::Tensor cg, at::Tensor cu, at::Tensor dx) {
    bwd_impl(true, gated, dy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu, dx);
  }, "bwd_rows with one block per light row (the same results)");
  m.def("ffn_fwd_gate", &ffn_fwd_gate, "the training op's forward, first call: gate GEMM, ELL, the summary's copy");
  m.def("ffn_fwd_rows", &ffn_fwd_rows, "the training op's forward, second call: the light rows, the backup rows, L1");
  m.def("ffn_bwd", &ffn_bwd, "the training op's backward in one call (sfl_train::ffn_bwd runs it)");
  m.def("ffn_fwd_op", &ffn_fwd_op, "sfl_train::ffn_fwd's CUDA implementation, called directly (eager)");
  m.def("ffn_bwd_op", &ffn_bwd_op, "sfl_train::ffn_bwd's CUDA implementation, called directly (eager)");
  m.def("dx_slices", &dx_slices, "dx of the light rows from bwd_block's coefficients, slice-major (bwd_block with an empty dx first)",
        py::arg("gated"), py::arg("wg"), py::arg("wu"), py::arg("ell_col"), py::arg("nnz"), py::arg("flag"),
        py::arg("cg"), py::arg("cu"), py::arg("dx"), py::arg("rows") = 0);
  m.def("dw", &dw, "neuron-major weight gradients from the CSR-by-neuron transpose (part 0: dW_g, dW_u; 1: dW_dT)",
        py::arg("gated"), py::arg("nb"), py::arg("x"), py::arg("dy"), py::arg("perm"), py::arg("colptr"),
        py::arg("ell_a"), py::arg("ell_u"), py::arg("cg"), py::arg("cu"), py::arg("add_g"), py::arg("add_u"),
        py::arg("add_d"), py::arg("dwg"), py::arg("dwu"), py::arg("dwdt"), py::arg("part0") = 0, py::arg("parts") = 2);
  m.def("dwd_dh", &dwd_dh, "dW_dT and the light entries' dh partial dot products per 256 columns, neuron-major");
  m.def("dh_coef", &dh_coef, "the light entries' backward coefficients (bwd_block's cg, cu) from dwd_dh's partials");
  m.def("dense_bwd", &dense_bwd, "dense path backward elementwise: dh + L1 term -> dg (in place), du");
  m.def("last_active", &last_active, "per column, the last row where a bf16 matrix is relu-active (-1 if none)");
  m.def("gather_rows", &gather_rows, "src rows idx, zero rows where idx < 0 (bf16)");
  m.def("scatter_rows", &scatter_rows, "the backup block's rows back into y, rowabs and the tracker");
  m.def("dense_rows_fwd", &dense_rows_fwd, "flagged rows beyond the backup capacity, dense on CUDA cores");
  m.def("last_active_ell", &last_active_ell, "per neuron, the last light row of the sparse path's ELL using it (-1 if none)");
  m.def("transpose", &transpose, "bf16 [R, C] -> [C, R] contiguous (tiled, 16-byte accesses)");
  m.def("csr_supported", &csr_supported, "whether csr_by_neuron takes N neurons at ELL width W");
  m.def("csr_by_neuron", &csr_by_neuron, "light ELL entries sorted by neuron (perm, colptr), deterministic order");
  m.def("count", &count, "per-row active count of a bf16 matrix (a != 0)");
  m.def("source_hash", &source_hash, "hash of the sources this library was built from");
}
