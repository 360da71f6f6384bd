// Skinny GEMM for decode-size calls (M <= 64 rows): g[M, N] = bf16(x[M, K] . W[N, K]^T) with fp32 accumulation on
// the tensor cores (mma.sync m16n8k16). At these sizes the GEMM is a stream of W (N x K bf16) from HBM, and what
// decides its time is how many bytes of W are in flight: cuBLAS reads the 1.5B gate (23 MB) in ~16 us at M = 1 .. 64
// (1.4 TB/s, L2 flushed; kernel_bench/decode_paths). Here every lane keeps 16-byte loads of W rows in flight and
// feeds them to the tensor cores straight from registers, with no shared-memory round trip for W.
//
// Layout of the work: a block owns 128 neurons (4 warps x 32: four n8 tiles per warp) and one K slice of K / KS;
// the KS slices of a neuron block form a thread-block cluster and add their fp32 partial products through
// distributed shared memory in a fixed order (deterministic), each block then writing 128 / KS columns of g.
// x's slice (MT rows, zero-padded past M) is staged in shared memory once per block; its rows are padded so that
// the 16-byte fragment reads of a warp hit distinct banks.
//
// Register fragments without ldmatrix: a lane (group q = lane / 4, t = lane % 4) loads W[n = 8 * tile + q,
// k0 + 8t .. k0 + 8t + 7] as one uint4 and x[m, same k] likewise. The dot product does not care in which order k is
// summed, so the 32 k of a round are assigned to the mma's logical k as follows: step A takes words .x/.y (physical
// k 8t .. 8t + 3) as logical k {2t, 2t + 1, 2t + 8, 2t + 9}, step B words .z/.w (8t + 4 .. 8t + 7) likewise, the
// same assignment for both operands. The fp32 summation order differs from cuBLAS, so a g within rounding of 0 may
// round to the other side (tests allow exactly that). NaN/Inf propagate as in any GEMM (rows past M and neurons
// past N are zero-padded and never stored).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/bf16.cuh"

namespace skinny {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kBlockN = 32 * kWarps;  // neurons per block: four n8 tiles per warp
constexpr int kRoundK = 32;           // k per round: 4 lanes x 8
constexpr int kPartLd = kBlockN + 8;  // fp32 partial rows, padded: a warp's float2 stores of 16 rows hit 32 banks

// x's shared-memory row stride (bf16 elements): a multiple of 8 whose byte size is 64 mod 128, so that the 8 lanes
// of a quarter-warp (rows q, q + 1 at 4 x 16 bytes each) read 128 distinct bytes
__host__ __device__ constexpr int x_ld(int kc) { return kc % 64 == 0 ? kc + 32 : kc; }

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// one round's W words of this lane: neuron tiles 0..3 (zero past N or past the slice's last round)
__device__ __forceinline__ void load_w(uint4 (&w)[4], const uint4* const (&rows)[4], unsigned valid, int r, int R) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
    w[nt] = (r < R && ((valid >> nt) & 1u)) ? __ldcs(rows[nt] + 4 * r) : make_uint4(0, 0, 0, 0);
}

// MT rows (16, 32 or 64), D rounds of W loads in flight per lane
template <int MT, int D>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(const __nv_bfloat16* __restrict__ x, long long ldx,
                                                               const __nv_bfloat16* __restrict__ w, int M, int N,
                                                               int K, int kc, __nv_bfloat16* __restrict__ g,
                                                               long long ldg) {
  extern __shared__ __align__(16) unsigned char smem[];
  namespace cg = cooperative_groups;
  constexpr int MTILES = MT / 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane >> 2, t = lane & 3;
  const int n_block = blockIdx.x * kBlockN, k_begin = blockIdx.y * kc, R = kc / kRoundK;
  // this lane's W rows (neuron n_block + 32 warp + 8 nt + q), first 16-byte word of the slice
  const uint4* rows[4];
  unsigned valid = 0;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int n = n_block + 32 * warp + 8 * nt + q;
    valid |= (unsigned)(n < N) << nt;
    rows[nt] = reinterpret_cast<const uint4*>(w + (long long)(n < N ? n : 0) * K + k_begin) + t;
  }
  // the first D rounds of W are requested before x is staged (their latency overlaps the staging)
  uint4 wr[D][4];
#pragma unroll
  for (int d = 0; d < D; ++d) load_w(wr[d], rows, valid, d, R);
  const int ld = x_ld(kc);
  auto* xs = reinterpret_cast<__nv_bfloat16*>(smem);
  const int c8 = kc / 8;
  for (int i = threadIdx.x; i < MT * c8; i += kThreads) {
    const int m = i / c8, c = i % c8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m < M) v = __ldg(reinterpret_cast<const uint4*>(x + (long long)m * ldx + k_begin) + c);
    *reinterpret_cast<uint4*>(xs + m * ld + 8 * c) = v;
  }
  __syncthreads();
  float acc[MTILES][4][4];
#pragma unroll
  for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  for (int r0 = 0; r0 < R; r0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int r = r0 + d;
      if (r < R) {
        const int kb = kRoundK * r + 8 * t;
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt) {
          const uint4 lo = *reinterpret_cast<const uint4*>(xs + (16 * mt + q) * ld + kb);
          const uint4 hi = *reinterpret_cast<const uint4*>(xs + (16 * mt + q + 8) * ld + kb);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            mma16816(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, wr[d][nt].x, wr[d][nt].y);
            mma16816(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, wr[d][nt].z, wr[d][nt].w);
          }
        }
      }
      load_w(wr[d], rows, valid, r + D, R);
    }
  }
  // partial sums of this K slice -> shared memory (x is no longer read), then the cluster adds the slices
  __syncthreads();
  float* part = reinterpret_cast<float*>(smem);  // [MT][kPartLd]
#pragma unroll
  for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = 32 * warp + 8 * nt + 2 * t, row = 16 * mt + q;
      *reinterpret_cast<float2*>(part + row * kPartLd + col) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<float2*>(part + (row + 8) * kPartLd + col) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
    }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every slice's partials written
  const int slices = (int)gridDim.y, rank = (int)cluster.block_rank();
  const int cols = kBlockN / slices, c4 = cols / 4;  // this block writes columns [rank * cols, +cols)
  const int rows_out = M < MT ? M : MT;
  for (int i = threadIdx.x; i < rows_out * c4; i += kThreads) {
    const int m = i / c4, col = rank * cols + 4 * (i % c4), n = n_block + col;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int o = 0; o < slices; ++o) {  // slice order: the same sum on every run
      const float4 v = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, o) + m * kPartLd + col);
      s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
    if (n < N) *reinterpret_cast<uint2*>(g + (long long)m * ldg + n) = make_uint2(sfl::pack2(s.x, s.y),
                                                                                   sfl::pack2(s.z, s.w));
  }
  cluster.sync();  // no block leaves while another reads its partials
}

inline int device_int(cudaDeviceAttr a, int fallback) {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, a, dev) != cudaSuccess) return fallback;
  return v;
}

template <int MT, int D>
cudaError_t launch(const __nv_bfloat16* x, long long ldx, const __nv_bfloat16* w, int M, int N, int K, int slices,
                   __nv_bfloat16* g, long long ldg, size_t smem, cudaStream_t stream) {
  static int attr_set = 0;  // per instantiation: the largest dynamic shared memory granted so far
  if ((int)smem > attr_set) {
    const cudaError_t e = cudaFuncSetAttribute(skinny_gemm_kernel<MT, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem);
    if (e != cudaSuccess) return e;
    attr_set = (int)smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)((N + kBlockN - 1) / kBlockN), (unsigned)slices);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;  // a neuron block's K slices: one cluster
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = (unsigned)slices;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, skinny_gemm_kernel<MT, D>, x, ldx, w, M, N, K, K / slices, g, ldg);
}

}  // namespace skinny

extern "C" {

// g[M, N] (row stride ldg) = bf16(x[M, K] (row stride ldx) . w[N, K]^T). Serves 1 <= M <= 64, K % 32 == 0,
// N % 8 == 0, 16-byte aligned rows, on GPUs with thread-block clusters (sm_90); cudaErrorInvalidValue otherwise
// (the caller's cuBLAS call takes those).
cudaError_t twell_skinny_gemm_launch(const void* x, long long ldx, const void* w, int M, int N, int K, void* g,
                                     long long ldg, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  if (M > 64 || K % 32 != 0 || K <= 0 || N % 8 != 0 || ldx % 8 != 0 || ldg % 8 != 0 || ldx < K || ldg < N ||
      (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(g)) % 16 != 0)
    return cudaErrorInvalidValue;
  if (skinny::device_int(cudaDevAttrComputeCapabilityMajor, 0) < 9) return cudaErrorInvalidValue;
  // K slices per neuron block: 8 (352 blocks at N = 5632), fewer where K does not split into whole rounds
  int slices = 8;
  while (slices > 1 && K % (skinny::kRoundK * slices) != 0) slices /= 2;
  const int mt = M <= 16 ? 16 : (M <= 32 ? 32 : 64);
  const int kc = K / slices;
  const size_t xbytes = (size_t)mt * skinny::x_ld(kc) * 2, pbytes = (size_t)mt * skinny::kPartLd * 4;
  const size_t smem = xbytes > pbytes ? xbytes : pbytes;
  if ((long long)smem > skinny::device_int(cudaDevAttrMaxSharedMemoryPerBlockOptin, 49152))
    return cudaErrorInvalidValue;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const auto* wb = reinterpret_cast<const __nv_bfloat16*>(w);
  auto* gb = reinterpret_cast<__nv_bfloat16*>(g);
  if (mt == 16) return skinny::launch<16, 4>(xb, ldx, wb, M, N, K, slices, gb, ldg, smem, stream);
  if (mt == 32) return skinny::launch<32, 4>(xb, ldx, wb, M, N, K, slices, gb, ldg, smem, stream);
  return skinny::launch<64, 2>(xb, ldx, wb, M, N, K, slices, gb, ldg, smem, stream);
}

}  // extern "C"
