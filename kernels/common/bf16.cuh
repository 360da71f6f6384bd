// Device helpers shared by the TwELL (inference) and training kernels: bf16 pairs packed in 32-bit words,
// 8-wide fp32 dot/axpy over 16-byte chunks, warp reductions, and the ReLU activity test on raw bf16 bits.
// Plain CUDA (no torch headers), included by kernels/*/..._kernels.cu; the loader hashes this file too.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace sfl {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float bf16lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf2f(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  acc = fmaf(bf16lo(a.x), bf16lo(b.x), acc); acc = fmaf(bf16hi(a.x), bf16hi(b.x), acc);
  acc = fmaf(bf16lo(a.y), bf16lo(b.y), acc); acc = fmaf(bf16hi(a.y), bf16hi(b.y), acc);
  acc = fmaf(bf16lo(a.z), bf16lo(b.z), acc); acc = fmaf(bf16hi(a.z), bf16hi(b.z), acc);
  acc = fmaf(bf16lo(a.w), bf16lo(b.w), acc); acc = fmaf(bf16hi(a.w), bf16hi(b.w), acc);
  return acc;
}

__device__ __forceinline__ void axpy8(float h, const uint4& w, float* acc) {
  acc[0] = fmaf(h, bf16lo(w.x), acc[0]); acc[1] = fmaf(h, bf16hi(w.x), acc[1]);
  acc[2] = fmaf(h, bf16lo(w.y), acc[2]); acc[3] = fmaf(h, bf16hi(w.y), acc[3]);
  acc[4] = fmaf(h, bf16lo(w.z), acc[4]); acc[5] = fmaf(h, bf16hi(w.z), acc[5]);
  acc[6] = fmaf(h, bf16lo(w.w), acc[6]); acc[7] = fmaf(h, bf16hi(w.w), acc[7]);
}

__device__ __forceinline__ uint32_t pack2(float a, float b) {
  __nv_bfloat16 lo = __float2bfloat16_rn(a), hi = __float2bfloat16_rn(b);
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}

__device__ __forceinline__ uint4 pack8(const float* a) {
  return make_uint4(pack2(a[0], a[1]), pack2(a[2], a[3]), pack2(a[4], a[5]), pack2(a[6], a[7]));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Inclusive prefix sum over the 32 lanes (all lanes must call it).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(kFull, v, o);
    if ((int)(threadIdx.x & 31) >= o) v += t;
  }
  return v;
}

// ReLU activity of one bf16 value given as its 16 bits: relu keeps positive values (+Inf and positive
// subnormals included), and relu(NaN) = NaN counts as active too (as `h != 0` does in torch).
__device__ __forceinline__ bool relu_active(uint32_t b) {
  const uint32_t mag = b & 0x7fffu;
  return (!(b & 0x8000u) && mag != 0) || mag > 0x7f80u;
}
__device__ __forceinline__ bool bf16_nonfinite(uint32_t b) { return (b & 0x7fffu) >= 0x7f80u; }

// Bitmask of the relu-active values among the 8 bf16 of a 16-byte chunk; nonfinite |= any Inf/NaN among them.
__device__ __forceinline__ unsigned relu_mask8(const uint4& v, bool& nonfinite) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  unsigned act = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t b = (w[i >> 1] >> (16 * (i & 1))) & 0xffffu;
    act |= (unsigned)relu_active(b) << i;
    nonfinite |= bf16_nonfinite(b);
  }
  return act;
}

// The i-th (0..7) bf16 of a 16-byte chunk, as its 16 bits.
__device__ __forceinline__ uint32_t bf16_at(const uint4& v, int i) {
  const uint32_t w = (i >> 1) == 0 ? v.x : (i >> 1) == 1 ? v.y : (i >> 1) == 2 ? v.z : v.w;
  return (w >> (16 * (i & 1))) & 0xffffu;
}

// A K-row of bf16 into registers as NI 16-byte chunks per lane (chunk i at lane + 32 i; zero past K).
template <int NI>
__device__ __forceinline__ void load_row(uint4 (&v)[NI], const __nv_bfloat16* __restrict__ row, int K) {
  const int lane = threadIdx.x & 31;
  const uint4* r = reinterpret_cast<const uint4*>(row);
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int c = lane + 32 * i;
    v[i] = c < (K >> 3) ? __ldg(r + c) : make_uint4(0, 0, 0, 0);
  }
}

// The inverse: NI x 8 fp32 accumulators per lane -> a bf16 K-row (chunks past K are not written).
template <int NI>
__device__ __forceinline__ void store_row(__nv_bfloat16* __restrict__ row, const float* acc, int K) {
  const int lane = threadIdx.x & 31;
  uint4* r = reinterpret_cast<uint4*>(row);
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int c = lane + 32 * i;
    if (c < (K >> 3)) r[c] = pack8(acc + 8 * i);
  }
}

// One dot product over the warp: v (a K-vector as NI 16-byte chunks per lane, as load_row leaves it) . w_row,
// summed over the 32 lanes (every lane gets it). All 32 lanes call it.
template <int NI>
__device__ __forceinline__ float row_dot(const uint4 (&v)[NI], const __nv_bfloat16* __restrict__ w_row, int K) {
  const int lane = threadIdx.x & 31;
  const uint4* r = reinterpret_cast<const uint4*>(w_row);
  float d = 0.f;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int c = lane + 32 * i;
    if (c < (K >> 3)) d = dot8(v[i], __ldg(r + c), d);
  }
  return warp_sum(d);
}

// The same with v in shared memory (16-byte chunk c at v[c], read by lane c % 32): one copy for a block's warps
// instead of NI registers per lane each. W's chunks are loaded G at a time (all NI before the first product by
// default; fewer registers with a smaller G); the same summation order, so the same bits, for every G.
template <int NI, int G = NI>
__device__ __forceinline__ float row_dot_shared(const uint4* v, const __nv_bfloat16* __restrict__ w_row, int K) {
  static_assert(NI % G == 0, "G must divide NI");
  const int lane = threadIdx.x & 31;
  const uint4* r = reinterpret_cast<const uint4*>(w_row);
  float d = 0.f;
#pragma unroll
  for (int i0 = 0; i0 < NI; i0 += G) {
    uint4 w[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int c = lane + 32 * (i0 + i);
      w[i] = c < (K >> 3) ? __ldg(r + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int c = lane + 32 * (i0 + i);
      if (c < (K >> 3)) d = dot8(v[c], w[i], d);
    }
  }
  return warp_sum(d);
}

// Gathered dot products (the sparse kernels' inner loop): lane e < ne (<= 32) names row `row` of w [*, K]; on
// lane e this returns w[row] . v, with v a K-vector held as NI 16-byte chunks per lane (chunk i at lane + 32 i;
// zero past K). Lanes >= ne get 0. Two rows' loads are in flight per step. All 32 lanes call it.
template <int NI>
__device__ __forceinline__ float gather_dots(const uint4 (&v)[NI], const __nv_bfloat16* __restrict__ w, int row,
                                             int ne, int K) {
  const int lane = threadIdx.x & 31;
  const int K8 = K >> 3;
  float mine = 0.f;
#pragma unroll 1
  for (int j = 0; j < ne; j += 2) {
    const bool two = (j + 1) < ne;
    const int c0 = __shfl_sync(kFull, row, j);
    const int c1 = __shfl_sync(kFull, row, two ? j + 1 : j);
    const uint4* r0 = reinterpret_cast<const uint4*>(w + (long long)c0 * K);
    const uint4* r1 = reinterpret_cast<const uint4*>(w + (long long)c1 * K);
    uint4 a[NI], b[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + 32 * i;
      a[i] = c < K8 ? __ldg(r0 + c) : make_uint4(0, 0, 0, 0);
      b[i] = (c < K8 && two) ? __ldg(r1 + c) : make_uint4(0, 0, 0, 0);
    }
    float d0 = 0.f, d1 = 0.f;
#pragma unroll
    for (int i = 0; i < NI; ++i) { d0 = dot8(v[i], a[i], d0); d1 = dot8(v[i], b[i], d1); }
    d0 = warp_sum(d0);
    d1 = warp_sum(d1);
    if (lane == j) mine = d0;
    if (two && lane == j + 1) mine = d1;
  }
  return mine;
}

// The entry sums of the row kernels (decode_rows, up_down, the training op's fwd_block): acc (8 floats) += hv[e] *
// w[col[e]] at one 16-byte chunk (w_chunk = the chunk's address in row 0; rows are K8 chunks apart), over
// e = first, first + stride, ... < count in ascending order, kU entries' loads in flight.
template <int kU>
__device__ __forceinline__ void gathered_axpy(float* acc, const uint4* w_chunk, const int* col, const float* hv,
                                              int first, int stride, int count, int K8) {
  int e = first;
  for (; e + (kU - 1) * stride < count; e += kU * stride) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = __ldg(w_chunk + (long long)col[e + u * stride] * K8);
#pragma unroll
    for (int u = 0; u < kU; ++u) axpy8(hv[e + u * stride], v[u], acc);
  }
  for (; e < count; e += stride) axpy8(hv[e], __ldg(w_chunk + (long long)col[e] * K8), acc);
}

// A block-per-row kernel's output row: a thread holds CPT chunks (cc0 + THREADS q) of one share `grp` of the
// entries (groups shares, each over K8 threads, when K8 < THREADS; grp -1: idle thread). The shares are summed
// through red ((groups - 1) K8 8 floats of shared memory) and each chunk stored once as bf16. All threads call it.
template <int CPT, int THREADS>
__device__ __forceinline__ void store_shares(float* acc, float* red, uint4* out, int K8, int cc0, int grp,
                                             int groups) {
  if (groups == 1) {
#pragma unroll
    for (int q = 0; q < CPT; ++q) {
      const int cc = cc0 + q * THREADS;
      if (cc < K8) out[cc] = pack8(acc + 8 * q);
    }
    return;
  }
  if (grp > 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) red[((grp - 1) * K8 + cc0) * 8 + i] = acc[i];
  }
  __syncthreads();
  if (grp == 0) {
    for (int o = 1; o < groups; ++o) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += red[((o - 1) * K8 + cc0) * 8 + i];
    }
    out[cc0] = pack8(acc);
  }
}

// compact_item: one (row, tile) of bf16 gate pre-activations (the warp's 16-byte loads, 8 values per lane) ->
// ReLU -> the tile's packed words (ascending columns, first S), its true count, and flag[row] = 1 on overflow
// or a non-finite value. All 32 lanes call it.
__device__ __forceinline__ void compact_item(uint4 v, int lane, int row, int tile, int n_tiles, int S,
                                             int32_t* __restrict__ packed, int32_t* __restrict__ counts,
                                             int32_t* __restrict__ flag) {
  bool nonfinite = false;
  const unsigned act = relu_mask8(v, nonfinite);
  const int c = __popc(act);
  const int inc = warp_inclusive_sum(c);
  const int total = __shfl_sync(kFull, inc, 31);
  int slot = inc - c;
  int32_t* out = packed + ((long long)row * n_tiles + tile) * S;
  if (act) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if ((act >> i) & 1u) {
        if (slot < S) out[slot] = (int32_t)((bf16_at(v, i) << 16) | (uint32_t)(lane * 8 + i));
        ++slot;
      }
    }
  }
  const bool any_nf = __any_sync(kFull, nonfinite);
  if (lane == 0) {
    counts[(long long)row * n_tiles + tile] = total;
    if (total > S || any_nf) flag[row] = 1;  // benign race: every writer stores 1
  }
}

}  // namespace sfl
