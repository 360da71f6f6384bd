// The backup rows of the sparse FFN, shared by the inference runtime (kernels/twell/runtime.cpp) and the training
// forward (kernels/train/ops.py): rows flagged by the sparse path (a tile or row over its ELL width, or a
// non-finite gate value) are computed densely, exactly, with no host synchronisation.
//
// `rows` lists the flagged rows ascending, -1 after the last (torch.nonzero_static); `count` (device) is how many there
// are. The caller computes rows[0 .. cap) with cuBLAS on a gathered block (cap from the layer's history, known on the
// host; unused block rows are zero) and scatters them back with scatter_rows; rows[cap .. count) go through
// dense_rows_fwd, exact on CUDA cores, so no row is dropped whatever count is. Plain CUDA (no torch headers);
// the launchers are declared in backup_rows.h.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "bf16.cuh"

namespace sflrows {

using namespace sfl;

constexpr int kMaxNI = 16;  // dense_rows_fwd's y row in registers, 8 x NI per lane: K <= 32 x 8 x 16 = 4096

// gather_rows: dst[i] = src[idx[i]], a zero row where idx[i] < 0 (bf16 rows of K, 16-byte chunks; one warp per row).
__global__ void __launch_bounds__(256) gather_rows_kernel(const uint4* __restrict__ src,
                                                          const int64_t* __restrict__ idx, int n, int K8,
                                                          uint4* __restrict__ dst) {
  const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (w >= n) return;
  const long long r = idx[w];
  for (int c = threadIdx.x & 31; c < K8; c += 32) dst[w * K8 + c] = r >= 0 ? src[r * K8 + c] : make_uint4(0, 0, 0, 0);
}

// scatter_rows: the block's results back into the batch, for every block row i with idx[i] >= 0: y[idx[i]] = yb[i],
// and unless hb is null (inference: y only) rowabs[idx[i]] = sum |hb[i, :]| (fp32, a fixed order: deterministic),
// and with `last` the tracker, last[j] = max(last[j], idx[i]) for every relu-active ab[i, j]. One warp per block
// row; hb, ab bf16 [n, N] (N % 8 == 0).
__global__ void __launch_bounds__(256) scatter_rows_kernel(const uint4* __restrict__ yb, const uint4* __restrict__ hb,
                                                           const uint4* __restrict__ ab,
                                                           const int64_t* __restrict__ idx, int n, int K8, int N8,
                                                           uint4* __restrict__ y, float* __restrict__ rowabs,
                                                           long long* last) {
  const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (w >= n) return;
  const long long r = idx[w];
  if (r < 0) return;  // warp-uniform
  const int lane = threadIdx.x & 31;
  for (int c = lane; c < K8; c += 32) y[r * K8 + c] = yb[w * K8 + c];
  if (hb == nullptr) return;  // y only (inference)
  float t = 0.f;
  for (int c = lane; c < N8; c += 32) {
    const uint4 v = hb[w * N8 + c];
    t += fabsf(bf16lo(v.x)) + fabsf(bf16hi(v.x)) + fabsf(bf16lo(v.y)) + fabsf(bf16hi(v.y)) + fabsf(bf16lo(v.z)) +
         fabsf(bf16hi(v.z)) + fabsf(bf16lo(v.w)) + fabsf(bf16hi(v.w));
    if (last != nullptr) {
      bool nf = false;
      const unsigned act = relu_mask8(ab[w * N8 + c], nf);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if ((act >> i) & 1u) atomicMax(last + 8LL * c + i, r);
    }
  }
  t = warp_sum(t);
  if (lane == 0) rowabs[r] = t;
}

// dense_rows_fwd: one CTA per flagged row (grid-stride): rows[start + b], b < count - start, or with `flag` (the
// caller's block is empty) every row r with flag[r], found by the CTAs' own scan of flag in chunks of 256 (no list,
// no count; 256 threads per CTA). x goes
// to shared memory (row_dot_shared: the y accumulators need the registers, 128 per lane at K = 4096); every warp walks
// neurons j = warp, warp + 8, ...: g = x . W_first[j] rounded to bf16 (as the cuBLAS output would be), active as relu
// keeps it (> 0, +Inf, NaN); then u = x . W_u[j] (gated, fp32), h = g u (non-gated: h = g),
// y += h W_dT[j] in fp32 registers, |h| summed, last[j] = max(last[j], row) when tracking. The 8 warps' partial rows
// are added in a fixed order through shared memory (deterministic). Writes y[row] (bf16) and rowabs[row] (when not
// null). Non-finite x (gated): dense forms relu(g) u = 0 * u at an inactive neuron too, NaN where u is not finite,
// and then NaN in every y entry; such a row's inactive neurons are checked and the row is NaN as in dense.
// Cost: all of W_first per row (23 MB at 2048 x 5632, L2-resident when rows run together): the capacity-overflow
// path, not the common one.
template <int NI, bool GATED>
__device__ __forceinline__ void dense_row(long long row, const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ wf, const __nv_bfloat16* __restrict__ wu,
                                          const __nv_bfloat16* __restrict__ wdt, int K, int N,
                                          __nv_bfloat16* __restrict__ y, float* __restrict__ rowabs, long long* last,
                                          float* part, uint4* xs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int K8 = K >> 3;
  bool bad = false;
  for (int c = threadIdx.x; c < K8; c += blockDim.x) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(x + row * K) + c);
    xs[c] = v;
    for (const uint32_t w : {v.x, v.y, v.z, v.w})  // a bf16 half with every exponent bit set: Inf or NaN
      bad |= (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
  }
  const bool xbad = __syncthreads_or(bad) && GATED;  // the barrier always (xs is read by every warp)
  bool nan_row = false;  // warp-uniform: some inactive neuron has a non-finite u
  float acc[NI * 8];
#pragma unroll
  for (int i = 0; i < NI * 8; ++i) acc[i] = 0.f;
  float absacc = 0.f;
#pragma unroll 1
  for (int j = warp; j < N; j += 8) {
    const float g = row_dot_shared<NI>(xs, wf + (long long)j * K, K);
    const uint32_t gb = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(g));
    if (!relu_active(gb)) {  // warp-uniform: every lane holds the same sum
      if (xbad && !nan_row) {
        const float u = row_dot_shared<NI>(xs, wu + (long long)j * K, K);
        nan_row = !isfinite(__bfloat162float(__float2bfloat16_rn(u)));  // cuBLAS's u is bf16
      }
      continue;
    }
    if (last != nullptr && lane == 0) atomicMax(last + j, row);
    float h = __uint_as_float(gb << 16);
    if (GATED) h *= row_dot_shared<NI>(xs, wu + (long long)j * K, K);
    absacc += fabsf(h);
    const uint4* dr = reinterpret_cast<const uint4*>(wdt + (long long)j * K);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + 32 * i;
      if (c < K8) axpy8(h, __ldg(dr + c), acc + 8 * i);
    }
  }
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int c = lane + 32 * i;
    if (c < K8) {
#pragma unroll
      for (int q = 0; q < 8; ++q) part[warp * K + c * 8 + q] = acc[8 * i + q];
    }
  }
  if (lane == 0) part[8 * K + warp] = nan_row ? __int_as_float(0x7fc00000) : absacc;
  const bool nan_out = __syncthreads_or(nan_row);
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) t += part[w * K + k];
    y[row * K + k] = __float2bfloat16_rn(nan_out ? __int_as_float(0x7fc00000) : t);
  }
  if (threadIdx.x == 0 && rowabs != nullptr) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) t += part[8 * K + w];
    rowabs[row] = t;
  }
  __syncthreads();  // part and xs are reused by the next row
}

template <int NI, bool GATED>
__global__ void __launch_bounds__(256, 1) dense_rows_fwd_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wf, const __nv_bfloat16* __restrict__ wu,
    const __nv_bfloat16* __restrict__ wdt, int M, int K, int N, const int64_t* __restrict__ rows,
    const int64_t* __restrict__ count, int start, const int32_t* __restrict__ flag, __nv_bfloat16* __restrict__ y,
    float* __restrict__ rowabs, long long* last) {
  extern __shared__ float part[];  // [8][K] partial rows, [8] |h| sums, then x (K bf16)
  uint4* xs = reinterpret_cast<uint4*>(part + 8 * K + 8);
  if (flag != nullptr) {  // chunks of 256 rows, one flag per thread: one load per chunk, not one per row
    __shared__ int hit[256];
    for (long long r0 = (long long)blockIdx.x * 256; r0 < M; r0 += (long long)gridDim.x * 256) {
      const int mine = r0 + threadIdx.x < M && flag[r0 + threadIdx.x] != 0;
      if (!__syncthreads_or(mine)) continue;  // CTA-uniform: the common chunk has no flagged row
      hit[threadIdx.x] = mine;
      __syncthreads();
      for (int t = 0; t < 256; ++t)
        if (hit[t]) dense_row<NI, GATED>(r0 + t, x, wf, wu, wdt, K, N, y, rowabs, last, part, xs);  // CTA-uniform
    }
    return;
  }
  const long long n = *count;
  for (long long b = start + blockIdx.x; b < n; b += gridDim.x)
    dense_row<NI, GATED>(rows[b], x, wf, wu, wdt, K, N, y, rowabs, last, part, xs);
}

// ---------------------------------------------------------------------------------------------- backward
// The training backward of the flagged rows rows[start .. *count) (the rows past the caller's cuBLAS block), exact
// on CUDA cores with no host-known count, so that a backward needs no host read and can be captured. Per (row, neuron
// j) the scalars of reference.dense_rows_backward's ops, rounded to bf16 where those ops round:
//   g = bf16(x . W_first[j]), a = relu(g) (NaN stays NaN), u = bf16(x . W_u[j]) and h = bf16(a u) (gated; else h = a),
//   dh = bf16(bf16(dy . W_dT[j]) + bf16(c) sgn(h)) with c = dL/d|h| (l1c), da = bf16(dh u) (gated; else dh),
//   dg = a <= 0 ? 0 : da, du = bf16(dh a).
// dense_rows_bwd_dx writes dx[row] = dg W_first + du W_u (fp32 sums, one bf16 rounding; the reference rounds the two
// GEMMs apart); dense_rows_bwd_dw adds the rows' dW_first[j] += dg x, dW_u[j] += du x, dW_dT[j] += h dy to the
// weight gradients already written (one more bf16 rounding). Every neuron of every such row is computed, so NaN and
// Inf propagate as in dense autograd's GEMMs (0 x Inf = NaN included). Cost: W_first, W_u and W_dT read twice per
// overflow row (dx) and every overflow row's x and dy per neuron (dW): the capacity-overflow path, not the common one.
struct BwdScalars {
  float h, dg, du;
};

__device__ __forceinline__ float bf16_at_f(const uint4& v, int i) { return __uint_as_float(bf16_at(v, i) << 16); }

template <bool GATED>
__device__ __forceinline__ BwdScalars bwd_scalars(float g_dot, float u_dot, float d_dot, float c) {
  const float g = __bfloat162float(__float2bfloat16_rn(g_dot));
  const float a = g > 0.f || isnan(g) ? g : 0.f;
  const float u = GATED ? __bfloat162float(__float2bfloat16_rn(u_dot)) : 0.f;
  const float h = GATED ? __bfloat162float(__float2bfloat16_rn(a * u)) : a;
  const float sg = (h > 0.f ? 1.f : 0.f) - (h < 0.f ? 1.f : 0.f);  // torch's sgn: (0 < h) - (h < 0), 0 at NaN
  const float cb = __bfloat162float(__float2bfloat16_rn(c));
  const float dh = __bfloat162float(__float2bfloat16_rn(
      __bfloat162float(__float2bfloat16_rn(d_dot)) + __bfloat162float(__float2bfloat16_rn(cb * sg))));
  const float da = GATED ? __bfloat162float(__float2bfloat16_rn(dh * u)) : dh;
  const float dg = a <= 0.f ? 0.f : da;
  const float du = GATED ? __bfloat162float(__float2bfloat16_rn(dh * a)) : 0.f;
  return {h, dg, du};
}

// dx of one row, one CTA of 256 threads: x and dy in shared memory, every warp walks neurons j = warp, warp + 8, ...
// and adds dg W_first[j] + du W_u[j] into fp32 registers, for every neuron (an inactive one adds 0 x W, which is NaN
// where W holds Inf or NaN, as in the dense GEMMs); the 8 warps' partial rows are added in a fixed order
// (deterministic).
template <int NI, bool GATED>
__device__ __forceinline__ void dense_row_bwd_dx(long long row, const __nv_bfloat16* __restrict__ x,
                                                 const __nv_bfloat16* __restrict__ dy,
                                                 const __nv_bfloat16* __restrict__ wf,
                                                 const __nv_bfloat16* __restrict__ wu,
                                                 const __nv_bfloat16* __restrict__ wdt, int K, int N, float c,
                                                 __nv_bfloat16* __restrict__ dx, float* part, uint4* xs, uint4* dys) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int K8 = K >> 3;
  for (int i = threadIdx.x; i < K8; i += blockDim.x) {
    xs[i] = __ldg(reinterpret_cast<const uint4*>(x + row * K) + i);
    dys[i] = __ldg(reinterpret_cast<const uint4*>(dy + row * K) + i);
  }
  __syncthreads();  // xs, dys are read by every warp
  float acc[NI * 8];
#pragma unroll
  for (int i = 0; i < NI * 8; ++i) acc[i] = 0.f;
#pragma unroll 1
  for (int j = warp; j < N; j += 8) {
    const float g_dot = row_dot_shared<NI>(xs, wf + (long long)j * K, K);
    const float u_dot = GATED ? row_dot_shared<NI>(xs, wu + (long long)j * K, K) : 0.f;
    const float d_dot = row_dot_shared<NI>(dys, wdt + (long long)j * K, K);
    const BwdScalars s = bwd_scalars<GATED>(g_dot, u_dot, d_dot, c);
    const uint4* fr = reinterpret_cast<const uint4*>(wf + (long long)j * K);
    const uint4* ur = reinterpret_cast<const uint4*>(wu + (long long)j * K);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int cc = lane + 32 * i;
      if (cc < K8) {
        axpy8(s.dg, __ldg(fr + cc), acc + 8 * i);
        if (GATED) axpy8(s.du, __ldg(ur + cc), acc + 8 * i);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int cc = lane + 32 * i;
    if (cc < K8) {
#pragma unroll
      for (int q = 0; q < 8; ++q) part[warp * K + cc * 8 + q] = acc[8 * i + q];
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) t += part[w * K + k];
    dx[row * K + k] = __float2bfloat16_rn(t);
  }
  __syncthreads();  // part, xs and dys are reused by the next row
}

template <int NI, bool GATED>
__global__ void __launch_bounds__(256, 1) dense_rows_bwd_dx_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ wf,
    const __nv_bfloat16* __restrict__ wu, const __nv_bfloat16* __restrict__ wdt, int K, int N,
    const int64_t* __restrict__ rows, const int64_t* __restrict__ count, int start, const float* __restrict__ l1c,
    __nv_bfloat16* __restrict__ dx) {
  extern __shared__ float part[];  // [8][K] partial rows, then x and dy (K bf16 each)
  uint4* xs = reinterpret_cast<uint4*>(part + 8 * K);
  uint4* dys = xs + (K >> 3);
  const long long n = *count;
  const float c = *l1c;
  for (long long b = start + blockIdx.x; b < n; b += gridDim.x)
    dense_row_bwd_dx<NI, GATED>(rows[b], x, dy, wf, wu, wdt, K, N, c, dx, part, xs, dys);
}

// The weight gradients of the same rows: one CTA of 256 threads per neuron j (grid-stride), thread t holding the
// 16-byte chunks t and t + 256 of W_first[j], W_u[j], W_dT[j] and of the three fp32 gradient rows. Per row, the three
// dot products are reduced over the CTA in a fixed order (deterministic) through a double-buffered shared array
// (one barrier per row); then dW_first[j] += dg x, dW_u[j] += du x, dW_dT[j] += h dy, added to the written
// gradients once at the end. K <= 4096 (two chunks per thread).
template <bool GATED>
__global__ void __launch_bounds__(256) dense_rows_bwd_dw_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ wf,
    const __nv_bfloat16* __restrict__ wu, const __nv_bfloat16* __restrict__ wdt, int K, int N,
    const int64_t* __restrict__ rows, const int64_t* __restrict__ count, int start, const float* __restrict__ l1c,
    __nv_bfloat16* __restrict__ dwf, __nv_bfloat16* __restrict__ dwu, __nv_bfloat16* __restrict__ dwdt) {
  __shared__ float red[2][8][3];
  const long long n = *count;
  if (n <= start) return;  // CTA-uniform: no row past the block (the common case)
  const float c = *l1c;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, K8 = K >> 3;
  for (int j = blockIdx.x; j < N; j += gridDim.x) {
    uint4 fw[2], uw[2], dw[2];
    float ag[16], au[16], ad[16];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int cc = threadIdx.x + 256 * i;
      const bool in = cc < K8;
      fw[i] = in ? __ldg(reinterpret_cast<const uint4*>(wf + (long long)j * K) + cc) : make_uint4(0, 0, 0, 0);
      uw[i] = in && GATED ? __ldg(reinterpret_cast<const uint4*>(wu + (long long)j * K) + cc) : make_uint4(0, 0, 0, 0);
      dw[i] = in ? __ldg(reinterpret_cast<const uint4*>(wdt + (long long)j * K) + cc) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) ag[i] = au[i] = ad[i] = 0.f;
    for (long long b = start; b < n; ++b) {
      const long long r = rows[b];
      uint4 xv[2], dv[2];
      float pg = 0.f, pu = 0.f, pd = 0.f;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int cc = threadIdx.x + 256 * i;
        const bool in = cc < K8;
        xv[i] = in ? __ldg(reinterpret_cast<const uint4*>(x + r * K) + cc) : make_uint4(0, 0, 0, 0);
        dv[i] = in ? __ldg(reinterpret_cast<const uint4*>(dy + r * K) + cc) : make_uint4(0, 0, 0, 0);
        if (in) {
          pg = dot8(xv[i], fw[i], pg);
          if (GATED) pu = dot8(xv[i], uw[i], pu);
          pd = dot8(dv[i], dw[i], pd);
        }
      }
      pg = warp_sum(pg);
      pu = warp_sum(pu);
      pd = warp_sum(pd);
      const int buf = (int)(b & 1);
      if (lane == 0) {
        red[buf][warp][0] = pg;
        red[buf][warp][1] = pu;
        red[buf][warp][2] = pd;
      }
      __syncthreads();  // one barrier per row: the other buffer is written only after the next one
      float g_dot = 0.f, u_dot = 0.f, d_dot = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        g_dot += red[buf][w][0];
        u_dot += red[buf][w][1];
        d_dot += red[buf][w][2];
      }
      const BwdScalars s = bwd_scalars<GATED>(g_dot, u_dot, d_dot, c);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        axpy8(s.dg, xv[i], ag + 8 * i);
        if (GATED) axpy8(s.du, xv[i], au + 8 * i);
        axpy8(s.h, dv[i], ad + 8 * i);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int cc = threadIdx.x + 256 * i;
      if (cc >= K8) continue;
      const long long at = (long long)j * K8 + cc;
      float t[8];
      uint4 v = reinterpret_cast<uint4*>(dwf)[at];
      for (int q = 0; q < 8; ++q) t[q] = bf16_at_f(v, q) + ag[8 * i + q];
      reinterpret_cast<uint4*>(dwf)[at] = pack8(t);
      if (GATED) {
        v = reinterpret_cast<uint4*>(dwu)[at];
        for (int q = 0; q < 8; ++q) t[q] = bf16_at_f(v, q) + au[8 * i + q];
        reinterpret_cast<uint4*>(dwu)[at] = pack8(t);
      }
      v = reinterpret_cast<uint4*>(dwdt)[at];
      for (int q = 0; q < 8; ++q) t[q] = bf16_at_f(v, q) + ad[8 * i + q];
      reinterpret_cast<uint4*>(dwdt)[at] = pack8(t);
    }
    __syncthreads();  // red is reused by the next neuron
  }
}

inline unsigned blocks_for(long long warps, int threads) {
  return (unsigned)((warps * 32 + threads - 1) / threads);
}

}  // namespace sflrows

extern "C" {

cudaError_t sfl_gather_rows_launch(const void* src, const int64_t* idx, int n, int K, void* dst,
                                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (K % 8 != 0 || (reinterpret_cast<uintptr_t>(src) & 15) || (reinterpret_cast<uintptr_t>(dst) & 15))
    return cudaErrorInvalidValue;
  sflrows::gather_rows_kernel<<<sflrows::blocks_for(n, 256), 256, 0, stream>>>(
      reinterpret_cast<const uint4*>(src), idx, n, K / 8, reinterpret_cast<uint4*>(dst));
  return cudaGetLastError();
}

cudaError_t sfl_scatter_rows_launch(const void* yb, const void* hb, const void* ab, const int64_t* idx, int n,
                                    int K, int N, void* y, float* rowabs, int64_t* last, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (K % 8 != 0 || N % 8 != 0) return cudaErrorInvalidValue;
  for (const void* p : {yb, hb, ab, (const void*)y})
    if (reinterpret_cast<uintptr_t>(p) & 15) return cudaErrorInvalidValue;
  if (hb == nullptr && last != nullptr) return cudaErrorInvalidValue;  // the tracker needs ab, which comes with hb
  sflrows::scatter_rows_kernel<<<sflrows::blocks_for(n, 256), 256, 0, stream>>>(
      reinterpret_cast<const uint4*>(yb), reinterpret_cast<const uint4*>(hb), reinterpret_cast<const uint4*>(ab), idx,
      n, K / 8, N / 8, reinterpret_cast<uint4*>(y), rowabs, reinterpret_cast<long long*>(last));
  return cudaGetLastError();
}

cudaError_t sfl_dense_rows_fwd_launch(int gated, const void* x, const void* wf, const void* wu, const void* wdt,
                                      int M, int K, int N, const int64_t* rows, const int64_t* count, int start,
                                      const int32_t* flag, void* y, float* rowabs, int64_t* last, int grid,
                                      cudaStream_t stream) {
  if (M <= 0 || start >= M || grid <= 0) return cudaSuccess;
  if (flag == nullptr && (rows == nullptr || count == nullptr)) return cudaErrorInvalidValue;
  if (K % 8 != 0 || K > 32 * 8 * sflrows::kMaxNI) return cudaErrorInvalidValue;
  const int ni = (K / 8 + 31) / 32;
  const size_t smem = (size_t)(8 * K + 8) * sizeof(float) + (size_t)K * 2;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* wfb = reinterpret_cast<const __nv_bfloat16*>(wf);
  const auto* wub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* wdb = reinterpret_cast<const __nv_bfloat16*>(wdt);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
  auto* lb = reinterpret_cast<long long*>(last);
  cudaError_t e = cudaSuccess;
#define SFL_DR_CASE(NI_)                                                                                         \
  case NI_:                                                                                                      \
    if (gated) {                                                                                                 \
      e = cudaFuncSetAttribute(sflrows::dense_rows_fwd_kernel<NI_, true>,                                      \
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);                          \
      if (e == cudaSuccess)                                                                                      \
        sflrows::dense_rows_fwd_kernel<NI_, true><<<grid, 256, smem, stream>>>(xb, wfb, wub, wdb, M, K, N,      \
                                                                               rows, count, start, flag, yb,    \
                                                                               rowabs, lb);                     \
    } else {                                                                                                     \
      e = cudaFuncSetAttribute(sflrows::dense_rows_fwd_kernel<NI_, false>,                                     \
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);                          \
      if (e == cudaSuccess)                                                                                      \
        sflrows::dense_rows_fwd_kernel<NI_, false><<<grid, 256, smem, stream>>>(xb, wfb, wub, wdb, M, K, N,     \
                                                                                rows, count, start, flag, yb,   \
                                                                                rowabs, lb);                    \
    }                                                                                                            \
    break;
  switch (ni) {
    SFL_DR_CASE(1) SFL_DR_CASE(2) SFL_DR_CASE(3) SFL_DR_CASE(4) SFL_DR_CASE(5) SFL_DR_CASE(6) SFL_DR_CASE(7)
    SFL_DR_CASE(8) SFL_DR_CASE(9) SFL_DR_CASE(10) SFL_DR_CASE(11) SFL_DR_CASE(12) SFL_DR_CASE(13)
    SFL_DR_CASE(14) SFL_DR_CASE(15) SFL_DR_CASE(16)
    default: return cudaErrorInvalidValue;
  }
#undef SFL_DR_CASE
  return e != cudaSuccess ? e : cudaGetLastError();
}

cudaError_t sfl_dense_rows_bwd_launch(int gated, const void* x, const void* dy, const void* wf, const void* wu,
                                      const void* wdt, int M, int K, int N, const int64_t* rows, const int64_t* count,
                                      int start, const float* l1c, void* dx, void* dwf, void* dwu, void* dwdt,
                                      int grid, cudaStream_t stream) {
  if (M <= 0 || start >= M || grid <= 0 || N <= 0) return cudaSuccess;
  if (rows == nullptr || count == nullptr || l1c == nullptr) return cudaErrorInvalidValue;
  if (K % 8 != 0 || K > 32 * 8 * sflrows::kMaxNI) return cudaErrorInvalidValue;
  for (const void* p : {x, dy, wf, wu, wdt, (const void*)dwf, (const void*)dwu, (const void*)dwdt})
    if (p != nullptr && (reinterpret_cast<uintptr_t>(p) & 15)) return cudaErrorInvalidValue;
  const int ni = (K / 8 + 31) / 32;
  const size_t smem = (size_t)8 * K * sizeof(float) + (size_t)K * 2 * 2;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* dyb = reinterpret_cast<const __nv_bfloat16*>(dy);
  const auto* wfb = reinterpret_cast<const __nv_bfloat16*>(wf);
  const auto* wub = reinterpret_cast<const __nv_bfloat16*>(wu);
  const auto* wdb = reinterpret_cast<const __nv_bfloat16*>(wdt);
  auto* dxb = reinterpret_cast<__nv_bfloat16*>(dx);
  cudaError_t e = cudaSuccess;
#define SFL_DRB_CASE(NI_)                                                                                        \
  case NI_:                                                                                                      \
    if (gated) {                                                                                                 \
      e = cudaFuncSetAttribute(sflrows::dense_rows_bwd_dx_kernel<NI_, true>,                                   \
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);                          \
      if (e == cudaSuccess)                                                                                      \
        sflrows::dense_rows_bwd_dx_kernel<NI_, true><<<grid, 256, smem, stream>>>(xb, dyb, wfb, wub, wdb, K, N, \
                                                                                  rows, count, start, l1c, dxb); \
    } else {                                                                                                     \
      e = cudaFuncSetAttribute(sflrows::dense_rows_bwd_dx_kernel<NI_, false>,                                  \
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);                          \
      if (e == cudaSuccess)                                                                                      \
        sflrows::dense_rows_bwd_dx_kernel<NI_, false><<<grid, 256, smem, stream>>>(xb, dyb, wfb, wub, wdb, K,   \
                                                                                   N, rows, count, start, l1c,  \
                                                                                   dxb);                        \
    }                                                                                                            \
    break;
  switch (ni) {
    SFL_DRB_CASE(1) SFL_DRB_CASE(2) SFL_DRB_CASE(3) SFL_DRB_CASE(4) SFL_DRB_CASE(5) SFL_DRB_CASE(6)
    SFL_DRB_CASE(7) SFL_DRB_CASE(8) SFL_DRB_CASE(9) SFL_DRB_CASE(10) SFL_DRB_CASE(11) SFL_DRB_CASE(12)
    SFL_DRB_CASE(13) SFL_DRB_CASE(14) SFL_DRB_CASE(15) SFL_DRB_CASE(16)
    default: return cudaErrorInvalidValue;
  }
#undef SFL_DRB_CASE
  if (e != cudaSuccess) return e;
  const unsigned nblocks = (unsigned)(N < 4 * grid ? N : 4 * grid);  // up to 8 CTAs of 256 per SM (grid = 2 per SM)
  auto* fb = reinterpret_cast<__nv_bfloat16*>(dwf);
  auto* ub = reinterpret_cast<__nv_bfloat16*>(dwu);
  auto* db = reinterpret_cast<__nv_bfloat16*>(dwdt);
  if (gated)
    sflrows::dense_rows_bwd_dw_kernel<true><<<nblocks, 256, 0, stream>>>(xb, dyb, wfb, wub, wdb, K, N, rows, count,
                                                                        start, l1c, fb, ub, db);
  else
    sflrows::dense_rows_bwd_dw_kernel<false><<<nblocks, 256, 0, stream>>>(xb, dyb, wfb, wub, wdb, K, N, rows, count,
                                                                         start, l1c, fb, ub, db);
  return cudaGetLastError();
}

}  // extern "C"
