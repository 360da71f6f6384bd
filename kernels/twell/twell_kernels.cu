// TwELL inference kernels (CUDA C++, no torch headers: compile-checked by plain nvcc in CPU CI).
//
// Format (kernels/FORMAT.md): packed int32 [M, n_tiles, S], word = bf16 bits << 16 | tile-local column;
// counts int32 [M, n_tiles] hold the TRUE count. A row is "flagged" (flag[row] = 1) when any tile count
// exceeds S or any gate pre-activation of the row is non-finite; flagged rows are never computed here
// from the packed data: the caller computes them exactly through the dense backup (or NaN-fills them in
// the sync-free mode, see kernels/README.md).
//
// Kernels:
//   compact   : bf16 gate pre-activations [rows, N] -> ReLU -> TwELL (+counts, flags). One warp per (row, tile).
//   gated_up  : h = g * (x . W_u[j]) for every stored entry (fp32 h). One warp per (row, group of tiles).
//   down      : y = sum_j h_j W_dT[j, :] (fp32 accumulate). One warp per (row, K slice, group of tiles);
//               direct bf16 store, or fp32 atomics into an accumulator when tiles are split across warps.
//   up_down   : gated_up and down in one kernel, h kept in shared memory. One block per row (the large-M path).
//   up_list   : up_down's steps 1-2, the row's entries (column, h) written as a compact list for the large-M
//               path's down step, common/slices.cu (slice-major over W_dT).
//   finalize  : fp32 accumulator -> bf16 output (NaN rows for flagged rows in sync-free mode).
//   relu_mul_stats : the dense path's relu(g) * u in one pass (in place), measuring activity on the way.
//   row_stats : activity measurement of a sparse call for the dispatch history (kernels/README.md, Dispatch).
//   decode_rows : few rows: ReLU + (gated) up + down from a cuBLAS gate output, one block per (row, K slice).
//   decode_finish : the fused decode path's epilogue: convert, measure, count, and re-zero its workspace.
// All launchers take the stream, return the cudaError_t of the launch, and never exit.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <stdint.h>

#include <map>
#include <mutex>
#include <tuple>

#include "../common/bf16.cuh"

namespace twell {

using namespace sfl;  // bf16 helpers, warp reductions, the relu activity test (kernels/common/bf16.cuh)

constexpr int kTileN = 256;       // columns per tile (one warp: 32 lanes x 8 bf16 = one 16-byte load each)

// ---------------------------------------------------------------------------------------------
// compact_item (one (row, tile) -> TwELL words, count, flag) lives in kernels/common/bf16.cuh: the fused d2t
// (d2t_gemm.cu) uses it too.

// compact: a persistent grid in which every warp first issues the 16-byte
// loads of U (row, tile) items and only then processes them: U x 512 B in flight per warp instead of 512 B, and no
// block turnover (v1 ran one short-lived warp per item: 1.4M warps at M = 65536, latency bound at ~0.9 TB/s).
constexpr int kCompactU = 4;
__global__ void __launch_bounds__(256) compact_v2_kernel(const __nv_bfloat16* __restrict__ g, long long ldg,
                                                         int rows, int n_tiles, int S,
                                                         int32_t* __restrict__ packed,
                                                         int32_t* __restrict__ counts,
                                                         int32_t* __restrict__ flag) {
  const long long items = (long long)rows * n_tiles;
  const long long tw = (long long)gridDim.x * (blockDim.x >> 5);
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  for (long long base = 0; base < items; base += tw * kCompactU) {  // warp-uniform loop
    uint4 v[kCompactU];
#pragma unroll
    for (int u = 0; u < kCompactU; ++u) {  // consecutive warps read consecutive items: coalesced rows
      const long long it = base + u * tw + gw;
      if (it < items) {
        const int row = (int)(it / n_tiles), tile = (int)(it % n_tiles);
        v[u] = __ldcs(reinterpret_cast<const uint4*>(g + (long long)row * ldg + (long long)tile * kTileN) + lane);
      }
    }
#pragma unroll
    for (int u = 0; u < kCompactU; ++u) {
      const long long it = base + u * tw + gw;
      if (it < items) compact_item(v[u], lane, (int)(it / n_tiles), (int)(it % n_tiles), n_tiles, S, packed, counts,
                                   flag);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// gated_up: hval[row, tile, e] = g_e * (x[row] . W_u[col_e]) for e < min(count, S), unflagged rows.
// NI = 16-byte chunks of x per lane (K/8 chunks spread over 32 lanes).
template <int NI>
__global__ void __launch_bounds__(128, 1) gated_up_kernel(const __nv_bfloat16* __restrict__ x,
                                                       const __nv_bfloat16* __restrict__ wu, int rows, int K,
                                                       int n_tiles, int S, int tiles_per_warp,
                                                       const int32_t* __restrict__ packed,
                                                       const int32_t* __restrict__ counts,
                                                       const int32_t* __restrict__ flag,
                                                       float* __restrict__ hval) {
  const int groups = (n_tiles + tiles_per_warp - 1) / tiles_per_warp;
  const int lane = threadIdx.x & 31;
  const int items = rows * groups;  // < 2^31 (launcher checks)
  const int tw = (int)((gridDim.x * blockDim.x) >> 5);
  // grid-stride over items: one pass when the grid covers them (default), persistent warps under a grid cap
  for (int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); warp < items; warp += tw) {
  const int row = warp / groups;
  const int t0 = (warp % groups) * tiles_per_warp;
  const int t1 = min(n_tiles, t0 + tiles_per_warp);
  if (flag[row]) continue;
  // The row's stored entries are batched across tiles, up to 32 at a time (one per lane), so that each gather
  // step has two W_u rows in flight whatever the per-tile counts are (at 0.5% a tile holds ~1.3 entries: one
  // gather per tile left most steps with a single load in flight).
  uint4 xv[NI];
  bool xloaded = false;
  int fill = 0, col = 0;
  uint32_t word = 0;
  long long dst = 0;
  auto flush = [&]() {
    if (!xloaded) {  // x row is read only when the group has work
      load_row<NI>(xv, x + (long long)row * K, K);
      xloaded = true;
    }
    const float u = gather_dots<NI>(xv, wu, col, fill, K);
    if (lane < fill) hval[dst] = bf16hi(word) * u;
    fill = 0;
  };
  for (int tb = t0; tb < t1; tb += 32) {
    const int nt = min(32, t1 - tb);
    const int my_cnt = lane < nt ? min(counts[(long long)row * n_tiles + tb + lane], S) : 0;
    for (int i = 0; i < nt; ++i) {
      const int cnt = __shfl_sync(kFull, my_cnt, i);
      const long long rt = (long long)row * n_tiles + tb + i;
      for (int b0 = 0; b0 < cnt; b0 += 32) {  // warp-uniform; more than 32 only with S > 32 (sync-free path)
        const int piece = min(32, cnt - b0);
        if (fill + piece > 32) flush();
        if (lane >= fill && lane < fill + piece) {
          const int slot = b0 + lane - fill;
          word = (uint32_t)packed[rt * S + slot];
          col = (tb + i) * kTileN + (int)(word & 0xffffu);
          dst = rt * S + slot;
        }
        fill += piece;
      }
    }
  }
  if (fill > 0) flush();
  }  // items
}

// ---------------------------------------------------------------------------------------------
// down: y[row, slice] = sum over entries of h * W_dT[col, slice]. NB = 16-byte chunks per lane per slice.
// HV: h from hval (fp32, gated) else from the packed bf16 value (non-gated: h = relu(x W_u^T)).
// ATOMIC: add into fp32 yacc (tiles split across warps) else store bf16 y directly.
template <int NB, bool HV, bool ATOMIC>
__global__ void __launch_bounds__(128, 1) down_kernel(const __nv_bfloat16* __restrict__ wdt, int rows, int K,
                                                   int n_tiles, int S, int tiles_per_warp, int nan_fill,
                                                   const int32_t* __restrict__ packed,
                                                   const int32_t* __restrict__ counts,
                                                   const int32_t* __restrict__ flag,
                                                   const float* __restrict__ hval,
                                                   __nv_bfloat16* __restrict__ y, float* __restrict__ yacc) {
  const int K8 = K >> 3;
  const int kslices = (K8 + 32 * NB - 1) / (32 * NB);
  const int groups = (n_tiles + tiles_per_warp - 1) / tiles_per_warp;
  const int lane = threadIdx.x & 31;
  const int items = rows * kslices * groups;  // < 2^31 (launcher checks)
  const int tw = (int)((gridDim.x * blockDim.x) >> 5);
  for (int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); warp < items; warp += tw) {
  const int row = warp / (kslices * groups);
  const int rem = warp % (kslices * groups);
  const int ks = rem / groups;
  const int t0 = (rem % groups) * tiles_per_warp;
  const int t1 = min(n_tiles, t0 + tiles_per_warp);
  const int cbase = ks * 32 * NB + lane;
  if (flag[row]) {
    if (!ATOMIC && nan_fill) {
      const uint32_t qnan = 0x7fc07fc0u;
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        const int c = cbase + 32 * i;
        if (c < K8) reinterpret_cast<uint4*>(y + (long long)row * K)[c] = make_uint4(qnan, qnan, qnan, qnan);
      }
    }
    continue;  // eager mode: the dense backup writes this row
  }
  float acc[NB * 8];
#pragma unroll
  for (int i = 0; i < NB * 8; ++i) acc[i] = 0.f;
  bool any = false;
  for (int tile = t0; tile < t1; ++tile) {
    const long long rt = (long long)row * n_tiles + tile;
    const int cnt = min(counts[rt], S);
    for (int base = 0; base < cnt; base += 32) {
      const int ne = min(32, cnt - base);
      uint32_t word = 0u;
      float hv = 0.f;
      if (lane < ne) {
        word = (uint32_t)packed[rt * S + base + lane];
        hv = HV ? hval[rt * S + base + lane] : bf16hi(word);
      }
      any = true;
      int j = 0;
#pragma unroll 1
      for (; j + 2 <= ne; j += 2) {
        const uint32_t w0 = __shfl_sync(kFull, word, j), w1 = __shfl_sync(kFull, word, j + 1);
        const float h0 = __shfl_sync(kFull, hv, j), h1 = __shfl_sync(kFull, hv, j + 1);
        const uint4* r0 = reinterpret_cast<const uint4*>(wdt + (long long)(tile * kTileN + (w0 & 0xffffu)) * K);
        const uint4* r1 = reinterpret_cast<const uint4*>(wdt + (long long)(tile * kTileN + (w1 & 0xffffu)) * K);
        uint4 a[NB], b[NB];
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          const int c = cbase + 32 * i;
          a[i] = c < K8 ? __ldg(r0 + c) : make_uint4(0, 0, 0, 0);
          b[i] = c < K8 ? __ldg(r1 + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < NB; ++i) { axpy8(h0, a[i], acc + 8 * i); axpy8(h1, b[i], acc + 8 * i); }
      }
      if (j < ne) {
        const uint32_t w0 = __shfl_sync(kFull, word, j);
        const float h0 = __shfl_sync(kFull, hv, j);
        const uint4* r0 = reinterpret_cast<const uint4*>(wdt + (long long)(tile * kTileN + (w0 & 0xffffu)) * K);
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          const int c = cbase + 32 * i;
          const uint4 a = c < K8 ? __ldg(r0 + c) : make_uint4(0, 0, 0, 0);
          axpy8(h0, a, acc + 8 * i);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NB; ++i) {
    const int c = cbase + 32 * i;
    if (c >= K8) continue;
    if (ATOMIC) {
      if (!any) continue;
      float* dst = yacc + (long long)row * K + (long long)c * 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float4*>(dst), make_float4(acc[8 * i], acc[8 * i + 1], acc[8 * i + 2], acc[8 * i + 3]));
      atomicAdd(reinterpret_cast<float4*>(dst + 4), make_float4(acc[8 * i + 4], acc[8 * i + 5], acc[8 * i + 6], acc[8 * i + 7]));
#else
#pragma unroll
      for (int q = 0; q < 8; ++q) atomicAdd(dst + q, acc[8 * i + q]);
#endif
    } else {
      const uint4 o = make_uint4(pack2(acc[8 * i], acc[8 * i + 1]), pack2(acc[8 * i + 2], acc[8 * i + 3]),
                                 pack2(acc[8 * i + 4], acc[8 * i + 5]), pack2(acc[8 * i + 6], acc[8 * i + 7]));
      reinterpret_cast<uint4*>(y + (long long)row * K)[c] = o;
    }
  }
  }  // items
}

// ---------------------------------------------------------------------------------------------
// up_down (the sparse path's up and down steps in one kernel): y[r] = sum_e h_e W_dT[j_e] for every unflagged row,
// straight from TwELL. gated_up + down wrote h to device memory and down walked every tile's count and words a
// second time (three dependent round trips per tile for ~1.3 entries at 0.5%); here one block owns a row and keeps
// its entries in shared memory. Per window of tiles (window * S <= kUdCap entries):
//   1. the window's capped tile counts -> block scan -> the entries as a shared list (j, g) in column order, one
//      warp per tile reading its words in one coalesced load;
//   2. (gated) h = g * (x_r . W_u[j]), one warp per entry, x_r staged once per row in shared memory (row_dot_shared:
//      the same products in the same order as gated_up, so h is bit-identical);
//   3. y[r] += sum_e h_e W_dT[j_e] in fp32 registers: a thread owns 8-column chunks (CPT of them) and, where
//      K / 8 < the block's threads, a strided share of the entries; 8 loads in flight per thread.
// Then the shares are summed in shared memory and y[r] is stored once as bf16 (entries in column order with one
// share: the same sums as down). Flagged rows are left to the caller's dense backup, or NaN-filled (nan_fill: the
// sync-free path, where only non-finite rows are flagged).
// LIST (up_list, the large-M path): steps 1-2 only; the row's entries go to device memory as a compact list
// (lcol[r, 0 .. lnnz[r]) in column order, lh fp32 h) and common/slices.cu sums y slice-major over W_dT, which the
// L2 holds one 512-column slice of at a time (here each block reads whole W_u and W_dT rows: 46 MB, a 52% L2 hit
// rate at M 65536, lab/results/kernel_bench.tar.xz: ncu_sparse_phases_h100_2960055.txt). The same products and sums: y is
// bit-identical to the fused step's at K >= 2048. Flagged rows are skipped (lnnz not written). Without step 3's
// accumulators it runs 6 blocks per SM (W_u loaded 2 chunks per lane at a time, the same sums): a row's chain of
// dependent loads (flag, counts, words, ~4 W_u rows per warp) bounds it, so more rows in flight pay (M 65536, 0.5%,
// H200: 1.20 / 1.06 / 1.00 ms at 4 / 5 / 6 blocks, lab/results/kernel_bench.tar.xz: up_down_ab_h200_b7d99d0.jsonl).
constexpr int kUdThreads = 256;
constexpr int kUdCap = 2048;  // entries per window (16 KB of shared memory)
template <int NI, bool GATED, bool LIST>
__global__ void __launch_bounds__(kUdThreads, NI <= 8 ? (LIST ? 6 : 4) : 2)
    up_down_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wu,
                   const __nv_bfloat16* __restrict__ wdt, int K, int n_tiles, int S, int nan_fill,
                   const int32_t* __restrict__ packed, const int32_t* __restrict__ counts,
                   const int32_t* __restrict__ flag, __nv_bfloat16* __restrict__ y, int32_t* __restrict__ lcol,
                   float* __restrict__ lh, int32_t* __restrict__ lnnz) {
  extern __shared__ int list_j[];                                  // [kUdCap] active columns, then
  float* list_h = reinterpret_cast<float*>(list_j + kUdCap);       // [kUdCap] their g, then h, then (gated)
  uint4* xs = reinterpret_cast<uint4*>(list_h + kUdCap);           // [K / 8] x_r
  __shared__ int tile_base[kUdThreads], tile_cnt[kUdThreads];
  __shared__ int warp_total[kUdThreads / 32];
  __shared__ float red[kUdThreads * 8];                            // the shares' partial sums
  constexpr int CPT = (NI + 7) / 8;                                // chunks per thread (K / 8 > threads: K = 4096)
  const int r = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const int K8 = K >> 3;
  uint4* yrow = LIST ? nullptr : reinterpret_cast<uint4*>(y + (long long)r * K);
  if (flag[r]) {
    if (nan_fill && !LIST)
      for (int c = tid; c < K8; c += kUdThreads) yrow[c] = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u,
                                                                      0x7fc07fc0u);
    return;
  }
  if (GATED) {  // read by step 2, after the barriers of step 1
    const uint4* xrow = reinterpret_cast<const uint4*>(x + (long long)r * K);
    for (int c = tid; c < K8; c += kUdThreads) xs[c] = __ldg(xrow + c);
  }
  // step 3's layout: `groups` shares of the entries, each over K8 threads (one share once K8 >= threads)
  const int groups = K8 >= kUdThreads ? 1 : kUdThreads / K8;
  const int grp = groups == 1 ? 0 : (tid / K8 < groups ? tid / K8 : -1);
  const int cc0 = groups == 1 ? tid : tid % K8;
  float a[CPT * 8];
#pragma unroll
  for (int i = 0; i < CPT * 8; ++i) a[i] = 0.f;
  const int window = min(kUdThreads, kUdCap / S);
  const long long lrow = (long long)r * n_tiles * S;  // LIST: the row's place in lcol / lh (width n_tiles * S)
  int listed = 0;                                     // LIST: entries of the earlier windows
  for (int t0 = 0; t0 < n_tiles; t0 += window) {
    const int nt = min(window, n_tiles - t0);
    const long long rt0 = (long long)r * n_tiles + t0;
    // 1. counts -> each tile's place in the list -> the words
    const int c = tid < nt ? min(counts[rt0 + tid], S) : 0;
    const int incl = warp_inclusive_sum(c);
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    int base = 0, count = 0;
#pragma unroll
    for (int w = 0; w < kUdThreads / 32; ++w) {
      if (w < warp) base += warp_total[w];
      count += warp_total[w];
    }
    if (tid < nt) {
      tile_base[tid] = base + incl - c;
      tile_cnt[tid] = c;
    }
    __syncthreads();
    for (int t = warp; t < nt; t += kUdThreads / 32) {
      const int cnt = tile_cnt[t], b = tile_base[t];
      const int32_t* words = packed + (rt0 + t) * S;
      for (int i = lane; i < cnt; i += 32) {
        const uint32_t wd = (uint32_t)words[i];
        list_j[b + i] = (t0 + t) * kTileN + (int)(wd & 0xffffu);
        list_h[b + i] = bf16hi(wd);
      }
    }
    __syncthreads();
    // 2. up
    if (GATED) {
      for (int e = warp; e < count; e += kUdThreads / 32) {
        constexpr int G = (LIST && NI <= 8) ? 2 : NI;  // W_u chunks in flight per lane (LIST: 40 registers)
        const float u = row_dot_shared<NI, G>(xs, wu + (long long)list_j[e] * K, K);
        if (lane == 0) list_h[e] *= u;
      }
      __syncthreads();
    }
    if (LIST) {
      for (int i = tid; i < count; i += kUdThreads) {
        lcol[lrow + listed + i] = list_j[i];
        lh[lrow + listed + i] = list_h[i];
      }
      listed += count;
    } else if (grp >= 0) {  // 3. down
#pragma unroll
      for (int q = 0; q < CPT; ++q) {
        const int cc = cc0 + q * kUdThreads;
        if (cc < K8)
          gathered_axpy<8>(a + 8 * q, reinterpret_cast<const uint4*>(wdt) + cc, list_j, list_h, grp, groups, count,
                           K8);
      }
    }
    __syncthreads();  // the next window rewrites the list
  }
  if (LIST) {
    if (tid == 0) lnnz[r] = listed;
  } else {
    store_shares<CPT, kUdThreads>(a, red, yrow, K8, cc0, grp, groups);
  }
}

// ---------------------------------------------------------------------------------------------
// decode_fused (M <= 8 rows, sync-free, lossless): one kernel computes g = x W_g^T on CUDA cores (W_g streamed
// from HBM exactly once), and for every neuron that is active in any row it reads W_u[j] (gated) and W_dT[j]
// once and adds h * W_dT[j] into the fp32 accumulator yacc[r, :] of each active row r (float4 atomics).
// Bytes: W_g once + the union of the active rows' W_u/W_dT rows. x lives in shared memory as fp32, split into
// lo/hi float4 halves of each 8-element chunk so that a warp's 16-byte reads are bank-conflict free.
// g is rounded to bf16 before the ReLU test and before use (as in the cuBLAS path); the fp32 summation order
// differs from cuBLAS, so an entry whose pre-activation is within rounding of 0 may be classified differently
// (its h is then ~0 either way). nnz[r] += active entries (NaN counts); flag[r] = 1 on a non-finite g (the row is
// NaN-filled by finalize, as on the sync-free path). yacc, nnz and flag must be zeroed by the caller.
template <int MR, int NI, bool GATED>
__global__ void __launch_bounds__(384, 1) decode_fused_kernel(const __nv_bfloat16* __restrict__ x,
                                                            const __nv_bfloat16* __restrict__ wg,
                                                            const __nv_bfloat16* __restrict__ wu,
                                                            const __nv_bfloat16* __restrict__ wdt, int M, int K,
                                                            int N, float* __restrict__ yacc,
                                                            int32_t* __restrict__ nnz, int32_t* __restrict__ flag) {
  extern __shared__ float4 xs[];  // [MR][2][K8]: lo halves then hi halves of each row's 8-element chunks
  const int K8 = K >> 3;
  for (int idx = threadIdx.x; idx < MR * K8; idx += blockDim.x) {
    const int r = idx / K8, c = idx % K8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < M) v = __ldg(reinterpret_cast<const uint4*>(x + (long long)r * K) + c);
    xs[(2 * r) * K8 + c] = make_float4(bf16lo(v.x), bf16hi(v.x), bf16lo(v.y), bf16hi(v.y));
    xs[(2 * r + 1) * K8 + c] = make_float4(bf16lo(v.z), bf16hi(v.z), bf16lo(v.w), bf16hi(v.w));
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int tw = (int)((gridDim.x * blockDim.x) >> 5);
  for (int j = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); j < N; j += tw) {
    uint4 a[NI];
    const uint4* row = reinterpret_cast<const uint4*>(wg + (long long)j * K);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + 32 * i;
      a[i] = c < K8 ? __ldcs(row + c) : make_uint4(0, 0, 0, 0);  // streamed once: do not keep in L2
    }
    float acc[MR];
#pragma unroll
    for (int r = 0; r < MR; ++r) acc[r] = 0.f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + 32 * i;
      if (c < K8) {
        const float w0 = bf16lo(a[i].x), w1 = bf16hi(a[i].x), w2 = bf16lo(a[i].y), w3 = bf16hi(a[i].y);
        const float w4 = bf16lo(a[i].z), w5 = bf16hi(a[i].z), w6 = bf16lo(a[i].w), w7 = bf16hi(a[i].w);
#pragma unroll
        for (int r = 0; r < MR; ++r) {
          const float4 lo = xs[(2 * r) * K8 + c], hi = xs[(2 * r + 1) * K8 + c];
          float t = acc[r];
          t = fmaf(w0, lo.x, t); t = fmaf(w1, lo.y, t); t = fmaf(w2, lo.z, t); t = fmaf(w3, lo.w, t);
          t = fmaf(w4, hi.x, t); t = fmaf(w5, hi.y, t); t = fmaf(w6, hi.z, t); t = fmaf(w7, hi.w, t);
          acc[r] = t;
        }
      }
    }
    unsigned active = 0;
    float gv[MR];
#pragma unroll
    for (int r = 0; r < MR; ++r) {
      float t = acc[r];
#pragma unroll
      t = warp_sum(t);  // identical result on every lane
      const uint32_t b = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(t));
      const bool act = r < M && relu_active(b);
      gv[r] = __uint_as_float(b << 16);
      active |= (unsigned)act << r;
      if (lane == 0 && r < M) {
        if (act) atomicAdd(nnz + r, 1);
        if (bf16_nonfinite(b)) flag[r] = 1;  // benign race: every writer stores 1
      }
    }
    if (!active) continue;  // warp-uniform
    float h[MR];
    if (GATED) {
      const uint4* ur = reinterpret_cast<const uint4*>(wu + (long long)j * K);
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int c = lane + 32 * i;
        a[i] = c < K8 ? __ldg(ur + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int r = 0; r < MR; ++r) acc[r] = 0.f;
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int c = lane + 32 * i;
        if (c < K8) {
          const float w0 = bf16lo(a[i].x), w1 = bf16hi(a[i].x), w2 = bf16lo(a[i].y), w3 = bf16hi(a[i].y);
          const float w4 = bf16lo(a[i].z), w5 = bf16hi(a[i].z), w6 = bf16lo(a[i].w), w7 = bf16hi(a[i].w);
#pragma unroll
          for (int r = 0; r < MR; ++r) {
            if (!((active >> r) & 1u)) continue;
            const float4 lo = xs[(2 * r) * K8 + c], hi = xs[(2 * r + 1) * K8 + c];
            float t = acc[r];
            t = fmaf(w0, lo.x, t); t = fmaf(w1, lo.y, t); t = fmaf(w2, lo.z, t); t = fmaf(w3, lo.w, t);
            t = fmaf(w4, hi.x, t); t = fmaf(w5, hi.y, t); t = fmaf(w6, hi.z, t); t = fmaf(w7, hi.w, t);
            acc[r] = t;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < MR; ++r) {
        float t = acc[r];
        h[r] = gv[r] * warp_sum(t);
      }
    } else {
#pragma unroll
      for (int r = 0; r < MR; ++r) h[r] = gv[r];  // non-gated: h = relu(x W_u^T) in bf16, as PyTorch
    }
    const uint4* dr = reinterpret_cast<const uint4*>(wdt + (long long)j * K);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + 32 * i;
      a[i] = c < K8 ? __ldg(dr + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int r = 0; r < MR; ++r) {
      if (!((active >> r) & 1u)) continue;
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int c = lane + 32 * i;
        if (c >= K8) continue;
        float v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = 0.f;
        axpy8(h[r], a[i], v);
        float* dst = yacc + (long long)r * K + (long long)c * 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(dst), make_float4(v[0], v[1], v[2], v[3]));
        atomicAdd(reinterpret_cast<float4*>(dst + 4), make_float4(v[4], v[5], v[6], v[7]));
#else
#pragma unroll
        for (int q = 0; q < 8; ++q) atomicAdd(dst + q, v[q]);
#endif
      }
    }
  }
}

// fp32 accumulator -> bf16 (4 elements per thread); flagged rows become NaN when nan_fill, else untouched.
__global__ void finalize_kernel(const float* __restrict__ yacc, const int32_t* __restrict__ flag, int rows, int K,
                                int nan_fill, __nv_bfloat16* __restrict__ y) {
  const long long i4 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long n4 = (long long)rows * K / 4;
  if (i4 >= n4) return;
  const int row = (int)(i4 / (K / 4));
  uint2 o;
  if (flag[row]) {
    if (!nan_fill) return;
    o = make_uint2(0x7fc07fc0u, 0x7fc07fc0u);
  } else {
    const float4 v = reinterpret_cast<const float4*>(yacc)[i4];
    o = make_uint2(pack2(v.x, v.y), pack2(v.z, v.w));
  }
  reinterpret_cast<uint2*>(y)[i4] = o;
}

// ---------------------------------------------------------------------------------------------
// The model's running sparsity statistics, kept on the device and read only when asked: acc[0] += active entries
// (all rows), acc[1] = max(acc[1], the largest row count), acc[2] += rows. Folded into the kernels that already read
// the counts (relu_mul_stats on the dense path, row_stats on the sparse ones), so recording costs no extra pass.
__device__ __forceinline__ void add_model_stats(unsigned long long* acc, unsigned long long nnz,
                                                unsigned long long row_max, unsigned long long rows) {
  if (nnz) atomicAdd(acc, nnz);
  atomicMax(acc + 1, row_max);
  if (rows) atomicAdd(acc + 2, rows);
}

// ---------------------------------------------------------------------------------------------
// decode_finish: the fused decode path's one epilogue (rows <= 8, one block): yacc -> bf16 y (NaN for flagged rows),
// the activity measurement (out, as row_stats: unflagged counts and flagged rows; null to skip) and the model's
// statistics (acc, or null), then yacc, nnz and flag are zeroed for the next call. So the runtime keeps one
// workspace per layer, zeroed once, instead of a fill kernel, a statistics kernel and a convert kernel per call.
// One block: every read of flag precedes the __syncthreads that orders the zeroing (a grid would need a last-block
// handshake for the same guarantee; at <= 8 x 4096 elements one block is as fast).
__global__ void __launch_bounds__(1024) decode_finish_kernel(float* __restrict__ yacc, int32_t* __restrict__ nnz,
                                                             int32_t* __restrict__ flag, int rows, int K,
                                                             __nv_bfloat16* __restrict__ y,
                                                             unsigned long long* __restrict__ out,
                                                             unsigned long long* __restrict__ acc) {
  const int k4 = K / 4, n4 = rows * k4;
  for (int i = threadIdx.x; i < n4; i += blockDim.x) {
    float4* a = reinterpret_cast<float4*>(yacc) + i;
    const float4 v = *a;
    reinterpret_cast<uint2*>(y)[i] = flag[i / k4] ? make_uint2(0x7fc07fc0u, 0x7fc07fc0u)
                                                  : make_uint2(pack2(v.x, v.y), pack2(v.z, v.w));
    *a = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long ok = 0, flagged = 0, all = 0, mx = 0;
    for (int r = 0; r < rows; ++r) {
      const unsigned long long c = (unsigned long long)nnz[r];
      all += c;
      mx = c > mx ? c : mx;
      if (flag[r]) ++flagged; else ok += c;
      nnz[r] = 0;
      flag[r] = 0;
    }
    if (out != nullptr) {
      atomicAdd(out, ok);
      atomicAdd(out + 1, flagged);
    }
    if (acc != nullptr) add_model_stats(acc, all, mx, (unsigned long long)rows);
  }
}

// ---------------------------------------------------------------------------------------------
// decode_rows (sync-free, few rows): the decode path whose gate products run on tensor cores. g = x W_g^T [rows, N]
// comes from cuBLAS (so the ReLU test sees the dense path's bits exactly); one block per (row, K slice) does the
// rest with no atomics on y and no workspace:
//   1. compacts the row's active gate values into a shared list (j, g) in column order (a block scan per 2048
//      columns), counting them and testing for non-finite values;
//   2. (gated) h = g * (x_r . W_u[j]) per entry, one warp per entry, x_r held in registers;
//   3. y[r, slice] = sum_e h_e W_dT[j_e, slice] in fp32: each thread owns one 8-column chunk of the slice and a
//      share of the entries (strided), the shares are summed in shared memory, then one bf16 store (NaN for a
//      flagged row, as on the sync-free path).
// Slices > 1 give few rows enough blocks: the slices of a row form a thread-block cluster, each compacts the row
// (11 KB from L2 at N = 5632), computes its share of step 2 and reads the rest from its peers' shared memory, and
// writes its own columns. The slice-0 block adds the row to the measurement (out: unflagged counts, flagged rows;
// null to skip) and the model's statistics (acc, or null). Against decode_gathered (one neuron per warp, fp32
// atomics into an accumulator; kernels/lab/README.md), a pair costs one W_dT row read instead of 512 float4 atomics.
constexpr int kRowsThreads = 256;
template <int NI, bool GATED>
__global__ void __launch_bounds__(kRowsThreads, NI <= 8 ? 3 : 1)
    decode_rows_kernel(const __nv_bfloat16* __restrict__ g, long long ldg, const __nv_bfloat16* __restrict__ x,
                       const __nv_bfloat16* __restrict__ wu, const __nv_bfloat16* __restrict__ wdt, int K, int N,
                       int slices, __nv_bfloat16* __restrict__ y, unsigned long long* __restrict__ out,
                       unsigned long long* __restrict__ acc) {
  extern __shared__ int list_j[];                              // [N] active columns, then
  float* list_h = reinterpret_cast<float*>(list_j + N);        // [N] their g, then h, then (gated)
  uint4* xs = reinterpret_cast<uint4*>(list_h + N);            // [K / 8] x_r: one copy for the block's warps
  __shared__ float red[kRowsThreads * 8];                      // step 3's partial sums
  __shared__ int warp_total[kRowsThreads / 32];
  const int r = blockIdx.x / slices, s = blockIdx.x % slices;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K8 = K >> 3, N8 = N >> 3;
  if (GATED) {  // read by step 2, after the barriers of step 1
    const uint4* xrow = reinterpret_cast<const uint4*>(x + (long long)r * K);
    for (int c = threadIdx.x; c < K8; c += kRowsThreads) xs[c] = __ldg(xrow + c);
  }
  // 1. compaction, 256 chunks of 8 columns per round, in column order
  const uint4* grow = reinterpret_cast<const uint4*>(g + (long long)r * ldg);
  int count = 0;
  bool nonfinite = false;
  constexpr int kPre = 4;  // rounds whose loads are issued together (N <= 8192 in one batch)
  for (int b0 = 0; b0 < N8; b0 += kPre * kRowsThreads) {
    uint4 vb[kPre];
#pragma unroll
    for (int q = 0; q < kPre; ++q) {
      const int c = b0 + q * kRowsThreads + threadIdx.x;
      vb[q] = c < N8 ? __ldg(grow + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int q = 0; q < kPre; ++q) {
      if (b0 + q * kRowsThreads >= N8) break;  // block-uniform
      const int c = b0 + q * kRowsThreads + threadIdx.x;
      const uint4 v = vb[q];
      const unsigned act = relu_mask8(v, nonfinite);
      const int mine = __popc(act), incl = warp_inclusive_sum(mine);
      if (lane == 31) warp_total[warp] = incl;
      __syncthreads();
      int base = count;
      for (int w = 0; w < warp; ++w) base += warp_total[w];
      int pos = base + incl - mine;
      for (unsigned a = act; a; a &= a - 1) {
        const int i = __ffs(a) - 1;
        list_j[pos] = c * 8 + i;
        list_h[pos] = bf16lo(bf16_at(v, i));
        ++pos;
      }
      for (int w = 0; w < kRowsThreads / 32; ++w) count += warp_total[w];
      __syncthreads();  // warp_total is rewritten next round
    }
  }
  const bool flagged = __syncthreads_or(nonfinite) != 0;
  if (s == 0 && threadIdx.x == 0) {
    if (out != nullptr) {
      atomicAdd(out, flagged ? 0ull : (unsigned long long)count);
      atomicAdd(out + 1, flagged ? 1ull : 0ull);
    }
    if (acc != nullptr) add_model_stats(acc, (unsigned long long)count, (unsigned long long)count, 1ull);
  }
  // this block's columns: chunks [k0, k1) of 8
  const int per = (K8 + slices - 1) / slices, k0 = s * per, k1 = min(K8, k0 + per), chunks = k1 - k0;
  uint4* yrow = reinterpret_cast<uint4*>(y + (long long)r * K);
  if (flagged) {  // NaN-filled, as on the sync-free path (dense gives NaN/+-Inf there)
    for (int c = k0 + threadIdx.x; c < k1; c += kRowsThreads) yrow[c] = make_uint4(0x7fc07fc0u, 0x7fc07fc0u,
                                                                                  0x7fc07fc0u, 0x7fc07fc0u);
    return;
  }
  // the down step's W_dT lines (this block's columns of every entry's row) are requested into L2 now: they arrive
  // while the up products and the cluster exchange run, and step 3 then waits on L2 instead of HBM
  {
    const int first = k0 >> 3, lines = chunks > 0 ? ((k1 - 1) >> 3) - first + 1 : 0;  // 128-byte lines = 8 chunks
    for (int i = threadIdx.x; i < count * lines; i += kRowsThreads) {
      const uint4* row = reinterpret_cast<const uint4*>(wdt + (long long)list_j[i / lines] * K);
      const uint4* line = row + 8 * (first + i % lines);
      asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
    }
  }
  // 2. h = g * (x_r . W_u[j]). The row's slices form a cluster and split the entries (entry e belongs to slice
  // e % slices; at 0.5% activity a warp gets about one), then each block copies the other slices' h
  // from their shared memory (cluster.sync before and after: written before read, read before any block exits).
  if (GATED) {
    // x_r from shared memory (held in each warp's registers it cost 32 registers: two blocks per SM instead of
    // three; loaded from global memory with each entry it measured 2-3 us slower at every M, b35c7e8)
    for (int e = s + slices * warp; e < count; e += slices * (kRowsThreads / 32)) {
      const float u = row_dot_shared<NI>(xs, wu + (long long)list_j[e] * K, K);
      if (lane == 0) list_h[e] *= u;
    }
    if (slices > 1) {
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      cluster.sync();
      for (int e = threadIdx.x; e < count; e += kRowsThreads) {
        const int owner = e % slices;
        if (owner != s) list_h[e] = cluster.map_shared_rank(list_h, owner)[e];
      }
      cluster.sync();
    } else {
      __syncthreads();
    }
  }
  // 3. down: thread -> (chunk, share of the entries)
  const int width = max(chunks, 1), tid = (int)threadIdx.x;
  const int groups = chunks >= kRowsThreads ? 1 : kRowsThreads / width;
  const int grp = groups == 1 ? 0 : (tid / width < groups ? tid / width : -1);
  for (int cc = groups == 1 ? tid : tid % width; cc < chunks; cc += kRowsThreads) {
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (grp >= 0) {
      gathered_axpy<8>(a, reinterpret_cast<const uint4*>(wdt) + k0 + cc, list_j, list_h, grp, groups, count, K8);
    }
    if (groups == 1) {
      yrow[k0 + cc] = pack8(a);
      continue;
    }
    if (grp >= 0) {
#pragma unroll
      for (int q = 0; q < 8; ++q) red[(grp * chunks + cc) * 8 + q] = a[q];
    }
    __syncthreads();
    if (grp == 0) {
      for (int o = 1; o < groups; ++o) {
#pragma unroll
        for (int q = 0; q < 8; ++q) a[q] += red[(o * chunks + cc) * 8 + q];
      }
      yrow[k0 + cc] = pack8(a);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// relu_mul_stats: the dense path's elementwise step in one pass, measuring activity for free while g is read.
// Gated (u != nullptr): out = bf16(relu(g) * u) (fp32 product rounded once: the same bits as torch's relu then
// mul, including 0 * Inf = NaN); non-gated: out = relu(g). out may alias g or u (in place). Measures relu(g):
// rownnz[r] = active entries of row r (NaN counts; skipped when null); stats[0] += active entries of unflagged
// rows, stats[1] += flagged rows (a tile count > S, a row count > row_cap, or a non-finite gate; skipped when
// null; zeroed by the caller); l1_row[r] = sum of |out[r, :]| in fp32 (skipped when null). Tiles below flag_t0 never
// flag a row: a layer's hot neurons (KernelConfig.hot_neurons) are computed densely on its sparse path too, so only
// the other tiles decide which rows its sparse calls send to the dense backup.
// Against torch's two elementwise kernels this reads/writes 3 instead of 5 [rows, N] bf16 arrays.
// WPR warps per row (8 rows of one warp per block for large M; 8 warps on one row for small M, where one warp
// per row would wait on ~N/1024 rounds of loads), tiles U at a time per warp (loads issued together; 8 for the
// non-gated pass, which has one input stream and so half the bytes in flight per tile).
template <bool GATED, int WPR, int U = GATED ? 4 : 8>
__global__ void __launch_bounds__(256) relu_mul_stats_kernel(const __nv_bfloat16* g, long long ldg,
                                                             const __nv_bfloat16* u, long long ldu,
                                                             __nv_bfloat16* out, long long ldo, int rows,
                                                             int n_tiles, int S, int row_cap, int flag_t0,
                                                             int32_t* __restrict__ rownnz,
                                                             unsigned long long* __restrict__ stats,
                                                             float* __restrict__ l1_row,
                                                             unsigned long long* __restrict__ acc) {
  constexpr int RPB = 8 / WPR;  // rows per block
  __shared__ int s_n[8], s_b[8];
  __shared__ float s_l1[8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * RPB + warp / WPR, sub = warp % WPR;
  int nnz = 0;
  bool bad = false;
  float l1 = 0.f;
  if (row < rows) {  // warp-uniform
    const uint4* gr = reinterpret_cast<const uint4*>(g + (long long)row * ldg) + lane;
    const uint4* ur = GATED ? reinterpret_cast<const uint4*>(u + (long long)row * ldu) + lane : nullptr;
    uint4* orow = reinterpret_cast<uint4*>(out + (long long)row * ldo) + lane;
    for (int t0 = sub; t0 < n_tiles; t0 += WPR * U) {
      uint4 gv[U], uv[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int t = t0 + k * WPR;
        if (t < n_tiles) {
          gv[k] = gr[t * 32];
          if (GATED) uv[k] = ur[t * 32];
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int t = t0 + k * WPR;
        if (t < n_tiles) {
          const uint32_t w[4] = {gv[k].x, gv[k].y, gv[k].z, gv[k].w};
          uint32_t o[4];
          int c = 0;
          bool nf = false;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            uint32_t keep = 0;  // 0xffff per half that relu keeps (positive or NaN)
#pragma unroll
            for (int hlf = 0; hlf < 2; ++hlf) {
              const uint32_t b = (w[i] >> (16 * hlf)) & 0xffffu;
              const bool act = relu_active(b);
              c += act ? 1 : 0;
              nf |= bf16_nonfinite(b);
              keep |= act ? (0xffffu << (16 * hlf)) : 0u;
            }
            const uint32_t h = w[i] & keep;  // relu(g) as bf16 bits (inactive -> +0)
            if (GATED) {
              const uint32_t uw = i == 0 ? uv[k].x : i == 1 ? uv[k].y : i == 2 ? uv[k].z : uv[k].w;
              o[i] = pack2(bf16lo(h) * bf16lo(uw), bf16hi(h) * bf16hi(uw));
            } else {
              o[i] = h;
            }
            if (l1_row != nullptr) l1 += fabsf(bf16lo(o[i])) + fabsf(bf16hi(o[i]));
          }
          orow[t * 32] = make_uint4(o[0], o[1], o[2], o[3]);  // read next by a GEMM: keep in L2
          const int tc = __reduce_add_sync(kFull, c);
          nnz += tc;
          bad |= t >= flag_t0 && ((tc > S) || __any_sync(kFull, nf));
        }
      }
    }
    if (l1_row != nullptr) l1 = warp_sum(l1);
  }
  if (lane == 0) { s_n[warp] = nnz; s_b[warp] = bad ? 1 : 0; s_l1[warp] = l1; }
  __syncthreads();
  if (threadIdx.x != 0) return;
  unsigned long long tn = 0, tf = 0, ta = 0, tmax = 0, tr = 0;
  for (int r = 0; r < RPB; ++r) {
    const int rr = blockIdx.x * RPB + r;
    if (rr >= rows) break;
    int n = 0, b = 0;
    float l = 0.f;
    for (int w = r * WPR; w < (r + 1) * WPR; ++w) { n += s_n[w]; b |= s_b[w]; l += s_l1[w]; }  // fixed order
    b |= n > row_cap;
    if (rownnz != nullptr) rownnz[rr] = n;
    if (l1_row != nullptr) l1_row[rr] = l;
    if (b) ++tf; else tn += (unsigned long long)n;
    ta += (unsigned long long)n;
    tmax = tmax > (unsigned long long)n ? tmax : (unsigned long long)n;
    ++tr;
  }
  if (stats != nullptr) {
    if (tn) atomicAdd(stats, tn);
    if (tf) atomicAdd(stats + 1, tf);
  }
  if (acc != nullptr) add_model_stats(acc, ta, tmax, tr);
}

// row_stats: out[0] += sum of counts over unflagged rows, out[1] += number of flagged rows (out zeroed by caller,
// or null); acc (or null): the model's running statistics (add_model_stats) over every row. extra (or null): more
// active entries per row, added to its count (the hot neurons' of a hot/cold call, counted by relu_mul_stats).
__global__ void __launch_bounds__(256) row_stats_kernel(const int32_t* __restrict__ counts,
                                                        const int32_t* __restrict__ flag,
                                                        const int32_t* __restrict__ extra, int rows, int n_tiles,
                                                        unsigned long long* __restrict__ out,
                                                        unsigned long long* __restrict__ acc) {
  __shared__ unsigned long long s_n[8], s_f[8], s_a[8], s_m[8];
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long n = 0, f = 0, a = 0;
  if (row < rows) {
    for (int t = 0; t < n_tiles; ++t) a += (unsigned long long)counts[(long long)row * n_tiles + t];
    if (extra != nullptr) a += (unsigned long long)extra[row];
    if (flag[row]) f = 1; else n = a;
  }
  unsigned long long m = a;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    n += __shfl_xor_sync(kFull, n, o);
    f += __shfl_xor_sync(kFull, f, o);
    a += __shfl_xor_sync(kFull, a, o);
    const unsigned long long mo = __shfl_xor_sync(kFull, m, o);
    m = m > mo ? m : mo;
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) { s_n[warp] = n; s_f[warp] = f; s_a[warp] = a; s_m[warp] = m; }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long tn = 0, tf = 0, ta = 0, tm = 0;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) {
      tn += s_n[i]; tf += s_f[i]; ta += s_a[i]; tm = tm > s_m[i] ? tm : s_m[i];
    }
    if (out != nullptr) {
      atomicAdd(out, tn);
      atomicAdd(out + 1, tf);
    }
    const int last = rows - (int)(blockIdx.x * blockDim.x);
    if (acc != nullptr) add_model_stats(acc, ta, tm, (unsigned long long)(last < (int)blockDim.x ? last : blockDim.x));
  }
}

inline bool too_many_warps(long long warps) { return warps >= (1LL << 31) / 64; }
inline unsigned blocks_for_warps(long long warps) { return (unsigned)((warps * 32 + 127) / 128); }

inline bool clusters_supported() {
  static int v[64] = {0};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (v[dev] == 0) {
    int major = 0;
    v[dev] = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 ? 1 : 2;
  }
  return v[dev] == 1;
}

inline int sm_count() {
  static int n[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (n[dev] == 0) {
    int v = 0;
    n[dev] = (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0) ? v : 132;
  }
  return n[dev];
}

}  // namespace twell

template <int NB, bool HV>
static inline void launch_down(unsigned blocks, cudaStream_t stream, bool atomic, const __nv_bfloat16* wdt, int rows,
                        int K, int n_tiles, int S, int tpw, int nan_fill, const int32_t* packed,
                        const int32_t* counts, const int32_t* flag, const float* hval, __nv_bfloat16* y,
                        float* yacc) {
  if (atomic)
    twell::down_kernel<NB, HV, true><<<blocks, 128, 0, stream>>>(wdt, rows, K, n_tiles, S, tpw, nan_fill, packed,
                                                                 counts, flag, hval, y, yacc);
  else
    twell::down_kernel<NB, HV, false><<<blocks, 128, 0, stream>>>(wdt, rows, K, n_tiles, S, tpw, nan_fill, packed,
                                                                  counts, flag, hval, y, yacc);
}

template <int MR, int NI, bool G>
static cudaError_t launch_decode(const __nv_bfloat16* x, const __nv_bfloat16* wg, const __nv_bfloat16* wu,
                                 const __nv_bfloat16* wdt, int rows, int K, int N, float* yacc, int32_t* nnz,
                                 int32_t* flag, cudaStream_t stream) {
  const size_t smem = (size_t)MR * K * sizeof(float);
  static bool attr_set = false;  // one instantiation per (MR, NI, G); the largest K it serves is 256 * NI
  if (!attr_set) {
    const cudaError_t e = cudaFuncSetAttribute(twell::decode_fused_kernel<MR, NI, G>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, MR * 256 * NI * 4);
    if (e != cudaSuccess) return e;
    attr_set = true;
  }
  // one block of 12 warps per SM (x is staged once per block), each warp streams whole W_g rows
  const int want = (N + 11) / 12;
  const int blocks = want < twell::sm_count() ? want : twell::sm_count();
  twell::decode_fused_kernel<MR, NI, G><<<blocks, 384, smem, stream>>>(x, wg, wu, wdt, rows, K, N, yacc, nnz, flag);
  return cudaGetLastError();
}

template <int MR, bool G>
static cudaError_t decode_ni(int ni, const __nv_bfloat16* x, const __nv_bfloat16* wg, const __nv_bfloat16* wu,
                             const __nv_bfloat16* wdt, int rows, int K, int N, float* yacc, int32_t* nnz,
                             int32_t* flag, cudaStream_t stream) {
  if (ni <= 2) return launch_decode<MR, 2, G>(x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
  if (ni <= 4) return launch_decode<MR, 4, G>(x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
  if (ni <= 8) return launch_decode<MR, 8, G>(x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
  return launch_decode<MR, 16, G>(x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
}

constexpr int kRowsMaxN = 24576;  // decode_rows keeps the row's active list in shared memory: 8 bytes per column

// The most clusters of `slices` blocks of decode_rows<NI, G> with `smem` bytes that can be resident at once.
// Clusters are placed inside one GPC, so this is below SM slots / slices: on an H100 at two blocks per SM, 30
// clusters of 8 and 62 of 4 (Nsight Compute, lab/results/kernel_bench.tar.xz: ncu_rows_h100_b06d4e3.txt). 0: unknown.
template <int NI, bool G>
static int rows_max_clusters(int slices, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, size_t>, int> cache;  // (device, slices, smem) -> clusters
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, slices, smem);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)slices);
  cfg.blockDim = dim3(twell::kRowsThreads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)slices;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, twell::decode_rows_kernel<NI, G>, &cfg) != cudaSuccess || n < 0) {
    (void)cudaGetLastError();  // a failed query is not the launch's error
    n = 0;
  }
  cache[key] = n;
  return n;
}

// slices = 0: 2 * SMs / rows (at most 8), lowered (to 4 at the least) until the rows' clusters all fit in one wave:
// a cluster that does not fit waits for a whole row to finish (M = 32 at 8 slices: 21.7 instead of 12.4 us for
// M = 16, ncu_rows_h100_b06d4e3.txt; 6 slices measured 24.8 against 30.0 us at 8, decode_paths --slices-sweep on
// an H200). Without clusters (before sm_90) one slice per row.
template <int NI, bool G>
static cudaError_t launch_rows(int rows, int slices, const __nv_bfloat16* g, long long ldg,
                               const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wdt, int K, int N,
                               __nv_bfloat16* y, unsigned long long* out, unsigned long long* acc,
                               cudaStream_t stream) {
  static bool attr_set = false;  // one per instantiation: room for the largest N and K served
  if (!attr_set) {
    cudaError_t e = cudaFuncSetAttribute(twell::decode_rows_kernel<NI, G>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kRowsMaxN * 8 + 4096 * 2);
    // all of the unified L1 as shared memory: three blocks per SM (the kernel reads nothing twice through L1)
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(twell::decode_rows_kernel<NI, G>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               (int)cudaSharedmemCarveoutMaxShared);
    if (e != cudaSuccess) return e;
    attr_set = true;
  }
  const size_t smem = (size_t)N * 8 + (G ? (size_t)K * 2 : 0);  // the active list, and x_r (gated)
  if (!twell::clusters_supported()) {
    slices = 1;
  } else if (slices == 0) {
    slices = 2 * twell::sm_count() / rows;
    slices = slices < 8 ? (slices > 1 ? slices : 1) : 8;
    while (slices > 4) {  // not below 4: a heavy row needs the split (paper-like M = 64: 46.6 us at 3, 41.4 at 4)
      const int fit = rows_max_clusters<NI, G>(slices, smem);
      if (fit <= 0 || rows <= fit) break;
      --slices;
    }
  }
  slices = slices < K / 64 ? slices : K / 64;
  const long long blocks = (long long)rows * slices;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3(twell::kRowsThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;  // a row's slices: one cluster
  attr[0].val.clusterDim.x = (unsigned)slices;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = slices > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, twell::decode_rows_kernel<NI, G>, g, ldg, x, wu, wdt, K, N, slices, y, out, acc);
}

template <int NI>
static cudaError_t rows_gated(bool gated, int rows, int slices, const __nv_bfloat16* g, long long ldg,
                              const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wdt, int K, int N,
                              __nv_bfloat16* y, unsigned long long* out, unsigned long long* acc,
                              cudaStream_t stream) {
  if (gated) return launch_rows<NI, true>(rows, slices, g, ldg, x, wu, wdt, K, N, y, out, acc, stream);
  return launch_rows<NI, false>(rows, slices, g, ldg, x, wu, wdt, K, N, y, out, acc, stream);
}

template <bool G>
static cudaError_t decode_mr(int ni, const __nv_bfloat16* x, const __nv_bfloat16* wg, const __nv_bfloat16* wu,
                             const __nv_bfloat16* wdt, int rows, int K, int N, float* yacc, int32_t* nnz,
                             int32_t* flag, cudaStream_t stream) {
  if (rows <= 1) return decode_ni<1, G>(ni, x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
  if (rows <= 2) return decode_ni<2, G>(ni, x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
  if (rows <= 4) return decode_ni<4, G>(ni, x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
  return decode_ni<8, G>(ni, x, wg, wu, wdt, rows, K, N, yacc, nnz, flag, stream);
}

// ============================== extern launchers (called from binding.cpp) ==============================
// up_down: x/wu null for the non-gated op (h = the stored bf16 value). S <= 256. One block per row.
// lcol non-null: the LIST form (up_list: the entries to lcol / lh / lnnz, no y).
template <int NI>
static cudaError_t launch_up_down(bool gated, unsigned rows, cudaStream_t stream, const __nv_bfloat16* x,
                                  const __nv_bfloat16* wu, const __nv_bfloat16* wdt, int K, int n_tiles, int S,
                                  int nan_fill, const int32_t* packed, const int32_t* counts, const int32_t* flag,
                                  __nv_bfloat16* y, int32_t* lcol, float* lh, int32_t* lnnz) {
  const size_t smem = (size_t)twell::kUdCap * 8 + (gated ? (size_t)K * 2 : 0);
#define TWELL_UD_K(G_, L_)                                                                                        \
  twell::up_down_kernel<NI, G_, L_><<<rows, twell::kUdThreads, smem, stream>>>(x, wu, wdt, K, n_tiles, S, nan_fill, \
                                                                              packed, counts, flag, y, lcol, lh, lnnz)
  if (lcol != nullptr) {
    if (gated) TWELL_UD_K(true, true); else TWELL_UD_K(false, true);
  } else {
    if (gated) TWELL_UD_K(true, false); else TWELL_UD_K(false, false);
  }
#undef TWELL_UD_K
  return cudaGetLastError();
}

extern "C" {

cudaError_t twell_compact_launch(const void* g, long long ldg, int rows, int N, int S, int32_t* packed,
                                 int32_t* counts, int32_t* flag, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (N % twell::kTileN != 0 || ldg % 8 != 0) return cudaErrorInvalidValue;
  const int n_tiles = N / twell::kTileN;
  const long long warps = (long long)rows * n_tiles;
  if (twell::too_many_warps(warps)) return cudaErrorInvalidValue;
  // persistent grid: 8 blocks of 8 warps per SM, each warp U items per round (16-byte loads issued together)
  const long long want = (warps + 7) / 8;
  const long long cap = 8LL * twell::sm_count();
  twell::compact_v2_kernel<<<(unsigned)(want < cap ? want : cap), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(g), ldg, rows, n_tiles, S, packed, counts, flag);
  return cudaGetLastError();
}

// decode_fused: rows <= 8, K % 64 == 0, K <= 4096, any N. wu == nullptr: non-gated (wg is then W_up).
// yacc [rows, K] fp32, nnz [rows], flag [rows] int32: all zeroed by the caller; finalize_launch converts yacc.
cudaError_t twell_decode_fused_launch(const void* x, const void* wg, const void* wu, const void* wdt, int rows,
                                      int K, int N, float* yacc, int32_t* nnz, int32_t* flag, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 8 || K % 64 != 0 || K > 4096 || N <= 0) return cudaErrorInvalidValue;
  const int ni = (K / 8 + 31) / 32;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* gb = reinterpret_cast<const __nv_bfloat16*>(wg);
  const auto* ub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* db = reinterpret_cast<const __nv_bfloat16*>(wdt);
  if (wu != nullptr) return decode_mr<true>(ni, xb, gb, ub, db, rows, K, N, yacc, nnz, flag, stream);
  return decode_mr<false>(ni, xb, gb, ub, db, rows, K, N, yacc, nnz, flag, stream);
}

#define TWELL_UP_CASE(NI_)                                                                                   \
  case NI_:                                                                                                  \
    twell::gated_up_kernel<NI_><<<blocks, 128, 0, stream>>>(xb, wub, rows, K, n_tiles, S, tiles_per_warp,     \
                                                            packed, counts, flag, hval);                     \
    break;

cudaError_t twell_gated_up_launch(const void* x, const void* wu, int rows, int K, int N, int S, int tiles_per_warp,
                                  const int32_t* packed, const int32_t* counts, const int32_t* flag, float* hval,
                                  cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (K % 64 != 0 || K > 4096 || N % twell::kTileN != 0 || tiles_per_warp < 1) return cudaErrorInvalidValue;
  const int n_tiles = N / twell::kTileN;
  const int groups = (n_tiles + tiles_per_warp - 1) / tiles_per_warp;
  if (twell::too_many_warps((long long)rows * groups)) return cudaErrorInvalidValue;
  const unsigned blocks = twell::blocks_for_warps((long long)rows * groups);
  const int ni = (K / 8 + 31) / 32;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* wub = reinterpret_cast<const __nv_bfloat16*>(wu);
  switch (ni) {
    TWELL_UP_CASE(1) TWELL_UP_CASE(2) TWELL_UP_CASE(3) TWELL_UP_CASE(4) TWELL_UP_CASE(5) TWELL_UP_CASE(6)
    TWELL_UP_CASE(7) TWELL_UP_CASE(8) TWELL_UP_CASE(9) TWELL_UP_CASE(10) TWELL_UP_CASE(11) TWELL_UP_CASE(12)
    TWELL_UP_CASE(13) TWELL_UP_CASE(14) TWELL_UP_CASE(15) TWELL_UP_CASE(16)
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
#undef TWELL_UP_CASE

cudaError_t twell_up_down_launch(const void* x, const void* wu, const void* wdt, int rows, int K, int N, int S,
                                 int nan_fill, const int32_t* packed, const int32_t* counts, const int32_t* flag,
                                 void* y, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (K % 64 != 0 || K > 4096 || N % twell::kTileN != 0 || N <= 0 || S < 1 || S > twell::kTileN)
    return cudaErrorInvalidValue;
  const int n_tiles = N / twell::kTileN, ni = (K / 8 + 31) / 32;
  const bool gated = wu != nullptr;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* ub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* db = reinterpret_cast<const __nv_bfloat16*>(wdt);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
#define TWELL_UD(NI_)                                                                                            \
  launch_up_down<NI_>(gated, (unsigned)rows, stream, xb, ub, db, K, n_tiles, S, nan_fill, packed, counts, flag, yb, \
                      nullptr, nullptr, nullptr)
  if (ni <= 2) return TWELL_UD(2);
  if (ni <= 4) return TWELL_UD(4);
  if (ni <= 8) return TWELL_UD(8);
  return TWELL_UD(16);
#undef TWELL_UD
}

// up_list (the large-M path's up step): lcol / lh [rows, N / 256 * S], lnnz [rows]; the down step is
// sfl_slices_launch over W_dT (common/slices.cu). x/wu null for the non-gated op (h = the stored bf16 value).
cudaError_t twell_up_list_launch(const void* x, const void* wu, int rows, int K, int N, int S, const int32_t* packed,
                                 const int32_t* counts, const int32_t* flag, int32_t* lcol, float* lh, int32_t* lnnz,
                                 cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (K % 64 != 0 || K > 4096 || N % twell::kTileN != 0 || N <= 0 || S < 1 || S > twell::kTileN ||
      lcol == nullptr || lh == nullptr || lnnz == nullptr)
    return cudaErrorInvalidValue;
  const int n_tiles = N / twell::kTileN, ni = (K / 8 + 31) / 32;
  const bool gated = wu != nullptr;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* ub = reinterpret_cast<const __nv_bfloat16*>(wu);
#define TWELL_UL(NI_)                                                                                             \
  launch_up_down<NI_>(gated, (unsigned)rows, stream, xb, ub, nullptr, K, n_tiles, S, 0, packed, counts, flag, nullptr, \
                      lcol, lh, lnnz)
  if (ni <= 2) return TWELL_UL(2);
  if (ni <= 4) return TWELL_UL(4);
  if (ni <= 8) return TWELL_UL(8);
  return TWELL_UL(16);
#undef TWELL_UL
}

// nb: 16-byte chunks per lane per K slice (1, 2, 4, 8). tiles_per_warp < n_tiles requires yacc (atomic path).
cudaError_t twell_down_launch(const void* wdt, int rows, int K, int N, int S, int nb, int tiles_per_warp,
                              int nan_fill, const int32_t* packed, const int32_t* counts, const int32_t* flag,
                              const float* hval, void* y, float* yacc, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (K % 64 != 0 || N % twell::kTileN != 0 || tiles_per_warp < 1) return cudaErrorInvalidValue;
  const int n_tiles = N / twell::kTileN;
  const bool atomic = tiles_per_warp < n_tiles;
  if (atomic && yacc == nullptr) return cudaErrorInvalidValue;
  if (nb != 1 && nb != 2 && nb != 4 && nb != 8) return cudaErrorInvalidValue;
  const int kslices = (K / 8 + 32 * nb - 1) / (32 * nb);
  const int groups = (n_tiles + tiles_per_warp - 1) / tiles_per_warp;
  if (twell::too_many_warps((long long)rows * kslices * groups)) return cudaErrorInvalidValue;
  const unsigned blocks = twell::blocks_for_warps((long long)rows * kslices * groups);
  const auto* w = reinterpret_cast<const __nv_bfloat16*>(wdt);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
  const bool hv = hval != nullptr;
#define TWELL_DOWN(NB_)                                                                                         \
  if (nb == NB_) {                                                                                              \
    if (hv) launch_down<NB_, true>(blocks, stream, atomic, w, rows, K, n_tiles, S, tiles_per_warp, nan_fill,    \
                                   packed, counts, flag, hval, yb, yacc);                                       \
    else launch_down<NB_, false>(blocks, stream, atomic, w, rows, K, n_tiles, S, tiles_per_warp, nan_fill,      \
                                 packed, counts, flag, hval, yb, yacc);                                         \
  }
  TWELL_DOWN(1) TWELL_DOWN(2) TWELL_DOWN(4) TWELL_DOWN(8)
#undef TWELL_DOWN
  return cudaGetLastError();
}

cudaError_t twell_finalize_launch(const float* yacc, const int32_t* flag, int rows, int K, int nan_fill, void* y,
                                  cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (K % 4 != 0) return cudaErrorInvalidValue;
  const long long n4 = (long long)rows * K / 4;
  twell::finalize_kernel<<<(unsigned)((n4 + 255) / 256), 256, 0, stream>>>(
      yacc, flag, rows, K, nan_fill, reinterpret_cast<__nv_bfloat16*>(y));
  return cudaGetLastError();
}

cudaError_t twell_decode_finish_launch(float* yacc, int32_t* nnz, int32_t* flag, int rows, int K, void* y,
                                       unsigned long long* out, unsigned long long* acc, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 8 || K % 4 != 0) return cudaErrorInvalidValue;
  twell::decode_finish_kernel<<<1, 1024, 0, stream>>>(yacc, nnz, flag, rows, K, reinterpret_cast<__nv_bfloat16*>(y),
                                                      out, acc);
  return cudaGetLastError();
}

// decode_rows: K % 64 == 0, K <= 4096, N % 8 == 0, N <= 24576; g [rows, N] bf16 with row stride ldg (a multiple of 8;
// the gate GEMM's output, W_u x for non-gated blocks, whose wu is then nullptr). Writes y [rows, K] bf16; out (the
// measurement, zeroed by the caller) and acc (the model's statistics) are optional.
cudaError_t twell_decode_rows_launch(const void* g, long long ldg, const void* x, const void* wu, const void* wdt,
                                     int rows, int K, int N, int slices, void* y, unsigned long long* out,
                                     unsigned long long* acc, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (K % 64 != 0 || K > 4096 || N % 8 != 0 || N <= 0 || N > kRowsMaxN || ldg % 8 != 0 || ldg < N || slices < 0 ||
      slices > 8)
    return cudaErrorInvalidValue;
  // a row's K slices form a cluster (sm_90: at most 8 blocks, each at least 8 chunks of 8 columns); slices = 0:
  // automatic (launch_rows: 2 * SMs / rows, at most 8, and every row's cluster resident at once)
  const auto* gb = reinterpret_cast<const __nv_bfloat16*>(g);
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* ub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* db = reinterpret_cast<const __nv_bfloat16*>(wdt);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
  const bool gated = wu != nullptr;
  const int ni = (K / 8 + 31) / 32;
  if (ni <= 2) return rows_gated<2>(gated, rows, slices, gb, ldg, xb, ub, db, K, N, yb, out, acc, stream);
  if (ni <= 4) return rows_gated<4>(gated, rows, slices, gb, ldg, xb, ub, db, K, N, yb, out, acc, stream);
  if (ni <= 8) return rows_gated<8>(gated, rows, slices, gb, ldg, xb, ub, db, K, N, yb, out, acc, stream);
  return rows_gated<16>(gated, rows, slices, gb, ldg, xb, ub, db, K, N, yb, out, acc, stream);
}

cudaError_t twell_row_stats_launch(const int32_t* counts, const int32_t* flag, const int32_t* extra, int rows, int N,
                                   unsigned long long* out, unsigned long long* acc, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (N % twell::kTileN != 0) return cudaErrorInvalidValue;
  twell::row_stats_kernel<<<(unsigned)((rows + 255) / 256), 256, 0, stream>>>(counts, flag, extra, rows,
                                                                              N / twell::kTileN, out, acc);
  return cudaGetLastError();
}

// relu_mul_stats: g/u/out [rows, >=N] with row strides ld* (% 8), u == nullptr for non-gated, N % 256 == 0.
// l1_row (if not null) holds rows floats.
cudaError_t twell_relu_mul_stats_launch(const void* g, long long ldg, const void* u, long long ldu, void* out,
                                        long long ldo, int rows, int N, int S, int row_cap, int flag_from,
                                        int32_t* rownnz, unsigned long long* stats, float* l1_row,
                                        unsigned long long* acc, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (N % twell::kTileN != 0 || flag_from % twell::kTileN != 0 || ldg % 8 != 0 || ldo % 8 != 0 ||
      (u != nullptr && ldu % 8 != 0))
    return cudaErrorInvalidValue;
  const int n_tiles = N / twell::kTileN;
  const auto* gb = reinterpret_cast<const __nv_bfloat16*>(g);
  const auto* ub = reinterpret_cast<const __nv_bfloat16*>(u);
  auto* ob = reinterpret_cast<__nv_bfloat16*>(out);
  // few rows: 8 warps per row (parallelism); else one warp per row (8 rows per block)
  const bool wide = rows <= 8 * twell::sm_count();
#define TWELL_RMS(G_, W_)                                                                                      \
  twell::relu_mul_stats_kernel<G_, W_><<<(unsigned)((rows + 8 / W_ - 1) / (8 / W_)), 256, 0, stream>>>(        \
      gb, ldg, ub, ldu, ob, ldo, rows, n_tiles, S, row_cap, flag_from / twell::kTileN, rownnz, stats, l1_row, acc)
  if (u != nullptr) {
    if (wide) TWELL_RMS(true, 8); else TWELL_RMS(true, 1);
  } else {
    if (wide) TWELL_RMS(false, 8); else TWELL_RMS(false, 1);
  }
#undef TWELL_RMS
  return cudaGetLastError();
}

}  // extern "C"
