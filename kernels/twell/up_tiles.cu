// up_tiles: the large-M up step with reuse across rows (kernels/README.md, round 15). The same output as up_list
// (twell_kernels.cu): each unflagged row's entries in column order, lcol[r, 0 .. lnnz[r]) and lh = fp32
// h = g * (x_r . W_u[j]); flagged rows are skipped (lnnz not written). Only the fp32 order of each dot product
// differs from up_list's (here: K ascending, 16 columns at a time).
//
// Why: up_list reads a whole W_u row (4 KB at K 2048) from the L2 for every entry: 7.5 GB at M 65536 and 0.5%
// activity, 15 GB at 1%. Here a block owns BT rows x G TwELL tiles (G * 256 neurons) and walks K in slices of 16
// columns: each slice of its x rows and of its W_u rows is copied once into shared memory (cp.async, three stages) and
// every thread adds the slice's products into its entries' fp32 sums, held in registers. Per entry that is
// (BT + G*256) * K * 2 / (BT * G*256 * p) bytes from the L2: ~1.6 KB at BT 1024, G 4, p 0.5% (x and W_u), against
// ~4.1 KB for up_list, and half that again at 1%.
//
// A block lists its entries (row-major, each row's tiles in order) in rounds of kCap; a heavy block runs several
// rounds, each re-walking K, so no entry is ever dropped. Consecutive blocks share their x rows (the grid walks the
// tile groups fastest), so x comes from HBM about once.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"

namespace twell_up_tiles {

using namespace sfl;

constexpr int kThreads = 512;
constexpr int kMaxBT = 1024;                 // rows per block
constexpr int kRowsPerThread = kMaxBT / kThreads;
constexpr int kG = 4;                        // TwELL tiles per block
constexpr int kTileN = 256;
constexpr int kKS = 16;                      // K columns per slice: 32 bytes of a row
constexpr int kStages = 3;
constexpr int kPPT = 24;                     // entries per thread and round, their codes and sums in registers
constexpr int kCap = kThreads * kPPT;        // entries per round
constexpr int kStageX = kMaxBT * 2, kStageW = kG * kTileN * 2;  // 16-byte slots per stage
constexpr size_t kSmem = (size_t)kStages * (kStageX + kStageW) * 16 + (size_t)kMaxBT * kG * (4 + 2);
static_assert((size_t)kCap * 4 <= (size_t)kStages * (kStageX + kStageW) * 16, "the entry list lives in the stages");

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// A row's 32-byte slice is two 16-byte halves; half h of row i sits at 16-byte slot 2i + (h ^ swz(i)), so that the
// first halves of rows i and i + 4 fall into different banks (random rows: 8 slots per 128 bytes, not 4).
__device__ __forceinline__ int swz(int i) { return (i >> 2) & 1; }

// copies slice s of the block's x rows and W_u rows into its stage
__device__ __forceinline__ void load_slice(uint4* stages, const __nv_bfloat16* __restrict__ x,
                                           const __nv_bfloat16* __restrict__ wu, long long row0, int rows, int n0,
                                           int gn, int K, int s) {
  uint4* xs = stages + (s % kStages) * (kStageX + kStageW);
  uint4* ws = xs + kStageX;
  const int k0 = s * kKS;
  for (int c = threadIdx.x; c < 2 * rows; c += kThreads) {
    const int i = c >> 1, h = c & 1;
    cp16(xs + 2 * i + (h ^ swz(i)), x + (row0 + i) * K + k0 + 8 * h);
  }
  for (int c = threadIdx.x; c < 2 * gn; c += kThreads) {
    const int j = c >> 1, h = c & 1;
    cp16(ws + 2 * j + (h ^ swz(j)), wu + (long long)(n0 + j) * K + k0 + 8 * h);
  }
  cp_commit();
}

// row i's slice as fp32 (converted once per row: a thread's entries are sorted by row)
__device__ __forceinline__ void load_xf(float* xf, const uint4* xs, int i) {
  const int si = swz(i);
  const uint4 lo = xs[2 * i + si], hi = xs[2 * i + (si ^ 1)];
  const uint32_t a[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    xf[2 * q] = bf16lo(a[q]);
    xf[2 * q + 1] = bf16hi(a[q]);
  }
}

// acc += x_i . w_j over one slice, K ascending, in two chains (even / odd columns) added at the end of the slice
__device__ __forceinline__ float slice_dot(const float* xf, const uint4* ws, int j, float acc) {
  const int sj = swz(j);
  const uint4 wl = ws[2 * j + sj], wh = ws[2 * j + (sj ^ 1)];
  const uint32_t b[8] = {wl.x, wl.y, wl.z, wl.w, wh.x, wh.y, wh.z, wh.w};
  float ev = 0.f, od = 0.f;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    ev = fmaf(xf[2 * q], bf16lo(b[q]), ev);
    od = fmaf(xf[2 * q + 1], bf16hi(b[q]), od);
  }
  return acc + (ev + od);
}

// entry code: row in block << 18 | tile in group << 16 | rank in tile << 8 | column in tile
__device__ __forceinline__ int code_row(uint32_t cd) { return (int)(cd >> 18); }
__device__ __forceinline__ int code_neuron(uint32_t cd) { return (int)((cd >> 16) & 3u) * kTileN + (int)(cd & 0xffu); }

__global__ void __launch_bounds__(kThreads, 1) up_tiles_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wu, int M, int K, int n_tiles, int S,
    int bt, int n_groups, const int32_t* __restrict__ packed, const int32_t* __restrict__ counts,
    const int32_t* __restrict__ flag, int32_t* __restrict__ lcol, float* __restrict__ lh,
    int32_t* __restrict__ lnnz, int diag) {
  extern __shared__ uint4 smem[];
  uint4* stages = smem;                                              // [kStages][x slots, W_u slots]
  uint32_t* code = reinterpret_cast<uint32_t*>(smem);                // [kCap] a round's entries, before its copies
  int* rowpre = reinterpret_cast<int*>(smem + kStages * (kStageX + kStageW));  // [kMaxBT][kG] entries before the tile
  uint16_t* rowcnt = reinterpret_cast<uint16_t*>(rowpre + kMaxBT * kG);        // [kMaxBT][kG] capped counts
  __shared__ int warp_total[kThreads / 32];

  const int grp = blockIdx.x % n_groups;
  const long long row0 = (long long)(blockIdx.x / n_groups) * bt;
  const int rows = (int)min((long long)bt, (long long)M - row0);
  const int t0 = grp * kG, gt = min(kG, n_tiles - t0), gn = gt * kTileN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long W = (long long)n_tiles * S;

  // 1. per row: the group's capped counts and the row's entries before each of its tiles; group 0 writes lnnz
  int mine[kRowsPerThread], sum = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int rl = tid * kRowsPerThread + i;
    int tot = 0;
    if (rl < rows && !flag[row0 + rl]) {
      const int32_t* cr = counts + (row0 + rl) * n_tiles;
      const int tend = grp == 0 ? n_tiles : t0 + gt;
      int pre = 0;
      for (int t = 0; t < tend; ++t) {
        const int c = min(cr[t], S);
        if (t >= t0 && t < t0 + gt) {
          rowpre[rl * kG + t - t0] = pre;
          rowcnt[rl * kG + t - t0] = (uint16_t)c;
          tot += c;
        }
        pre += c;
      }
      if (grp == 0) lnnz[row0 + rl] = pre;
    } else {
      for (int t = 0; t < kG; ++t) rowcnt[rl * kG + t] = 0;
    }
    mine[i] = tot;
    sum += tot;
  }
  const int incl = warp_inclusive_sum(sum);
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  int first = incl - sum, total = 0;  // first: this thread's rows' place in the block's entry order
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) first += warp_total[w];
    total += warp_total[w];
  }
  const int n_slices = K / kKS, n0 = t0 * kTileN;

  for (int lo = 0; lo < total; lo += kCap) {  // rounds (one unless the block is heavy)
    const int n = min(kCap, total - lo);
    // 2. this round's entries, listed in the stages' space: each thread its rows' entries in [lo, lo + n)
    int p = first;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int rl = tid * kRowsPerThread + i;
      if (mine[i] > 0 && p < lo + n && p + mine[i] > lo) {
        for (int tg = 0; tg < gt; ++tg) {
          const int c = rowcnt[rl * kG + tg];
          const int e0 = max(0, lo - p), e1 = min(c, lo + n - p);
          const int32_t* words = packed + ((row0 + rl) * n_tiles + t0 + tg) * S;
          for (int e = e0; e < e1; ++e)
            code[p + e - lo] = (uint32_t)rl << 18 | (uint32_t)tg << 16 | (uint32_t)e << 8 |
                               ((uint32_t)words[e] & 0xffu);
          p += c;
        }
      } else {
        p += mine[i];
      }
    }
    __syncthreads();
    // 3. thread tid owns entries [tid * ppt, min(n, (tid + 1) * ppt)): codes and sums in registers
    const int ppt = (n + kThreads - 1) / kThreads;
    const int e0 = tid * ppt, mycnt = max(0, min(n - e0, ppt));
    uint32_t cd[kPPT];
    float acc[kPPT];
#pragma unroll
    for (int q = 0; q < kPPT; ++q) {
      cd[q] = q < mycnt ? code[e0 + q] : 0u;
      acc[q] = 0.f;
    }
    __syncthreads();  // the copies overwrite the list
    if (diag != 2) load_slice(stages, x, wu, row0, rows, n0, gn, K, 0);
    if (diag != 2 && n_slices > 1) load_slice(stages, x, wu, row0, rows, n0, gn, K, 1);
    for (int s = 0; s < n_slices; ++s) {
      if (s + 1 < n_slices) cp_wait<1>(); else cp_wait<0>();
      __syncthreads();  // slice s is in; every thread is done with slice s - 1, whose stage the next copy fills
      if (diag != 2 && s + 2 < n_slices) load_slice(stages, x, wu, row0, rows, n0, gn, K, s + 2);
      const uint4* xb = stages + (s % kStages) * (kStageX + kStageW);
      const uint4* wb = xb + kStageX;
      float xf[kKS];
      int cur = -1;
#pragma unroll
      for (int q = 0; q < kPPT; ++q) {
        if (q < mycnt && diag != 1) {
          if (code_row(cd[q]) != cur) {
            cur = code_row(cd[q]);
            load_xf(xf, xb, cur);
          }
          acc[q] = slice_dot(xf, wb, code_neuron(cd[q]), acc[q]);
        }
      }
    }
    // 4. h = g * u into the row's list at its rank
#pragma unroll
    for (int q = 0; q < kPPT; ++q) {
      if (q < mycnt) {
        const int rl = code_row(cd[q]), tg = (int)((cd[q] >> 16) & 3u), e = (int)((cd[q] >> 8) & 0xffu);
        const long long r = row0 + rl;
        const uint32_t word = (uint32_t)packed[(r * n_tiles + t0 + tg) * S + e];
        const long long at = r * W + rowpre[rl * kG + tg] + e;
        lcol[at] = (t0 + tg) * kTileN + (int)(cd[q] & 0xffu);
        lh[at] = bf16hi(word) * acc[q];
      }
    }
    __syncthreads();  // the next round lists its entries over the stages
  }
}

}  // namespace twell_up_tiles

extern "C" {

// bt: rows per block (1 .. 1024; 0 = 1024). K % 16 == 0, N % 256 == 0, 1 <= S <= 256, x and wu 16-byte aligned.
cudaError_t twell_up_tiles_launch(const void* x, const void* wu, int rows, int K, int N, int S, int bt,
                                  const int32_t* packed, const int32_t* counts, const int32_t* flag, int32_t* lcol,
                                  float* lh, int32_t* lnnz, cudaStream_t stream) {
  using namespace twell_up_tiles;
  if (rows <= 0) return cudaSuccess;
  const int diag = bt >> 16;  // LAB ONLY: 1 = copies only, 2 = sums only
  bt &= 0xffff;
  if (bt == 0) bt = kMaxBT;
  if (x == nullptr || wu == nullptr || K % kKS != 0 || K <= 0 || N % kTileN != 0 || N <= 0 || S < 1 ||
      S > kTileN || bt < 1 || bt > kMaxBT || ((uintptr_t)x & 15) || ((uintptr_t)wu & 15) || lcol == nullptr ||
      lh == nullptr || lnnz == nullptr)
    return cudaErrorInvalidValue;
  const int n_tiles = N / kTileN, n_groups = (n_tiles + kG - 1) / kG;
  const long long blocks = (long long)((rows + bt - 1) / bt) * n_groups;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  static bool ready[64];  // the shared-memory attribute is per device
  if (dev >= 64) return cudaErrorInvalidValue;
  if (!ready[dev]) {
    e = cudaFuncSetAttribute(up_tiles_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem);
    if (e != cudaSuccess) return e;
    ready[dev] = true;
  }
  up_tiles_kernel<<<(unsigned)blocks, kThreads, kSmem, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), reinterpret_cast<const __nv_bfloat16*>(wu), rows, K, n_tiles, S, bt,
      n_groups, packed, counts, flag, lcol, lh, lnnz, diag);
  return cudaGetLastError();
}

}  // extern "C"
