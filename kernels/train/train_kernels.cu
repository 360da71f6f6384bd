// Sparse training kernels for the ReLU FFN block (CUDA C++, no torch headers: CI compile-checks this file
// with plain nvcc for sm_90a). Torch glue: binding.cpp. Algorithm and format: kernels/train/README.md.
//
// Saved-for-backward format (Hybrid, FORMAT.md): per token row, ELL slots of width W
//   ell_col int32 [M, W] (global neuron, pad -1), ell_a bf16 [M, W] (a = relu(gate) value, pad 0),
//   ell_u fp32 [M, W] (gated only: u = x . W_u[j], written by the forward), nnz int32 [M] (true count),
//   flag int32 [M] (1 = row goes through the dense backup: nnz > W or a non-finite gate pre-activation).
// Flagged rows are never touched here (their y / dx rows are written by the dense backup in ops.py).
//
// Kernels (one warp per work item unless said, 16-byte loads, fp32 accumulation):
//   compact : bf16 gate pre-activations [rows, N] -> ReLU -> ELL (ascending columns) + nnz + flag, and
//             optionally (flagged rows, widest light row) for the forward's one read-back.
//   fwd_rows: light rows: u_e = x.W_u[j] (gated), h_e = a_e u_e, y = sum_e h_e W_dT[j], rowabs = sum |h_e|.
//   fwd_block / bwd_block: fwd_rows / bwd_rows with one block per light row (the op runs fwd_block; bwd_block's
//             coefficients ran until the neuron-major backward and stay as dh_coef's oracle; the warp kernels stay as the tests'
//             oracle: the block kernels match them bit for bit at K >= 2048).
//   bwd_rows: light rows: dh_e = dy.W_dT[j] + c sign(h_e); dg_e = dh_e u_e, du_e = dh_e a_e (gated) or
//             dg_e = dh_e (non-gated); dx = sum_e dg_e W_g[j] + du_e W_u[j] (non-gated: dg_e W_u[j]).
//   dw      : neuron-major (CSR by neuron, built from the ELL): dW_g[j] = sum dg x_r, dW_u[j] = sum du x_r,
//             dW_dT[j] = sum h dy_r, plus an optional bf16 addend (the dense backup rows' contribution).
//   dwd_dh / dh_coef: dw's dW_dT part with the light entries' dh = dy_r . W_dT[j] in partial sums from the same dy
//             slices, then the coefficients (bwd_block's dg, du) from them: what the op's backward runs.
//   dense_bwd: the dense path's elementwise backward (dh + L1 term -> dg, du) in one pass.
//   transpose: bf16 [R, C] -> [C, R] (the neuron-major W_d and the W_d gradient in nn.Linear layout).
//   csr_by_neuron: counting sort of the light ELL entries by neuron (deterministic order) for dw.
//   last_active: per column, the last row where it is relu-active (the dense path's dead-neuron tracker).
// Launchers return the cudaError_t of the launch and never exit.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"

namespace sfltrain {

using namespace sfl;  // bf16 helpers, warp reductions, gathered dots, the relu activity test (common/bf16.cuh)

__device__ __forceinline__ float signf(float h) { return (h > 0.f) ? 1.f : ((h < 0.f) ? -1.f : 0.f); }

__device__ __forceinline__ long long warp_id() {
  return ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
}

// ---------------------------------------------------------------------------------------------------------
// compact: one warp per row; 256 columns per step (8 per lane, one 16-byte load). N % 8 == 0.
// summary (optional int64 [4], zeroed by the caller), one atomic each per block: [0] += flagged rows (nnz > W or a
// non-finite value: the backup rows), and against the configured width Wm >= W, what the dispatch measures:
// [1] max= the widest finite row with nnz <= Wm, [2] += the non-zeros of those rows, [3] += the other rows.
__global__ void __launch_bounds__(256) compact_kernel(const __nv_bfloat16* __restrict__ g, long long ldg, int rows,
                                                      int N, int W, int Wm, int32_t* __restrict__ ell_col,
                                                      __nv_bfloat16* __restrict__ ell_a, int32_t* __restrict__ nnz,
                                                      int32_t* __restrict__ flag,
                                                      unsigned long long* __restrict__ summary) {
  __shared__ int32_t s_flagged, s_widest, s_heavy;
  __shared__ unsigned long long s_light;
  if (threadIdx.x == 0) { s_flagged = 0; s_widest = 0; s_heavy = 0; s_light = 0ull; }
  __syncthreads();
  const long long row = warp_id();
  const int lane = threadIdx.x & 31;
  if (row < rows) {
    const __nv_bfloat16* gr = g + row * ldg;
    int32_t* oc = ell_col + row * W;
    uint16_t* oa = reinterpret_cast<uint16_t*>(ell_a) + row * W;
    int base = 0;
    bool nonfinite = false;
    for (int c0 = 0; c0 < N; c0 += 256) {
      const int c = c0 + lane * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (c < N) v = __ldg(reinterpret_cast<const uint4*>(gr + c));
      const unsigned act = relu_mask8(v, nonfinite);
      const int cnt = __popc(act);
      const int inc = warp_inclusive_sum(cnt);
      const int total = __shfl_sync(kFull, inc, 31);
      int slot = base + inc - cnt;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if ((act >> i) & 1u) {
          if (slot < W) {
            oc[slot] = c + i;
            oa[slot] = (uint16_t)bf16_at(v, i);
          }
          ++slot;
        }
      }
      base += total;
    }
    for (int s = base + lane; s < W; s += 32) {  // padding (format: col -1, value 0)
      oc[s] = -1;
      oa[s] = 0;
    }
    const bool any_nf = __any_sync(kFull, nonfinite);
    if (lane == 0) {
      const bool flagged = base > W || any_nf;
      nnz[row] = base;
      flag[row] = flagged ? 1 : 0;
      if (summary != nullptr) {
        if (flagged) atomicAdd(&s_flagged, 1);
        if (base > Wm || any_nf) {
          atomicAdd(&s_heavy, 1);
        } else {
          atomicMax(&s_widest, base);
          atomicAdd(&s_light, (unsigned long long)base);
        }
      }
    }
  }
  if (summary == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_flagged) atomicAdd(&summary[0], (unsigned long long)s_flagged);
    atomicMax(&summary[1], (unsigned long long)s_widest);
    if (s_light) atomicAdd(&summary[2], s_light);
    if (s_heavy) atomicAdd(&summary[3], (unsigned long long)s_heavy);
  }
}

// ---------------------------------------------------------------------------------------------------------
// fwd_rows: NI = 16-byte chunks of a K row per lane (K <= 256 * NI; NI <= 12, i.e. K <= 3072, keeps the fp32
// accumulators of a whole row in registers without spills).
template <int NI, bool GATED>
__global__ void __launch_bounds__(128, 1) fwd_rows_kernel(const __nv_bfloat16* __restrict__ x,
                                                       const __nv_bfloat16* __restrict__ wu,
                                                       const __nv_bfloat16* __restrict__ wdt, int M, int K, int W,
                                                       const int32_t* __restrict__ ell_col,
                                                       const __nv_bfloat16* __restrict__ ell_a,
                                                       const int32_t* __restrict__ nnz,
                                                       const int32_t* __restrict__ flag, float* __restrict__ ell_u,
                                                       __nv_bfloat16* __restrict__ y, float* __restrict__ rowabs) {
  const long long row = warp_id();
  const int lane = threadIdx.x & 31;
  if (row >= M) return;
  if (flag[row]) {  // dense backup row: y written by the caller; contributes its L1 separately
    if (lane == 0) rowabs[row] = 0.f;
    return;
  }
  const int n = nnz[row];
  const int K8 = K >> 3;
  const long long rb = row * W;
  const uint16_t* av = reinterpret_cast<const uint16_t*>(ell_a);
  float absacc = 0.f;
  if (GATED) {
    uint4 xv[NI];
    load_row<NI>(xv, x + row * K, K);
    for (int b0 = 0; b0 < n; b0 += 32) {
      const int ne = min(32, n - b0);
      const int col = lane < ne ? ell_col[rb + b0 + lane] : 0;
      const float myu = gather_dots<NI>(xv, wu, col, ne, K);
      if (lane < ne) ell_u[rb + b0 + lane] = myu;  // read back by the same lane below
    }
  }
  float acc[NI * 8];
#pragma unroll
  for (int i = 0; i < NI * 8; ++i) acc[i] = 0.f;
  for (int b0 = 0; b0 < n; b0 += 32) {
    const int ne = min(32, n - b0);
    int col = 0;
    float h = 0.f;
    if (lane < ne) {
      col = ell_col[rb + b0 + lane];
      h = bf2f(av[rb + b0 + lane]);
      if (GATED) h *= ell_u[rb + b0 + lane];
      absacc += fabsf(h);
    }
#pragma unroll 1
    for (int j = 0; j < ne; j += 2) {
      const bool two = (j + 1) < ne;
      const int c0 = __shfl_sync(kFull, col, j);
      const int c1 = __shfl_sync(kFull, col, two ? j + 1 : j);
      const float h0 = __shfl_sync(kFull, h, j);
      const float h1 = two ? __shfl_sync(kFull, h, j + 1) : 0.f;
      const uint4* r0 = reinterpret_cast<const uint4*>(wdt + (long long)c0 * K);
      const uint4* r1 = reinterpret_cast<const uint4*>(wdt + (long long)c1 * K);
      uint4 a[NI], b[NI];
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int c = lane + 32 * i;
        a[i] = c < K8 ? __ldg(r0 + c) : make_uint4(0, 0, 0, 0);
        b[i] = (c < K8 && two) ? __ldg(r1 + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < NI; ++i) { axpy8(h0, a[i], acc + 8 * i); axpy8(h1, b[i], acc + 8 * i); }
    }
  }
  store_row<NI>(y + row * K, acc, K);
  absacc = warp_sum(absacc);
  if (lane == 0) rowabs[row] = absacc;
}

// ---------------------------------------------------------------------------------------------------------
// bwd_rows: dgrad of the light rows + per-entry coefficients for the weight gradients.
// l1c: device pointer to (dL/dl1) * l1 scale (so no host sync on the incoming gradient).
template <int NI, bool GATED>
__global__ void __launch_bounds__(128, 1) bwd_rows_kernel(const __nv_bfloat16* __restrict__ dy,
                                                       const __nv_bfloat16* __restrict__ wg,
                                                       const __nv_bfloat16* __restrict__ wu,
                                                       const __nv_bfloat16* __restrict__ wdt, int M, int K, int W,
                                                       const int32_t* __restrict__ ell_col,
                                                       const __nv_bfloat16* __restrict__ ell_a,
                                                       const float* __restrict__ ell_u,
                                                       const int32_t* __restrict__ nnz,
                                                       const int32_t* __restrict__ flag,
                                                       const float* __restrict__ l1c, float* __restrict__ cg,
                                                       float* __restrict__ cu, __nv_bfloat16* __restrict__ dx) {
  const long long row = warp_id();
  const int lane = threadIdx.x & 31;
  if (row >= M) return;
  if (flag[row]) return;  // dense backup row: dx written by the caller
  const int n = nnz[row];
  const int K8 = K >> 3;
  const long long rb = row * W;
  const uint16_t* av = reinterpret_cast<const uint16_t*>(ell_a);
  const float c1s = *l1c;
  {
    uint4 dv[NI];
    load_row<NI>(dv, dy + row * K, K);
    for (int b0 = 0; b0 < n; b0 += 32) {
      const int ne = min(32, n - b0);
      const int col = lane < ne ? ell_col[rb + b0 + lane] : 0;
      const float mydh = gather_dots<NI>(dv, wdt, col, ne, K);
      if (lane < ne) {
        const long long e = rb + b0 + lane;
        const float a = bf2f(av[e]);
        if (GATED) {
          const float u = ell_u[e];
          const float dh = mydh + c1s * signf(a * u);
          cg[e] = dh * u;  // d/d(gate pre-activation): relu' = 1 on stored (active) entries
          cu[e] = dh * a;  // d/du
        } else {
          cg[e] = mydh + c1s * signf(a);
        }
      }
    }
  }
  float acc[NI * 8];
#pragma unroll
  for (int i = 0; i < NI * 8; ++i) acc[i] = 0.f;
  for (int b0 = 0; b0 < n; b0 += 32) {
    const int ne = min(32, n - b0);
    int col = 0;
    float vg = 0.f, vu = 0.f;
    if (lane < ne) {
      const long long e = rb + b0 + lane;
      col = ell_col[e];
      vg = cg[e];
      if (GATED) vu = cu[e];
    }
#pragma unroll 1
    for (int j = 0; j < ne; ++j) {
      const int c0 = __shfl_sync(kFull, col, j);
      const float g0 = __shfl_sync(kFull, vg, j);
      const float u0 = GATED ? __shfl_sync(kFull, vu, j) : 0.f;
      // gated: dx += dg W_g[j] + du W_u[j]; non-gated: dx += dg W_u[j]
      const uint4* r0 = reinterpret_cast<const uint4*>((GATED ? wg : wu) + (long long)c0 * K);
      const uint4* r1 = reinterpret_cast<const uint4*>(wu + (long long)c0 * K);
      uint4 a[NI], b[NI];
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int c = lane + 32 * i;
        a[i] = c < K8 ? __ldg(r0 + c) : make_uint4(0, 0, 0, 0);
        b[i] = (c < K8 && GATED) ? __ldg(r1 + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        axpy8(g0, a[i], acc + 8 * i);
        if (GATED) axpy8(u0, b[i], acc + 8 * i);
      }
    }
  }
  store_row<NI>(dx + row * K, acc, K);
}

// ---------------------------------------------------------------------------------------------------------
// fwd_block / bwd_block: fwd_rows / bwd_rows with one block of 256 threads per light row instead of one warp (the
// inference op's up_down layout, kernels/twell): the row's entries in shared memory, per window of kRbCap entries;
// the gathered dot products one warp per entry against the row (x or dy) staged once in shared memory; the
// accumulation over entries by threads that each own 8-column chunks of the output row (CPT of them; at K < 2048
// the threads split the entries into shares, summed in shared memory at the end). Products and sums run in the
// same order as the warp kernels, so at K >= 2048 every output is bit-identical to theirs.
// COEF (an empty y / dx: the coefficients only, which the op runs) has no output accumulators and runs 6 blocks per
// SM (5 for the non-gated backward, which would spill at 6), its gathered rows loaded 2 chunks per lane at a time (the
// same sums): a row's chain of dependent loads bounds it, so more rows in flight pay (the inference op's up_list,
// kernels/twell: 1.20 -> 1.00 ms at M 65536, 0.5%, H200).
constexpr int kRbThreads = 256;
constexpr int kRbCap = 1024;  // entries per window
template <int NI, bool COEF>
constexpr int kCoefLoads = (COEF && NI <= 8) ? 2 : NI;

template <int NI, bool GATED, bool COEF>
__global__ void __launch_bounds__(kRbThreads, NI <= 8 ? (COEF ? 6 : 4) : 2)
    fwd_block_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wu,
                     const __nv_bfloat16* __restrict__ wdt, int K, int W, const int32_t* __restrict__ ell_col,
                     const __nv_bfloat16* __restrict__ ell_a, const int32_t* __restrict__ nnz,
                     const int32_t* __restrict__ flag, float* __restrict__ ell_u, __nv_bfloat16* __restrict__ y,
                     float* __restrict__ rowabs, float* __restrict__ hout) {
  extern __shared__ int list_j[];                             // [kRbCap] columns, then
  float* list_h = reinterpret_cast<float*>(list_j + kRbCap);  // [kRbCap] a, then h = a u
  uint4* xs = reinterpret_cast<uint4*>(list_h + kRbCap);      // [K / 8] the x row (gated)
  __shared__ float red[kRbThreads * 8];
  constexpr int CPT = (NI + 7) / 8;
  const long long row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, K8 = K >> 3;
  if (flag[row]) {  // dense backup row: y written by the caller; contributes its L1 separately
    if (tid == 0) rowabs[row] = 0.f;
    return;
  }
  const int n = nnz[row];
  const long long rb = row * W;
  const uint16_t* av = reinterpret_cast<const uint16_t*>(ell_a);
  if (GATED)
    for (int c = tid; c < K8; c += kRbThreads) xs[c] = __ldg(reinterpret_cast<const uint4*>(x + row * K) + c);
  const int groups = K8 >= kRbThreads ? 1 : kRbThreads / K8;
  const int grp = groups == 1 ? 0 : (tid / K8 < groups ? tid / K8 : -1);
  const int cc0 = groups == 1 ? tid : tid % K8;
  float acc[CPT * 8];
#pragma unroll
  for (int i = 0; i < CPT * 8; ++i) acc[i] = 0.f;
  float absacc = 0.f;  // warp 0: lane l sums |h_e| for e = l mod 32, ascending (fwd_rows' order)
  for (int e0 = 0; e0 < n; e0 += kRbCap) {
    const int cnt = min(kRbCap, n - e0);
    for (int i = tid; i < cnt; i += kRbThreads) {
      list_j[i] = ell_col[rb + e0 + i];
      list_h[i] = bf2f(av[rb + e0 + i]);
    }
    __syncthreads();
    if (GATED) {
      for (int e = warp; e < cnt; e += kRbThreads / 32) {
        const float u = row_dot_shared<NI, kCoefLoads<NI, COEF>>(xs, wu + (long long)list_j[e] * K, K);
        if (lane == 0) {
          ell_u[rb + e0 + e] = u;
          list_h[e] *= u;
        }
      }
      __syncthreads();
    }
    if (warp == 0)
      for (int e = lane; e < cnt; e += 32) absacc += fabsf(list_h[e]);
    if (COEF)  // the coefficients only (y null): h for dx_slices, which sums y slice-major
      for (int i = tid; i < cnt; i += kRbThreads) hout[rb + e0 + i] = list_h[i];
    else if (grp >= 0) {
#pragma unroll
      for (int q = 0; q < CPT; ++q) {
        const int cc = cc0 + q * kRbThreads;
        if (cc < K8)
          gathered_axpy<8>(acc + 8 * q, reinterpret_cast<const uint4*>(wdt) + cc, list_j, list_h, grp, groups, cnt,
                           K8);
      }
    }
    __syncthreads();  // the next window rewrites the list
  }
  if (!COEF)
    store_shares<CPT, kRbThreads>(acc, red, reinterpret_cast<uint4*>(y + row * K), K8, cc0, grp, groups);
  if (warp == 0) {
    absacc = warp_sum(absacc);
    if (lane == 0) rowabs[row] = absacc;
  }
}

template <int NI, bool GATED, bool COEF>
__global__ void __launch_bounds__(kRbThreads, NI <= 8 ? (COEF ? (GATED ? 6 : 5) : 4) : 2)
    bwd_block_kernel(const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ wg,
                     const __nv_bfloat16* __restrict__ wu, const __nv_bfloat16* __restrict__ wdt, int K, int W,
                     const int32_t* __restrict__ ell_col, const __nv_bfloat16* __restrict__ ell_a,
                     const float* __restrict__ ell_u, const int32_t* __restrict__ nnz,
                     const int32_t* __restrict__ flag, const float* __restrict__ l1c, float* __restrict__ cg,
                     float* __restrict__ cu, __nv_bfloat16* __restrict__ dx) {
  extern __shared__ int list_j[];                             // [kRbCap] columns, then
  float* list_g = reinterpret_cast<float*>(list_j + kRbCap);  // [kRbCap] a, then dg
  float* list_u = list_g + kRbCap;                            // [kRbCap] u, then du (gated)
  uint4* dys = reinterpret_cast<uint4*>(list_u + kRbCap);     // [K / 8] the dy row
  __shared__ float red[kRbThreads * 8];
  constexpr int CPT = (NI + 7) / 8;
  const long long row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, K8 = K >> 3;
  if (flag[row]) return;  // dense backup row: dx written by the caller
  const int n = nnz[row];
  const long long rb = row * W;
  const uint16_t* av = reinterpret_cast<const uint16_t*>(ell_a);
  const float c1s = *l1c;
  for (int c = tid; c < K8; c += kRbThreads) dys[c] = __ldg(reinterpret_cast<const uint4*>(dy + row * K) + c);
  const int groups = K8 >= kRbThreads ? 1 : kRbThreads / K8;
  const int grp = groups == 1 ? 0 : (tid / K8 < groups ? tid / K8 : -1);
  const int cc0 = groups == 1 ? tid : tid % K8;
  float acc[CPT * 8];
#pragma unroll
  for (int i = 0; i < CPT * 8; ++i) acc[i] = 0.f;
  for (int e0 = 0; e0 < n; e0 += kRbCap) {
    const int cnt = min(kRbCap, n - e0);
    for (int i = tid; i < cnt; i += kRbThreads) {
      list_j[i] = ell_col[rb + e0 + i];
      list_g[i] = bf2f(av[rb + e0 + i]);
      if (GATED) list_u[i] = ell_u[rb + e0 + i];
    }
    __syncthreads();
    for (int e = warp; e < cnt; e += kRbThreads / 32) {
      const float dh = row_dot_shared<NI, kCoefLoads<NI, COEF>>(dys, wdt + (long long)list_j[e] * K, K);
      if (lane == 0) {
        const long long g = rb + e0 + e;
        const float a = list_g[e];
        if (GATED) {
          const float u = list_u[e];
          const float d = dh + c1s * signf(a * u);
          list_g[e] = cg[g] = d * u;  // d/d(gate pre-activation): relu' = 1 on stored (active) entries
          list_u[e] = cu[g] = d * a;  // d/du
        } else {
          list_g[e] = cg[g] = dh + c1s * signf(a);
        }
      }
    }
    __syncthreads();
    // dx += dg W_g[j] + du W_u[j] (non-gated: dg W_u[j]); per entry the W_g term first, as bwd_rows adds them.
    // dx null: the coefficients only (dx_slices adds them up afterwards, one L2-sized K slice at a time)
    if (grp >= 0 && !COEF) {
#pragma unroll
      for (int q = 0; q < CPT; ++q) {
        const int cc = cc0 + q * kRbThreads;
        if (cc >= K8) continue;
        const uint4* bg = reinterpret_cast<const uint4*>(GATED ? wg : wu) + cc;
        const uint4* bu = reinterpret_cast<const uint4*>(wu) + cc;
        constexpr int kU = 4;  // entries in flight (two loads each when gated)
        int e = grp;
        for (; e + (kU - 1) * groups < cnt; e += kU * groups) {
          uint4 vg[kU], vu[kU];
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const long long j = (long long)list_j[e + u * groups] * K8;
            vg[u] = __ldg(bg + j);
            if (GATED) vu[u] = __ldg(bu + j);
          }
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            axpy8(list_g[e + u * groups], vg[u], acc + 8 * q);
            if (GATED) axpy8(list_u[e + u * groups], vu[u], acc + 8 * q);
          }
        }
        for (; e < cnt; e += groups) {
          const long long j = (long long)list_j[e] * K8;
          axpy8(list_g[e], __ldg(bg + j), acc + 8 * q);
          if (GATED) axpy8(list_u[e], __ldg(bu + j), acc + 8 * q);
        }
      }
    }
    __syncthreads();  // the next window rewrites the lists
  }
  if (!COEF)
    store_shares<CPT, kRbThreads>(acc, red, reinterpret_cast<uint4*>(dx + row * K), K8, cc0, grp, groups);
}

// ---------------------------------------------------------------------------------------------------------
// dw: one warp per (neuron j, K slice of 256*NB, part), for parts part0 .. part0 + parts - 1. part 0: rows of x
// with coefficients cg (and cu when gated) -> dW_g / dW_u (non-gated: cg -> dW_u). part 1: rows of dy with
// coefficient h -> dW_dT (the op runs part 1 as dwd_dh below, which also forms the coefficients' dot products).
// perm: flat ELL indices (row * W + slot) sorted by neuron; colptr int64 [N + 1].
// Work order: part, then K slice, then neuron (adjacent warps = adjacent neurons). The warps resident at once
// then gather from one K slice of one of x / dy (M x 256 NB x 2 bytes, 16 MB at M 16384, NB 2) instead of
// whole rows of both (128 MB), and the L2 holds it: 0.99 -> 0.54 ms at M 16384, 0.5% (neuron-major order read
// a 23% L2 hit rate; lab/results/kernel_bench.tar.xz: dw_order_ab_h100_d457621.jsonl). Same sums, same bits.
template <int NB, bool GATED>
__global__ void __launch_bounds__(128) dw_kernel(const __nv_bfloat16* __restrict__ x,
                                                 const __nv_bfloat16* __restrict__ dy, int N, int K, int W,
                                                 const int64_t* __restrict__ perm,
                                                 const int64_t* __restrict__ colptr,
                                                 const __nv_bfloat16* __restrict__ ell_a,
                                                 const float* __restrict__ ell_u, const float* __restrict__ cg,
                                                 const float* __restrict__ cu,
                                                 const __nv_bfloat16* __restrict__ add_g,
                                                 const __nv_bfloat16* __restrict__ add_u,
                                                 const __nv_bfloat16* __restrict__ add_d,
                                                 __nv_bfloat16* __restrict__ dwg, __nv_bfloat16* __restrict__ dwu,
                                                 __nv_bfloat16* __restrict__ dwdt, int part0, int parts) {
  const int K8 = K >> 3;
  const int kslices = (K8 + 32 * NB - 1) / (32 * NB);
  const long long w = warp_id();
  const int lane = threadIdx.x & 31;
  if (w >= (long long)N * kslices * parts) return;
  const int j = (int)(w % N);
  const int ks = (int)((w / N) % kslices);
  const int part = part0 + (int)(w / ((long long)N * kslices));
  const int cbase = ks * 32 * NB + lane;
  const long long p0 = colptr[j], p1 = colptr[j + 1];
  const uint16_t* av = reinterpret_cast<const uint16_t*>(ell_a);
  const bool two_out = GATED && part == 0;
  const __nv_bfloat16* src = part == 0 ? x : dy;
  float acc1[NB * 8], acc2[NB * 8];
#pragma unroll
  for (int i = 0; i < NB * 8; ++i) { acc1[i] = 0.f; acc2[i] = 0.f; }
  for (long long q0 = p0; q0 < p1; q0 += 32) {
    const int ne = (int)min(32LL, p1 - q0);
    long long r = 0;
    float k1 = 0.f, k2 = 0.f;
    if (lane < ne) {
      const long long e = perm[q0 + lane];
      r = e / W;
      if (part == 0) {
        k1 = cg[e];
        if (GATED) k2 = cu[e];
      } else {
        k1 = bf2f(av[e]);
        if (GATED) k1 *= ell_u[e];
      }
    }
#pragma unroll 1
    for (int t = 0; t < ne; t += 2) {
      const bool two = (t + 1) < ne;
      const long long r0 = __shfl_sync(kFull, r, t);
      const long long r1 = __shfl_sync(kFull, r, two ? t + 1 : t);
      const float a0 = __shfl_sync(kFull, k1, t), a1 = two ? __shfl_sync(kFull, k1, t + 1) : 0.f;
      const float b0 = __shfl_sync(kFull, k2, t), b1 = two ? __shfl_sync(kFull, k2, t + 1) : 0.f;
      const uint4* s0 = reinterpret_cast<const uint4*>(src + r0 * K);
      const uint4* s1 = reinterpret_cast<const uint4*>(src + r1 * K);
      uint4 va[NB], vb[NB];
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        const int c = cbase + 32 * i;
        va[i] = c < K8 ? __ldg(s0 + c) : make_uint4(0, 0, 0, 0);
        vb[i] = (c < K8 && two) ? __ldg(s1 + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        axpy8(a0, va[i], acc1 + 8 * i);
        axpy8(a1, vb[i], acc1 + 8 * i);
        if (two_out) {
          axpy8(b0, va[i], acc2 + 8 * i);
          axpy8(b1, vb[i], acc2 + 8 * i);
        }
      }
    }
  }
  __nv_bfloat16* o1 = part == 1 ? dwdt : (GATED ? dwg : dwu);
  const __nv_bfloat16* ad1 = part == 1 ? add_d : (GATED ? add_g : add_u);
#pragma unroll
  for (int i = 0; i < NB; ++i) {
    const int c = cbase + 32 * i;
    if (c >= K8) continue;
    const long long off = (long long)j * K8 + c;
    if (ad1 != nullptr) {
      const uint4 ad = reinterpret_cast<const uint4*>(ad1)[off];
      axpy8(1.f, ad, acc1 + 8 * i);
    }
    reinterpret_cast<uint4*>(o1)[off] = pack8(acc1 + 8 * i);
    if (two_out) {
      if (add_u != nullptr) {
        const uint4 ad = reinterpret_cast<const uint4*>(add_u)[off];
        axpy8(1.f, ad, acc2 + 8 * i);
      }
      reinterpret_cast<uint4*>(dwu)[off] = pack8(acc2 + 8 * i);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// acc += h v and returns dot + v . w over one 16-byte chunk, each value of v converted once (dot8's order)
__device__ __forceinline__ float axpy_dot8(float h, const uint4& v, const uint4& w, float* acc, float dot) {
  const uint32_t vv[4] = {v.x, v.y, v.z, v.w}, ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float lo = bf16lo(vv[k]), hi = bf16hi(vv[k]);
    acc[2 * k] = fmaf(h, lo, acc[2 * k]);
    acc[2 * k + 1] = fmaf(h, hi, acc[2 * k + 1]);
    dot = fmaf(lo, bf16lo(ww[k]), dot);
    dot = fmaf(hi, bf16hi(ww[k]), dot);
  }
  return dot;
}

// dwd_dh: dw's part 1 (dW_dT[j] = sum h_e dy_r, the same sums as dw_kernel's) and, from the same dy slices, the
// backward's dot products dh_e = dy_r . W_dT[j] in partial sums: P[s, q] = dy_r[slice s] . W_dT[j, slice s] for CSR
// entry q = (r, j) and each 256-column slice s. The token-major coefficient pass (bwd_block) read a whole 4 KB W_dT
// row per entry; here W_dT[j]'s slice is read once per warp and dy_r's slice, which dW_dT reads anyway, serves
// both. Each lane's 8-column partial goes to shared memory (no shuffle chain in the loop); after each 32 entries
// lane t adds entry t's 32 partials in lane order. Same bits at every NB; dh_coef adds the slices in order.
constexpr int kDwdMaxNb = 2;  // shared memory: 16.9 KB per block and slice width
template <int NB>
__global__ void __launch_bounds__(128) dwd_dh_kernel(const __nv_bfloat16* __restrict__ dy,
                                                     const __nv_bfloat16* __restrict__ wdt, int N, int K, int W,
                                                     const int64_t* __restrict__ perm,
                                                     const int64_t* __restrict__ colptr,
                                                     const __nv_bfloat16* __restrict__ ell_a,
                                                     const float* __restrict__ ell_u,
                                                     const __nv_bfloat16* __restrict__ add_d,
                                                     __nv_bfloat16* __restrict__ dwdt, float* __restrict__ part,
                                                     long long pstride) {
  __shared__ float red_all[4][NB][32][33];  // per warp: [slice][entry of the chunk][lane], padded (no conflicts)
  const int K8 = K >> 3, nsub = (K8 + 31) / 32;
  const int kslices = (K8 + 32 * NB - 1) / (32 * NB);
  const long long w = warp_id();
  const int lane = threadIdx.x & 31;
  if (w >= (long long)N * kslices) return;
  float(*red)[32][33] = red_all[(threadIdx.x >> 5) & 3];
  const int j = (int)(w % N);
  const int ks = (int)(w / N);
  const int cbase = ks * 32 * NB + lane;
  const long long p0 = colptr[j], p1 = colptr[j + 1];
  const uint16_t* av = reinterpret_cast<const uint16_t*>(ell_a);
  uint4 wd[NB];
#pragma unroll
  for (int i = 0; i < NB; ++i) {
    const int c = cbase + 32 * i;
    wd[i] = c < K8 ? __ldg(reinterpret_cast<const uint4*>(wdt) + (long long)j * K8 + c) : make_uint4(0, 0, 0, 0);
  }
  float acc[NB * 8];
#pragma unroll
  for (int i = 0; i < NB * 8; ++i) acc[i] = 0.f;
  for (long long q0 = p0; q0 < p1; q0 += 32) {
    const int ne = (int)min(32LL, p1 - q0);
    long long r = 0;
    float hq = 0.f;
    if (lane < ne) {
      const long long e = perm[q0 + lane];
      r = e / W;
      hq = bf2f(av[e]);
      if (ell_u != nullptr) hq *= ell_u[e];
    }
#pragma unroll 1
    for (int t = 0; t < ne; t += 2) {
      const bool two = (t + 1) < ne;
      const long long r0 = __shfl_sync(kFull, r, t);
      const long long r1 = __shfl_sync(kFull, r, two ? t + 1 : t);
      const float a0 = __shfl_sync(kFull, hq, t), a1 = two ? __shfl_sync(kFull, hq, t + 1) : 0.f;
      const uint4* s0 = reinterpret_cast<const uint4*>(dy + r0 * K);
      const uint4* s1 = reinterpret_cast<const uint4*>(dy + r1 * K);
      uint4 va[NB], vb[NB];
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        const int c = cbase + 32 * i;
        va[i] = c < K8 ? __ldg(s0 + c) : make_uint4(0, 0, 0, 0);
        vb[i] = (c < K8 && two) ? __ldg(s1 + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        red[i][t][lane] = axpy_dot8(a0, va[i], wd[i], acc + 8 * i, 0.f);
        red[i][t + 1][lane] = axpy_dot8(a1, vb[i], wd[i], acc + 8 * i, 0.f);  // t + 1 <= 31: t is even
      }
    }
    __syncwarp();
    if (lane < ne && q0 + lane < pstride)  // pstride < the entries: dh_coef traps
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        if (ks * NB + i >= nsub) continue;
        float sum = red[i][lane][0];
#pragma unroll 8
        for (int l = 1; l < 32; ++l) sum += red[i][lane][l];
        part[(long long)(ks * NB + i) * pstride + q0 + lane] = sum;
      }
    __syncwarp();  // the next chunk rewrites red
  }
#pragma unroll
  for (int i = 0; i < NB; ++i) {
    const int c = cbase + 32 * i;
    if (c >= K8) continue;
    const long long off = (long long)j * K8 + c;
    if (add_d != nullptr) axpy8(1.f, reinterpret_cast<const uint4*>(add_d)[off], acc + 8 * i);
    reinterpret_cast<uint4*>(dwdt)[off] = pack8(acc + 8 * i);
  }
}

// dh_coef: per light entry (CSR position q < pstride, ELL index e = perm[q]) dh = the slices' partial dot products
// added in slice order, then bwd_block's coefficients: gated d = dh + c sign(a u), cg = d u, cu = d a; non-gated
// cg = dh + c sign(a). c = the L1 output's gradient times its scale, read on the device.
template <bool GATED>
__global__ void __launch_bounds__(256) dh_coef_kernel(const float* __restrict__ part, long long pstride, int nsub,
                                                      const int64_t* __restrict__ perm,
                                                      const int64_t* __restrict__ colptr, int N,
                                                      const __nv_bfloat16* __restrict__ ell_a,
                                                      const float* __restrict__ ell_u, const float* __restrict__ l1c,
                                                      float* __restrict__ cg, float* __restrict__ cu) {
  const long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (q == 0 && colptr[N] > pstride) __trap();  // a column per light entry is the caller's contract: never drop one
  if (q >= colptr[N] || q >= pstride) return;
  const long long e = perm[q];
  float dh = part[q];
  for (int s = 1; s < nsub; ++s) dh += part[(long long)s * pstride + q];
  const float a = bf2f(reinterpret_cast<const uint16_t*>(ell_a)[e]), c = *l1c;
  if (GATED) {
    const float u = ell_u[e], d = dh + c * signf(a * u);
    cg[e] = d * u;
    cu[e] = d * a;
  } else {
    cg[e] = dh + c * signf(a);
  }
}

// ---------------------------------------------------------------------------------------------------------
// count: per-row number of active entries of a = relu(...) (a != 0; NaN counts) for the dense path's stats.
// One warp per row, 16-byte loads (torch's (a != 0).sum(1) reaches ~375 GB/s on [16384, 5632]).
__global__ void __launch_bounds__(256) count_kernel(const __nv_bfloat16* __restrict__ a, long long lda, int rows,
                                                    int N, int32_t* __restrict__ nnz) {
  const long long row = warp_id();
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const __nv_bfloat16* ar = a + row * lda;
  int cnt = 0;
  for (int c = lane * 8; c < N; c += 256) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(ar + c));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) cnt += ((w[i] & 0x7fffu) != 0) + ((w[i] & 0x7fff0000u) != 0);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(kFull, cnt, o);
  if (lane == 0) nnz[row] = cnt;
}

// ---------------------------------------------------------------------------------------------------------
// dense_bwd: the dense path's elementwise backward in one pass (train_ffn's fused dense autograd function).
// t = dh + c sgn(h) with c = gl1[0] * scale (the L1 term; sgn(NaN) = NaN, as torch's abs backward);
// gated: dg = t u where relu(g) passes gradient (g > 0 or NaN, as torch's threshold_backward) else 0,
// du = t relu(g); non-gated: dg = t where relu(g) passes gradient else 0. dg overwrites dh in place.
// fp32 math, one bf16 rounding per output (torch rounds after every op). All [n] contiguous, n % 8 == 0.
template <bool GATED>
__global__ void __launch_bounds__(256) dense_bwd_kernel(__nv_bfloat16* dh, const __nv_bfloat16* __restrict__ g,
                                                        const __nv_bfloat16* __restrict__ u,
                                                        const __nv_bfloat16* __restrict__ h,
                                                        __nv_bfloat16* __restrict__ du, long long n8,
                                                        const float* __restrict__ gl1, float scale) {
  const float c = gl1[0] * scale;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
    const uint4 dv = reinterpret_cast<const uint4*>(dh)[i];
    const uint4 gv = __ldcs(reinterpret_cast<const uint4*>(g) + i);
    const uint4 hv = __ldcs(reinterpret_cast<const uint4*>(h) + i);
    uint4 uv = make_uint4(0, 0, 0, 0);
    if (GATED) uv = __ldcs(reinterpret_cast<const uint4*>(u) + i);
    const uint32_t dw[4] = {dv.x, dv.y, dv.z, dv.w}, gw[4] = {gv.x, gv.y, gv.z, gv.w};
    const uint32_t hw[4] = {hv.x, hv.y, hv.z, hv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
    float og[8], ou[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int q = k >> 1;
      const bool hi = k & 1;
      const float d = hi ? bf16hi(dw[q]) : bf16lo(dw[q]);
      const float gg = hi ? bf16hi(gw[q]) : bf16lo(gw[q]);
      const float hh = hi ? bf16hi(hw[q]) : bf16lo(hw[q]);
      const float sg = (hh > 0.f) ? 1.f : (hh < 0.f) ? -1.f : 0.f;  // sgn(NaN) = 0, as dense autograd's abs backward
      const float t = d + c * sg;
      const bool pass = gg > 0.f || gg != gg;                   // relu(g) > 0, or NaN
      const float a = pass ? gg : 0.f;                          // relu(g)
      if (GATED) {
        const float uu = hi ? bf16hi(uw[q]) : bf16lo(uw[q]);
        og[k] = pass ? t * uu : 0.f;
        ou[k] = t * a;
      } else {
        og[k] = pass ? t : 0.f;
      }
    }
    reinterpret_cast<uint4*>(dh)[i] = pack8(og);
    if (GATED) reinterpret_cast<uint4*>(du)[i] = pack8(ou);
  }
}

// ---------------------------------------------------------------------------------------------------------
// transpose: bf16 src [R, C] (row stride lds, unit column stride) -> dst [C, R] contiguous; R, C, lds % 8 == 0.
// 64 x 64 tiles through shared memory, 16-byte loads and stores (torch's .t().contiguous() copy reaches ~0.7 TB/s
// on [2048, 5632]; the neuron-major W_d and the W_d gradient go through this each step).
constexpr int kTT = 64;
__global__ void __launch_bounds__(256) transpose_kernel(const uint16_t* __restrict__ src, long long lds, int R, int C,
                                                        uint16_t* __restrict__ dst) {
  __shared__ uint16_t tile[kTT][kTT + 2];
  const int r0 = blockIdx.y * kTT, c0 = blockIdx.x * kTT;
  for (int v = threadIdx.x; v < kTT * kTT / 8; v += blockDim.x) {
    const int r = v >> 3, cv = (v & 7) * 8;
    if (r0 + r < R && c0 + cv < C) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(src + (long long)(r0 + r) * lds + c0 + cv));
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        tile[r][cv + 2 * i] = (uint16_t)(w[i] & 0xffffu);
        tile[r][cv + 2 * i + 1] = (uint16_t)(w[i] >> 16);
      }
    }
  }
  __syncthreads();
  for (int v = threadIdx.x; v < kTT * kTT / 8; v += blockDim.x) {
    const int c = v >> 3, rv = (v & 7) * 8;
    if (c0 + c < C && r0 + rv < R) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = (uint32_t)tile[rv + 2 * i][c] | ((uint32_t)tile[rv + 2 * i + 1][c] << 16);
      *reinterpret_cast<uint4*>(dst + (long long)(c0 + c) * R + r0 + rv) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// CSR by neuron (the dw kernel's input): a counting sort of the light ELL entries by neuron, rows ascending
// within a neuron (the order of the reference's stable sort, so the weight-gradient sums are deterministic).
// Rows are cut into B blocks of rb rows. count: per-block histogram cnt[b, j]; colscan: per-neuron exclusive
// prefix over blocks (in place) and the neuron's total; scan_totals: colptr = exclusive prefix of totals (one
// block); scatter: each block walks its rows in order (16 at a time staged in shared memory) and writes each
// entry's flat index row * W + slot at colptr[j] + cnt[b, j] + (entries of j already written by the block).
// A row never holds a neuron twice, so the threads of one row never collide.
__device__ __forceinline__ bool light_slot(const int32_t* nnz, const int32_t* flag, long long r, int s) {
  return flag[r] == 0 && s < nnz[r];
}

__global__ void __launch_bounds__(256) csr_count_kernel(const int32_t* __restrict__ ell_col, int W,
                                                        const int32_t* __restrict__ nnz,
                                                        const int32_t* __restrict__ flag, int M, int N, int rb,
                                                        int32_t* __restrict__ cnt) {
  extern __shared__ int32_t hist[];
  const long long r0 = (long long)blockIdx.x * rb;
  const int rows = (int)min((long long)rb, (long long)M - r0);
  for (int j = threadIdx.x; j < N; j += blockDim.x) hist[j] = 0;
  __syncthreads();
  for (long long e = threadIdx.x; e < (long long)rows * W; e += blockDim.x) {
    const long long r = r0 + e / W;
    const int s = (int)(e % W);
    if (!light_slot(nnz, flag, r, s)) continue;
    const int j = ell_col[r * W + s];
    if ((unsigned)j < (unsigned)N) atomicAdd(&hist[j], 1);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < N; j += blockDim.x) cnt[(long long)blockIdx.x * N + j] = hist[j];
}

__global__ void __launch_bounds__(256) csr_colscan_kernel(int32_t* __restrict__ cnt, int B, int N,
                                                          int64_t* __restrict__ total) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= N) return;
  int32_t run = 0;
#pragma unroll 8
  for (int b = 0; b < B; ++b) {
    const int32_t c = cnt[(long long)b * N + j];
    cnt[(long long)b * N + j] = run;
    run += c;
  }
  total[j] = run;
}

__global__ void __launch_bounds__(1024) csr_scan_totals_kernel(const int64_t* __restrict__ total, int N,
                                                               int64_t* __restrict__ colptr) {
  __shared__ int64_t warp_sums[32];
  const int t = threadIdx.x, per = (N + 1023) / 1024;
  const int a = min(N, t * per), b = min(N, a + per);
  int64_t mine = 0;
  for (int j = a; j < b; ++j) mine += total[j];
  // inclusive scan of the per-thread sums: within warps, then over warp totals
  int64_t inc = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t v = __shfl_up_sync(kFull, inc, o);
    if ((t & 31) >= o) inc += v;
  }
  if ((t & 31) == 31) warp_sums[t >> 5] = inc;
  __syncthreads();
  if (t < 32) {
    int64_t w = warp_sums[t];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t v = __shfl_up_sync(kFull, w, o);
      if (t >= o) w += v;
    }
    warp_sums[t] = w;
  }
  __syncthreads();
  int64_t run = inc - mine + ((t >> 5) > 0 ? warp_sums[(t >> 5) - 1] : 0);
  for (int j = a; j < b; ++j) {
    colptr[j] = run;
    run += total[j];
  }
  if (t == 1023) colptr[N] = run;
}

constexpr int kStageRows = 16;
__global__ void __launch_bounds__(256) csr_scatter_kernel(const int32_t* __restrict__ ell_col, int W,
                                                          const int32_t* __restrict__ nnz,
                                                          const int32_t* __restrict__ flag, int M, int N, int rb,
                                                          const int32_t* __restrict__ cnt,
                                                          const int64_t* __restrict__ colptr,
                                                          int64_t* __restrict__ perm) {
  extern __shared__ int64_t cursor[];                                   // [N], then the staged rows
  int32_t* stage = reinterpret_cast<int32_t*>(cursor + N);              // [kStageRows, W]
  int32_t* stage_n = stage + kStageRows * W;                            // [kStageRows]: light count (0 if flagged)
  const long long r0 = (long long)blockIdx.x * rb;
  const int rows = (int)min((long long)rb, (long long)M - r0);
  for (int j = threadIdx.x; j < N; j += blockDim.x) cursor[j] = colptr[j] + cnt[(long long)blockIdx.x * N + j];
  for (int q0 = 0; q0 < rows; q0 += kStageRows) {
    const int nq = min(kStageRows, rows - q0);
    __syncthreads();  // the previous stage is consumed (and the cursors are set)
    for (int e = threadIdx.x; e < nq * W; e += blockDim.x) stage[e] = ell_col[(r0 + q0) * W + e];
    for (int q = threadIdx.x; q < nq; q += blockDim.x) {
      const long long r = r0 + q0 + q;
      stage_n[q] = flag[r] == 0 ? min(nnz[r], W) : 0;
    }
    __syncthreads();
    for (int q = 0; q < nq; ++q) {
      const long long r = r0 + q0 + q;
      for (int s = threadIdx.x; s < stage_n[q]; s += blockDim.x) {
        const int j = stage[q * W + s];
        if ((unsigned)j >= (unsigned)N) continue;
        perm[cursor[j]++] = r * W + s;
      }
      __syncthreads();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// last_active: for each column j of a bf16 [rows, N] matrix (row stride lda), the last row r where a[r, j] is
// relu-active (> 0 or NaN: relu(g) != 0 for a pre-activation g, a != 0 for a = relu(g)); `last` int64 [N] holds -1 on
// entry. One warp per (256 columns, chunk of kLastRows rows), scanning its rows bottom-up and stopping once every
// column has been seen; one atomicMax per column and chunk. Replaces torch's flip + argmax over an [rows, N] mask
// (about six passes over the matrix) for the dead-neuron tracker of the dense path.
constexpr int kLastRows = 128;
__global__ void __launch_bounds__(256) last_active_kernel(const __nv_bfloat16* __restrict__ a, long long lda, int rows,
                                                          int N, long long* __restrict__ last) {
  const int lane = threadIdx.x & 31;
  const long long group = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (group * 256 >= N) return;  // warp-uniform
  const int c = (int)(group * 256) + lane * 8;
  const bool ok = c < N;
  const int r_lo = blockIdx.y * kLastRows;
  const int r_hi = min(rows, r_lo + kLastRows) - 1;
  unsigned todo = ok ? 0xffu : 0u;
  int found[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) found[i] = -1;
  for (int r0 = r_hi; r0 >= r_lo; r0 -= 4) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)  // four rows in flight
      v[k] = (ok && r0 - k >= r_lo) ? __ldg(reinterpret_cast<const uint4*>(a + (long long)(r0 - k) * lda + c))
                                     : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      bool nf = false;
      const unsigned hit = relu_mask8(v[k], nf) & todo;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if ((hit >> i) & 1u) found[i] = r0 - k;
      todo &= ~hit;
    }
    if (__all_sync(kFull, todo == 0u)) break;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (found[i] >= 0) atomicMax(last + c + i, (long long)found[i]);
}

// last_active_ell: the same tracker from the sparse path's saved ELL (light rows only; the caller adds the backup
// rows): one thread per (row, slot), atomicMax of the row into its column. A stored entry's column is one of the
// row's active neurons, so the atomics spread over the active columns (no shared spare column: the scatter that
// sent every invalid slot to one address lost 14% at model level, lab/README.md). Replaces nonzero(), a host sync.
__global__ void __launch_bounds__(256) last_active_ell_kernel(const int32_t* __restrict__ ell_col, int W,
                                                              const int32_t* __restrict__ nnz,
                                                              const int32_t* __restrict__ flag, int rows,
                                                              long long* last) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)rows * W) return;
  const int r = (int)(i / W), s = (int)(i % W);
  if (flag[r] || s >= min(nnz[r], W)) return;
  const int j = ell_col[i];
  if (last[j] < r) atomicMax(last + j, (long long)r);  // a plain read first: most atomics are skipped
}

inline unsigned blocks_for(long long warps, int threads) {
  return (unsigned)((warps * 32 + threads - 1) / threads);
}

}  // namespace sfltrain

// ============================== extern launchers (called from binding.cpp) ==============================
extern "C" {

cudaError_t sfltrain_compact_launch(const void* g, long long ldg, int rows, int N, int W, int Wm, int32_t* ell_col,
                                    void* ell_a, int32_t* nnz, int32_t* flag, int64_t* summary,
                                    cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (N % 8 != 0 || ldg % 8 != 0 || W < 1 || Wm < W) return cudaErrorInvalidValue;
  sfltrain::compact_kernel<<<sfltrain::blocks_for(rows, 256), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(g), ldg, rows, N, W, Wm, ell_col,
      reinterpret_cast<__nv_bfloat16*>(ell_a), nnz, flag, reinterpret_cast<unsigned long long*>(summary));
  return cudaGetLastError();
}

cudaError_t sfltrain_count_launch(const void* a, long long lda, int rows, int N, int32_t* nnz, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (N % 8 != 0 || lda % 8 != 0) return cudaErrorInvalidValue;
  sfltrain::count_kernel<<<sfltrain::blocks_for(rows, 256), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(a), lda, rows, N, nnz);
  return cudaGetLastError();
}

#define SFL_NI_SWITCH(NI_VAR, CASE)                                                                     \
  switch (NI_VAR) {                                                                                     \
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)                                     \
    CASE(9) CASE(10) CASE(11) CASE(12)                                                                  \
    default: return cudaErrorInvalidValue;                                                              \
  }

cudaError_t sfltrain_fwd_rows_launch(int gated, const void* x, const void* wu, const void* wdt, int M, int K, int W,
                                     const int32_t* ell_col, const void* ell_a, const int32_t* nnz,
                                     const int32_t* flag, float* ell_u, void* y, float* rowabs,
                                     cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (K % 8 != 0 || K > 3072 || W < 1) return cudaErrorInvalidValue;
  const int ni = (K / 8 + 31) / 32;
  const unsigned blocks = sfltrain::blocks_for(M, 128);
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* wub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* wdb = reinterpret_cast<const __nv_bfloat16*>(wdt);
  const auto* ab = reinterpret_cast<const __nv_bfloat16*>(ell_a);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
#define SFL_FWD_CASE(NI_)                                                                                 \
  case NI_:                                                                                               \
    if (gated)                                                                                            \
      sfltrain::fwd_rows_kernel<NI_, true><<<blocks, 128, 0, stream>>>(xb, wub, wdb, M, K, W, ell_col, ab, \
                                                                       nnz, flag, ell_u, yb, rowabs);     \
    else                                                                                                  \
      sfltrain::fwd_rows_kernel<NI_, false><<<blocks, 128, 0, stream>>>(xb, wub, wdb, M, K, W, ell_col,   \
                                                                        ab, nnz, flag, ell_u, yb, rowabs); \
    break;
  SFL_NI_SWITCH(ni, SFL_FWD_CASE)
#undef SFL_FWD_CASE
  return cudaGetLastError();
}

cudaError_t sfltrain_bwd_rows_launch(int gated, const void* dy, const void* wg, const void* wu, const void* wdt,
                                     int M, int K, int W, const int32_t* ell_col, const void* ell_a,
                                     const float* ell_u, const int32_t* nnz, const int32_t* flag, const float* l1c,
                                     float* cg, float* cu, void* dx, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (K % 8 != 0 || K > 3072 || W < 1) return cudaErrorInvalidValue;
  const int ni = (K / 8 + 31) / 32;
  const unsigned blocks = sfltrain::blocks_for(M, 128);
  const auto* dyb = reinterpret_cast<const __nv_bfloat16*>(dy);
  const auto* wgb = reinterpret_cast<const __nv_bfloat16*>(wg);
  const auto* wub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* wdb = reinterpret_cast<const __nv_bfloat16*>(wdt);
  const auto* ab = reinterpret_cast<const __nv_bfloat16*>(ell_a);
  auto* dxb = reinterpret_cast<__nv_bfloat16*>(dx);
#define SFL_BWD_CASE(NI_)                                                                                   \
  case NI_:                                                                                                 \
    if (gated)                                                                                              \
      sfltrain::bwd_rows_kernel<NI_, true><<<blocks, 128, 0, stream>>>(dyb, wgb, wub, wdb, M, K, W, ell_col, \
                                                                       ab, ell_u, nnz, flag, l1c, cg, cu,   \
                                                                       dxb);                                \
    else                                                                                                    \
      sfltrain::bwd_rows_kernel<NI_, false><<<blocks, 128, 0, stream>>>(dyb, wgb, wub, wdb, M, K, W,        \
                                                                        ell_col, ab, ell_u, nnz, flag, l1c, \
                                                                        cg, cu, dxb);                       \
    break;
  SFL_NI_SWITCH(ni, SFL_BWD_CASE)
#undef SFL_BWD_CASE
  return cudaGetLastError();
}

// fwd_block / bwd_block: one block per row (grid = M); NI buckets 2 / 4 / 8 / 16 (row_dot_shared's chunks per lane).
cudaError_t sfltrain_fwd_block_launch(int gated, const void* x, const void* wu, const void* wdt, int M, int K, int W,
                                      const int32_t* ell_col, const void* ell_a, const int32_t* nnz,
                                      const int32_t* flag, float* ell_u, void* y, float* rowabs, float* hout,
                                      cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (K % 8 != 0 || K > 3072 || W < 1 || (y == nullptr && hout == nullptr)) return cudaErrorInvalidValue;
  const int ni = (K / 8 + 31) / 32;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* wub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* wdb = reinterpret_cast<const __nv_bfloat16*>(wdt);
  const auto* ab = reinterpret_cast<const __nv_bfloat16*>(ell_a);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
  const size_t smem = (size_t)sfltrain::kRbCap * 8 + (gated ? (size_t)K * 2 : 0);
#define SFL_FWDB_K(NI_, G_)                                                                                    \
  {                                                                                                            \
    if (y == nullptr)                                                                                          \
      sfltrain::fwd_block_kernel<NI_, G_, true><<<(unsigned)M, sfltrain::kRbThreads, smem, stream>>>(          \
          xb, wub, wdb, K, W, ell_col, ab, nnz, flag, ell_u, yb, rowabs, hout);                                \
    else                                                                                                       \
      sfltrain::fwd_block_kernel<NI_, G_, false><<<(unsigned)M, sfltrain::kRbThreads, smem, stream>>>(         \
          xb, wub, wdb, K, W, ell_col, ab, nnz, flag, ell_u, yb, rowabs, hout);                                \
  }
#define SFL_FWDB(NI_)                                                                                          \
  {                                                                                                            \
    if (gated)                                                                                                 \
      SFL_FWDB_K(NI_, true)                                                                                    \
    else                                                                                                       \
      SFL_FWDB_K(NI_, false)                                                                                   \
  }
  if (ni <= 2) SFL_FWDB(2) else if (ni <= 4) SFL_FWDB(4) else if (ni <= 8) SFL_FWDB(8) else SFL_FWDB(16)
#undef SFL_FWDB
#undef SFL_FWDB_K
  return cudaGetLastError();
}

cudaError_t sfltrain_bwd_block_launch(int gated, const void* dy, const void* wg, const void* wu, const void* wdt,
                                      int M, int K, int W, const int32_t* ell_col, const void* ell_a,
                                      const float* ell_u, const int32_t* nnz, const int32_t* flag, const float* l1c,
                                      float* cg, float* cu, void* dx, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (K % 8 != 0 || K > 3072 || W < 1) return cudaErrorInvalidValue;
  const int ni = (K / 8 + 31) / 32;
  const auto* dyb = reinterpret_cast<const __nv_bfloat16*>(dy);
  const auto* wgb = reinterpret_cast<const __nv_bfloat16*>(wg);
  const auto* wub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* wdb = reinterpret_cast<const __nv_bfloat16*>(wdt);
  const auto* ab = reinterpret_cast<const __nv_bfloat16*>(ell_a);
  auto* dxb = reinterpret_cast<__nv_bfloat16*>(dx);
  const size_t smem = (size_t)sfltrain::kRbCap * 12 + (size_t)K * 2;
#define SFL_BWDB_K(NI_, G_)                                                                                    \
  {                                                                                                            \
    if (dx == nullptr)                                                                                         \
      sfltrain::bwd_block_kernel<NI_, G_, true><<<(unsigned)M, sfltrain::kRbThreads, smem, stream>>>(          \
          dyb, wgb, wub, wdb, K, W, ell_col, ab, ell_u, nnz, flag, l1c, cg, cu, dxb);                          \
    else                                                                                                       \
      sfltrain::bwd_block_kernel<NI_, G_, false><<<(unsigned)M, sfltrain::kRbThreads, smem, stream>>>(         \
          dyb, wgb, wub, wdb, K, W, ell_col, ab, ell_u, nnz, flag, l1c, cg, cu, dxb);                          \
  }
#define SFL_BWDB(NI_)                                                                                          \
  {                                                                                                            \
    if (gated)                                                                                                 \
      SFL_BWDB_K(NI_, true)                                                                                    \
    else                                                                                                       \
      SFL_BWDB_K(NI_, false)                                                                                   \
  }
  if (ni <= 2) SFL_BWDB(2) else if (ni <= 4) SFL_BWDB(4) else if (ni <= 8) SFL_BWDB(8) else SFL_BWDB(16)
#undef SFL_BWDB
#undef SFL_BWDB_K
  return cudaGetLastError();
}

cudaError_t sfltrain_dw_launch(int gated, int nb, const void* x, const void* dy, int N, int K, int W,
                               const int64_t* perm, const int64_t* colptr, const void* ell_a, const float* ell_u,
                               const float* cg, const float* cu, const void* add_g, const void* add_u,
                               const void* add_d, void* dwg, void* dwu, void* dwdt, int part0, int parts,
                               cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  if (K % 8 != 0 || W < 1) return cudaErrorInvalidValue;
  if (nb != 1 && nb != 2 && nb != 4 && nb != 8) return cudaErrorInvalidValue;
  if (part0 < 0 || parts < 1 || part0 + parts > 2) return cudaErrorInvalidValue;
  const int kslices = (K / 8 + 32 * nb - 1) / (32 * nb);
  const long long warps = (long long)N * kslices * parts;
  const unsigned blocks = sfltrain::blocks_for(warps, 128);
  using bf = __nv_bfloat16;
  const auto* xb = reinterpret_cast<const bf*>(x);
  const auto* dyb = reinterpret_cast<const bf*>(dy);
  const auto* ab = reinterpret_cast<const bf*>(ell_a);
  const auto* ag = reinterpret_cast<const bf*>(add_g);
  const auto* au = reinterpret_cast<const bf*>(add_u);
  const auto* ad = reinterpret_cast<const bf*>(add_d);
  auto* og = reinterpret_cast<bf*>(dwg);
  auto* ou = reinterpret_cast<bf*>(dwu);
  auto* od = reinterpret_cast<bf*>(dwdt);
#define SFL_DW(NB_)                                                                                         \
  if (nb == NB_) {                                                                                          \
    if (gated)                                                                                              \
      sfltrain::dw_kernel<NB_, true><<<blocks, 128, 0, stream>>>(xb, dyb, N, K, W, perm, colptr, ab, ell_u,  \
                                                                 cg, cu, ag, au, ad, og, ou, od, part0,     \
                                                                 parts);                                    \
    else                                                                                                    \
      sfltrain::dw_kernel<NB_, false><<<blocks, 128, 0, stream>>>(xb, dyb, N, K, W, perm, colptr, ab, ell_u, \
                                                                  cg, cu, ag, au, ad, og, ou, od, part0,    \
                                                                  parts);                                   \
  }
  SFL_DW(1) SFL_DW(2) SFL_DW(4) SFL_DW(8)
#undef SFL_DW
  return cudaGetLastError();
}

// dwd_dh: dW_dT (with its addend) and the partial dot products part [ceil(K / 256), pstride] fp32 (pstride >= the
// light entries); dh_coef: the coefficients cg, cu [M, W] from them. l1c: one fp32 on the device.
cudaError_t sfltrain_dwd_dh_launch(int nb, const void* dy, const void* wdt, int N, int K, int W, const int64_t* perm,
                                   const int64_t* colptr, const void* ell_a, const float* ell_u, const void* add_d,
                                   void* dwdt, float* part, long long pstride, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  if (K % 8 != 0 || W < 1 || (nb != 1 && nb != 2 && nb != 4 && nb != 8)) return cudaErrorInvalidValue;
  nb = nb < sfltrain::kDwdMaxNb ? nb : sfltrain::kDwdMaxNb;  // its sums do not depend on nb
  const int kslices = (K / 8 + 32 * nb - 1) / (32 * nb);
  const unsigned blocks = sfltrain::blocks_for((long long)N * kslices, 128);
  using bf = __nv_bfloat16;
  const auto* dyb = reinterpret_cast<const bf*>(dy);
  const auto* wb = reinterpret_cast<const bf*>(wdt);
  const auto* ab = reinterpret_cast<const bf*>(ell_a);
  const auto* ad = reinterpret_cast<const bf*>(add_d);
  auto* od = reinterpret_cast<bf*>(dwdt);
#define SFL_DWD(NB_)                                                                                         \
  sfltrain::dwd_dh_kernel<NB_><<<blocks, 128, 0, stream>>>(dyb, wb, N, K, W, perm, colptr, ab, ell_u, ad, od, part, \
                                                           pstride)
  if (nb == 1) SFL_DWD(1);
  else SFL_DWD(2);
#undef SFL_DWD
  return cudaGetLastError();
}

cudaError_t sfltrain_dh_coef_launch(int gated, const float* part, long long pstride, int K, const int64_t* perm,
                                    const int64_t* colptr, int N, const void* ell_a, const float* ell_u,
                                    const float* l1c, float* cg, float* cu, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  const int nsub = (K / 8 + 31) / 32;
  const unsigned blocks = (unsigned)(pstride > 0 ? (pstride + 255) / 256 : 1);  // at least the block that checks
  const auto* ab = reinterpret_cast<const __nv_bfloat16*>(ell_a);
  if (gated)
    sfltrain::dh_coef_kernel<true><<<blocks, 256, 0, stream>>>(part, pstride, nsub, perm, colptr, N, ab, ell_u, l1c,
                                                               cg, cu);
  else
    sfltrain::dh_coef_kernel<false><<<blocks, 256, 0, stream>>>(part, pstride, nsub, perm, colptr, N, ab, nullptr,
                                                                l1c, cg, nullptr);
  return cudaGetLastError();
}

// dense_bwd: dh/g/h (and u/du when gated) contiguous bf16 of n elements (n % 8 == 0); gl1: one fp32 on device.
cudaError_t sfltrain_dense_bwd_launch(int gated, void* dh, const void* g, const void* u, const void* h, void* du,
                                      long long n, const float* gl1, float scale, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (n % 8 != 0) return cudaErrorInvalidValue;
  using bf = __nv_bfloat16;
  const long long n8 = n / 8;
  static int sms = 0;  // grid-stride loop over a capped grid (16 blocks per SM)
  if (sms == 0) {
    int dev = 0, v = 0;
    sms = (cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0) ? v : 132;
  }
  const long long want = (n8 + 255) / 256, cap = 16LL * sms;
  const unsigned blocks = (unsigned)(want < cap ? want : cap);
  if (gated)
    sfltrain::dense_bwd_kernel<true><<<blocks, 256, 0, stream>>>(
        reinterpret_cast<bf*>(dh), reinterpret_cast<const bf*>(g), reinterpret_cast<const bf*>(u),
        reinterpret_cast<const bf*>(h), reinterpret_cast<bf*>(du), n8, gl1, scale);
  else
    sfltrain::dense_bwd_kernel<false><<<blocks, 256, 0, stream>>>(
        reinterpret_cast<bf*>(dh), reinterpret_cast<const bf*>(g), nullptr, reinterpret_cast<const bf*>(h), nullptr,
        n8, gl1, scale);
  return cudaGetLastError();
}

// dst [C, R] = src [R, C]^T (bf16; row stride lds); R, C, lds multiples of 8, 16-byte aligned pointers.
cudaError_t sfltrain_transpose_launch(const void* src, long long lds, int R, int C, void* dst, cudaStream_t stream) {
  if (R <= 0 || C <= 0) return cudaSuccess;
  if (R % 8 != 0 || C % 8 != 0 || lds % 8 != 0 || (reinterpret_cast<uintptr_t>(src) & 15) ||
      (reinterpret_cast<uintptr_t>(dst) & 15))
    return cudaErrorInvalidValue;
  const dim3 grid((C + sfltrain::kTT - 1) / sfltrain::kTT, (R + sfltrain::kTT - 1) / sfltrain::kTT);
  if (grid.y > 65535) return cudaErrorInvalidValue;
  sfltrain::transpose_kernel<<<grid, 256, 0, stream>>>(reinterpret_cast<const uint16_t*>(src), lds, R, C,
                                                       reinterpret_cast<uint16_t*>(dst));
  return cudaGetLastError();
}

// Rows per block of the CSR-by-neuron sort: at least 64, and at most 256 blocks (the per-neuron scan over blocks
// is sequential).
int sfltrain_csr_rows_per_block(int M) {
  const int rb = (M + 255) / 256;
  return rb < 64 ? 64 : rb;
}

// Shared memory of the scatter step; the caller falls back to the reference sort when it is over the limit.
long long sfltrain_csr_smem_bytes(int N, int W) {
  return (long long)N * 8 + (long long)sfltrain::kStageRows * W * 4 + sfltrain::kStageRows * 4;
}

// cnt: int32 [B * N] scratch, total: int64 [N] scratch, colptr: int64 [N + 1], perm: int64 [>= light entries].
cudaError_t sfltrain_csr_by_neuron_launch(const int32_t* ell_col, int W, const int32_t* nnz, const int32_t* flag,
                                          int M, int N, int32_t* cnt, int64_t* total, int64_t* colptr,
                                          int64_t* perm, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  if (W < 1) return cudaErrorInvalidValue;
  const int rb = sfltrain_csr_rows_per_block(M);
  const int B = (M + rb - 1) / rb;
  const long long hist_smem = (long long)N * 4, scatter_smem = sfltrain_csr_smem_bytes(N, W);
  if (scatter_smem > 200 * 1024) return cudaErrorInvalidValue;
  cudaError_t e;
  if (B > 0) {
    if (hist_smem > 48 * 1024 &&
        (e = cudaFuncSetAttribute(sfltrain::csr_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)hist_smem)) != cudaSuccess)
      return e;
    sfltrain::csr_count_kernel<<<B, 256, hist_smem, stream>>>(ell_col, W, nnz, flag, M, N, rb, cnt);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  sfltrain::csr_colscan_kernel<<<(N + 255) / 256, 256, 0, stream>>>(cnt, B, N, total);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  sfltrain::csr_scan_totals_kernel<<<1, 1024, 0, stream>>>(total, N, colptr);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if (B > 0) {
    if (scatter_smem > 48 * 1024 &&
        (e = cudaFuncSetAttribute(sfltrain::csr_scatter_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)scatter_smem)) != cudaSuccess)
      return e;
    sfltrain::csr_scatter_kernel<<<B, 256, scatter_smem, stream>>>(ell_col, W, nnz, flag, M, N, rb, cnt, colptr,
                                                                   perm);
  }
  return cudaGetLastError();
}

// last: int64 [N], set to -1 here; ell_col int32 [rows, W].
cudaError_t sfltrain_last_active_ell_launch(const int32_t* ell_col, int W, const int32_t* nnz, const int32_t* flag,
                                            int rows, int N, int64_t* last, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  cudaError_t e = cudaMemsetAsync(last, 0xff, (size_t)N * sizeof(int64_t), stream);  // all bits set: -1
  if (e != cudaSuccess || rows <= 0 || W <= 0) return e;
  const long long n = (long long)rows * W;
  if ((n + 255) / 256 > 0x7fffffffLL) return cudaErrorInvalidValue;
  sfltrain::last_active_ell_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
      ell_col, W, nnz, flag, rows, reinterpret_cast<long long*>(last));
  return cudaGetLastError();
}

// last: int64 [N], set to -1 here; a: bf16 [rows, N], row stride lda; N, lda multiples of 8, a 16-byte aligned.
cudaError_t sfltrain_last_active_launch(const void* a, long long lda, int rows, int N, int64_t* last,
                                        cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  if (N % 8 != 0 || lda % 8 != 0 || (reinterpret_cast<uintptr_t>(a) & 15)) return cudaErrorInvalidValue;
  cudaError_t e = cudaMemsetAsync(last, 0xff, (size_t)N * sizeof(int64_t), stream);  // all bits set: -1
  if (e != cudaSuccess || rows <= 0) return e;
  const int groups = (N + 255) / 256;
  const dim3 grid((groups + 7) / 8, (rows + sfltrain::kLastRows - 1) / sfltrain::kLastRows);
  if (grid.y > 65535) return cudaErrorInvalidValue;
  sfltrain::last_active_kernel<<<grid, 256, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(a), lda, rows, N,
                                                         reinterpret_cast<long long*>(last));
  return cudaGetLastError();
}

}  // extern "C"
