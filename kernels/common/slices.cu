// slices: rows of sum_e c_e B[j_e] (+ d_e B2[j_e]) from a compact per-row entry list, slice-major. Shared by the
// training op (the backward's dx, the forward's y over W_dT; kernels/train/README.md) and the inference op's large-M
// down step (y over W_dT from up_list's entries; kernels/README.md, How it computes 2-3). Plain CUDA (no torch
// headers); the launcher is declared in slices.h.
//
// A thread owns one 16-byte chunk of one row; a block holds ROWS rows of one K slice of kChunks chunks, and the grid
// walks slice-major, so that the blocks resident at once gather from one 512-column slice of B (and B2): N x 1 KB,
// 5.8 MB at N 5632, which the L2 holds (one block per row reading whole rows of the matrices missed it: 37% L2 hit
// rate for the training backward's three, lab/results/kernel_bench.tar.xz: ncu_sparse_phases_h100_2960055.txt). Entries in
// ascending order, the B term before the B2 term: the per-row kernels' sums (bwd_rows, fwd_rows, up_down), bit for
// bit.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "bf16.cuh"

namespace sflslices {

using namespace sfl;

// ROWS: 1, 2 or 4 rows per block (64 threads per row). Both ops run 1: a block
// then retires with its own row's entries instead of waiting for the longest of four (1-6% faster, the same sums).
// 4 stays the launcher's default.
constexpr int kChunks = 64, kRows = 4;

template <bool TWO, int ROWS>
__global__ void __launch_bounds__(kChunks * ROWS) slices_kernel(
    const __nv_bfloat16* __restrict__ b, const __nv_bfloat16* __restrict__ b2, int M, int K, int W,
    const int32_t* __restrict__ col, const int32_t* __restrict__ nnz, const int32_t* __restrict__ flag,
    const float* __restrict__ c, const float* __restrict__ d, __nv_bfloat16* __restrict__ out) {
  const int K8 = K >> 3;
  const long long row_blocks = (M + ROWS - 1) / ROWS;
  const int slice = (int)(blockIdx.x / row_blocks);
  const long long row = (blockIdx.x % row_blocks) * ROWS + threadIdx.x / kChunks;
  const int cc = slice * kChunks + (int)(threadIdx.x % kChunks);
  if (row >= M || cc >= K8 || flag[row]) return;  // flagged: a dense backup row, written by the caller
  const int n = nnz[row];
  const int32_t* js = col + row * W;
  const float* kc = c + row * W;
  const float* kd = TWO ? d + row * W : nullptr;
  const uint4* bb = reinterpret_cast<const uint4*>(b) + cc;
  const uint4* bb2 = reinterpret_cast<const uint4*>(b2) + cc;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  constexpr int kU = TWO ? 4 : 8;  // entries in flight: 8 16-byte loads per thread either way
  int e = 0;
  for (; e + kU <= n; e += kU) {
    uint4 v[kU], v2[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const long long j = (long long)__ldg(js + e + u) * K8;
      v[u] = __ldg(bb + j);
      if (TWO) v2[u] = __ldg(bb2 + j);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      axpy8(__ldg(kc + e + u), v[u], acc);
      if (TWO) axpy8(__ldg(kd + e + u), v2[u], acc);
    }
  }
  for (; e < n; ++e) {
    const long long j = (long long)__ldg(js + e) * K8;
    axpy8(__ldg(kc + e), __ldg(bb + j), acc);
    if (TWO) axpy8(__ldg(kd + e), __ldg(bb2 + j), acc);
  }
  reinterpret_cast<uint4*>(out + row * K)[cc] = pack8(acc);
}

}  // namespace sflslices

extern "C" {

cudaError_t sfl_slices_launch(const void* b, const void* b2, int M, int K, int W, const int32_t* col,
                              const int32_t* nnz, const int32_t* flag, const float* c, const float* d, void* out,
                              int rows, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (rows == 0) rows = sflslices::kRows;
  if (K % 8 != 0 || W < 1 || (rows != 1 && rows != 2 && rows != 4)) return cudaErrorInvalidValue;
  const long long slices = (K / 8 + sflslices::kChunks - 1) / sflslices::kChunks;
  const long long blocks = slices * ((M + rows - 1) / rows);
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  const auto* bb = reinterpret_cast<const __nv_bfloat16*>(b);
  const auto* bb2 = reinterpret_cast<const __nv_bfloat16*>(b2);
  auto* ob = reinterpret_cast<__nv_bfloat16*>(out);
#define SFL_SLICES(TWO_, ROWS_)                                                                                    \
  sflslices::slices_kernel<TWO_, ROWS_><<<(unsigned)blocks, sflslices::kChunks * ROWS_, 0, stream>>>(            \
      bb, bb2, M, K, W, col, nnz, flag, c, d, ob)
#define SFL_SLICES_ROWS(TWO_)                                                                                      \
  if (rows == 1) SFL_SLICES(TWO_, 1); else if (rows == 2) SFL_SLICES(TWO_, 2); else SFL_SLICES(TWO_, 4)
  if (b2 != nullptr) {
    SFL_SLICES_ROWS(true);
  } else {
    SFL_SLICES_ROWS(false);
  }
#undef SFL_SLICES_ROWS
#undef SFL_SLICES
  return cudaGetLastError();
}

}  // extern "C"
