// Fused d2t for Hopper (sm_90a): the gate GEMM g = x W^T on the tensor cores (wgmma; both operands brought into
// shared memory by the TMA engine), with an epilogue that rounds g to bf16, applies ReLU and writes TwELL. No dense
// [M, N] g ever reaches device memory: each finished tile passes through shared memory only.
//
// Block tile 128 rows x 256 columns = exactly one TwELL tile wide. Warp-specialised and persistent:
// - warpgroup 0, warp 0: one thread issues the TMA loads into a 3-stage ring guarded by mbarriers;
// - warpgroups 1 and 2 each own 64 rows and issue m64n256k16 wgmma; at the end of a tile they store it as bf16 into
//   a staging buffer and go straight on to the next tile;
// - warpgroup 0, warps 1-3: compact the staged tile to TwELL (one warp per row, as the compaction kernel) while the
//   tensor cores already work on the next tile. So the epilogue's cost overlaps the mainloop.
//
// Output is bit-compatible with kernels/FORMAT.md (ascending columns, true counts, flag on overflow or a
// non-finite gate value). The fp32 summation order differs from cuBLAS, so a value within rounding of 0 may be
// classified differently than a cuBLAS-then-compact d2t would (its h is ~0 either way; tests allow exactly that).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"

namespace d2tg {

using namespace sfl;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 3, THREADS = 384;
constexpr int A_BYTES = BM * BK * 2;             // 16 KB: 128 rows x 128 bytes (one 128B swizzle row each)
constexpr int B_BYTES = BN * BK * 2;             // 32 KB
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
// The finished tile, as bf16, for the compaction warps: 128 rows of 256 values, rows padded by 4 words so that the
// consumers' stores (8 rows x 4 words per instruction) hit 32 different banks.
constexpr int ROW_WORDS = BN / 2 + 4;
constexpr int STAGING_BYTES = BM * ROW_WORDS * 4;  // 66 KB
constexpr int COMPACT_WARPS = 3;                   // warps 1-3 of the producer warpgroup
constexpr int RB = 4;                              // rows per compaction step (interleaved warp scans)
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + 1024;  // + slack to align the ring to 1024 bytes

__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}
// Returns once the barrier phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  const uint32_t a = saddr(b);
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(a), "r"(parity) : "memory");
  }
}
// 2-D tile load (coordinates: c0 = column = K offset, c1 = row); rows past the tensor's end arrive as zeros.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(saddr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(saddr(bar)), "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// arrive on the barrier at the same shared-memory offset in CTA `rank` of the cluster (this CTA included)
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* b, unsigned rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(saddr(b)), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
// a consumer warpgroup is done with a stage: tell every CTA of the cluster whose producer wrote part of it
template <int CL>
__device__ __forceinline__ void release(uint64_t* b) {
  if (CL == 1) {
    mbar_arrive(b);
  } else {
#pragma unroll
    for (int r = 0; r < CL; ++r) mbar_arrive_cluster(b, (unsigned)r);
  }
}
// tile load written to the same offset in every CTA of `mask`, completing on each one's barrier at `bar`'s offset
__device__ __forceinline__ void tma_load_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                   uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(saddr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(saddr(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

// Shared-memory matrix descriptor: K-major, 128B swizzle, 8-row groups 1024 bytes apart (SBO); LBO unused.
__device__ __forceinline__ uint64_t desc_sw128(const void* p) {
  return ((uint64_t)((saddr(p) & 0x3FFFF) >> 4)) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// keeps the compiler from moving accumulator reads/writes across a wgmma wait
__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64x256] += A[64x16] * B[256x16]^T, both K-major bf16 in 128B-swizzled shared memory, fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db));
}

// The first k-step of a tile: D = A * B^T (no accumulate). Its outputs are write-only, so the compiler knows the
// accumulators are dead between a tile's epilogue and the next tile's first wgmma (registers are tight).
__device__ __forceinline__ void wgmma_m64n256k16_first(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 0, 1, 1, 0, 0;\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
      "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
      "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
      "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]),
      "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]),
      "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]),
      "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]),
      "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]),
      "=f"(d[64]), "=f"(d[65]), "=f"(d[66]), "=f"(d[67]), "=f"(d[68]), "=f"(d[69]), "=f"(d[70]), "=f"(d[71]),
      "=f"(d[72]), "=f"(d[73]), "=f"(d[74]), "=f"(d[75]), "=f"(d[76]), "=f"(d[77]), "=f"(d[78]), "=f"(d[79]),
      "=f"(d[80]), "=f"(d[81]), "=f"(d[82]), "=f"(d[83]), "=f"(d[84]), "=f"(d[85]), "=f"(d[86]), "=f"(d[87]),
      "=f"(d[88]), "=f"(d[89]), "=f"(d[90]), "=f"(d[91]), "=f"(d[92]), "=f"(d[93]), "=f"(d[94]), "=f"(d[95]),
      "=f"(d[96]), "=f"(d[97]), "=f"(d[98]), "=f"(d[99]), "=f"(d[100]), "=f"(d[101]), "=f"(d[102]), "=f"(d[103]),
      "=f"(d[104]), "=f"(d[105]), "=f"(d[106]), "=f"(d[107]), "=f"(d[108]), "=f"(d[109]), "=f"(d[110]), "=f"(d[111]),
      "=f"(d[112]), "=f"(d[113]), "=f"(d[114]), "=f"(d[115]), "=f"(d[116]), "=f"(d[117]), "=f"(d[118]), "=f"(d[119]),
      "=f"(d[120]), "=f"(d[121]), "=f"(d[122]), "=f"(d[123]), "=f"(d[124]), "=f"(d[125]), "=f"(d[126]), "=f"(d[127])
      : "l"(da), "l"(db));
}

// RB rows of a staged tile -> TwELL (one warp; lane l holds columns 8l..8l+7 of each row). The same result as RB
// calls of sfl::compact_item, with the RB rows' warp scans interleaved: the compaction warps are latency-bound,
// and this is what lets three of them keep up with the tensor cores.
template <int RB>
__device__ __forceinline__ void compact_rows(const uint4 (&v)[RB], int lane, int row0, int M, int tile, int T, int S,
                                             int32_t* __restrict__ packed, int32_t* __restrict__ counts,
                                             int32_t* __restrict__ flag) {
  unsigned act[RB];
  int inc[RB], cnt[RB];
  bool nf[RB];
#pragma unroll
  for (int q = 0; q < RB; ++q) {
    nf[q] = false;
    act[q] = relu_mask8(v[q], nf[q]);
    cnt[q] = __popc(act[q]);
    inc[q] = cnt[q];
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
    for (int q = 0; q < RB; ++q) {
      const int t = __shfl_up_sync(kFull, inc[q], o);
      if (lane >= o) inc[q] += t;
    }
  }
#pragma unroll
  for (int q = 0; q < RB; ++q) {
    const int row = row0 + q;
    const int total = __shfl_sync(kFull, inc[q], 31);
    const bool any_nf = __any_sync(kFull, nf[q]);
    if (row >= M) continue;  // warp-uniform
    int slot = inc[q] - cnt[q];
    int32_t* out = packed + ((long long)row * T + tile) * S;
    if (act[q]) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if ((act[q] >> i) & 1u) {
          if (slot < S) out[slot] = (int32_t)((bf16_at(v[q], i) << 16) | (uint32_t)(lane * 8 + i));
          ++slot;
        }
      }
    }
    if (lane == 0) {
      counts[(long long)row * T + tile] = total;
      if (total > S || any_nf) flag[row] = 1;  // benign race: every writer stores 1
    }
  }
}

// Work unit u -> (group of CL row tiles, column tile). With CL = 2 the two CTAs of a cluster take the two row
// tiles and share the W tile (each loads half and multicasts it to both). Units are grouped GP at a time,
// column-tile major inside a group, so the CTAs running at once touch ~GP CL row tiles of x and a few column tiles
// of W: both stay in L2 even when W does not fit (4096 x 11008).
constexpr int GP = 8;
__device__ __forceinline__ void unit_tiles(int u, int pairs, int T, int& pair, int& nt) {
  const int group = u / (GP * T), first = group * GP;
  const int gp = min(GP, pairs - first);
  const int local = u - group * GP * T;
  nt = local / gp;
  pair = first + (local - nt * gp);
}

template <int CL>
__global__ void __launch_bounds__(THREADS, 1)
    d2t_gemm_kernel(const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_w, int M,
                    int N, int K, int S, int32_t* __restrict__ packed, int32_t* __restrict__ counts,
                    int32_t* __restrict__ flag) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[STAGES];
  __shared__ __align__(8) uint64_t empty_bar[STAGES];
  __shared__ __align__(8) uint64_t staged_bar;   // the consumers wrote a tile into `staging`
  __shared__ __align__(8) uint64_t drained_bar;  // the compaction warps are done reading it
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int T = N / BN;
  const int pairs = ((M + BM - 1) / BM + CL - 1) / CL;
  const int units = pairs * T;
  const int KB = K / BK;
  const int wg = threadIdx.x / 128;
  const unsigned rank = CL > 1 ? cluster_rank() : 0u;  // which row tile of the unit, which part of the W tile
  const int cluster = blockIdx.x / CL, clusters = gridDim.x / CL;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full_bar[s], 1);        // the local producer's arrive (+ 48 KB of TMA bytes: A and all of W)
      mbar_init(&empty_bar[s], 2 * CL);  // one arrive per consumer warpgroup of each CTA (all read my W part)
    }
    mbar_init(&staged_bar, 256);           // every consumer thread
    mbar_init(&drained_bar, COMPACT_WARPS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (CL > 1)
    cluster_sync();  // the peer's barriers exist before anyone multicasts into or arrives on them
  else
    __syncthreads();

  uint32_t* staging = reinterpret_cast<uint32_t*>(ring + STAGES * STAGE_BYTES);
  if (wg == 0) {  // producer warpgroup: warp 0 issues the TMA loads, warps 1-3 write TwELL from `staging`
    asm volatile("setmaxnreg.dec.sync.aligned.u32 72;");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp == 0) {
      if (threadIdx.x == 0) {
        int stage = 0;
        unsigned phase = 0;
        for (int u = cluster; u < units; u += clusters) {
          int pair, nt;
          unit_tiles(u, pairs, T, pair, nt);
          const int mt = CL * pair + (int)rank;  // past the last row tile: TMA fills zeros, nothing is stored
          for (int kb = 0; kb < KB; ++kb) {
            mbar_wait(&empty_bar[stage], phase ^ 1u);  // both CTAs' consumers are done with this stage
            uint8_t* a = ring + stage * STAGE_BYTES;
            mbar_expect_tx(&full_bar[stage], STAGE_BYTES);
            tma_load(a, &tm_x, &full_bar[stage], kb * BK, mt * BM);
            if (CL == 1)
              tma_load(a + A_BYTES, &tm_w, &full_bar[stage], kb * BK, nt * BN);
            else
              tma_load_multicast(a + A_BYTES + rank * (BN / CL) * 128, &tm_w, &full_bar[stage], kb * BK,
                                 nt * BN + (int)rank * (BN / CL), (uint16_t)((1u << CL) - 1u));
            if (++stage == STAGES) { stage = 0; phase ^= 1u; }
          }
        }
      }
    } else {
      // Compaction of each finished tile (one warp per row: 8 values per lane, a warp scan for the ranks; the same
      // code as the cuBLAS path's compaction kernel) while the consumers already run the next tile's mainloop.
      unsigned t = 0;
      for (int u = cluster; u < units; u += clusters, ++t) {
        int pair, nt;
        unit_tiles(u, pairs, T, pair, nt);
        const int mt = CL * pair + (int)rank;
        mbar_wait(&staged_bar, t & 1u);
        // rows in blocks of RB per warp, blocks dealt round-robin (BM / RB = 32 blocks over 3 warps)
        for (int r = (warp - 1) * RB; r < BM && mt * BM + r < M; r += COMPACT_WARPS * RB) {
          uint4 v[RB];
#pragma unroll
          for (int q = 0; q < RB; ++q) v[q] = *reinterpret_cast<const uint4*>(staging + (r + q) * ROW_WORDS + 4 * lane);
          compact_rows<RB>(v, lane, mt * BM + r, M, nt, T, S, packed, counts, flag);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&drained_bar);
      }
    }
  } else {  // consumers: warpgroup c owns rows [64 c, 64 c + 64) of the block tile
    asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
    const int c = wg - 1;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const bool leader = (threadIdx.x & 127) == 0;
    float d[128];
    int stage = 0;
    unsigned phase = 0, t = 0;
    for (int u = cluster; u < units; u += clusters, ++t) {  // the same tiles as the producer, in the same order
      // k-block 0 is peeled so that the accumulators are provably dead between tiles (write-only first wgmma)
      mbar_wait(&full_bar[stage], phase);
      {
        const uint8_t* a = ring + stage * STAGE_BYTES + c * (64 * 128);
        const uint8_t* b = ring + stage * STAGE_BYTES + A_BYTES;
        wgmma_fence();
        wgmma_m64n256k16_first(d, desc_sw128(a), desc_sw128(b));
#pragma unroll
        for (int kk = 1; kk < BK / 16; ++kk) wgmma_m64n256k16(d, desc_sw128(a + 32 * kk), desc_sw128(b + 32 * kk));
        wgmma_commit();
      }
      int prev = stage;
      if (++stage == STAGES) { stage = 0; phase ^= 1u; }
      for (int kb = 1; kb < KB; ++kb) {
        mbar_wait(&full_bar[stage], phase);
        const uint8_t* a = ring + stage * STAGE_BYTES + c * (64 * 128);
        const uint8_t* b = ring + stage * STAGE_BYTES + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) wgmma_m64n256k16(d, desc_sw128(a + 32 * kk), desc_sw128(b + 32 * kk));
        wgmma_commit();
        wgmma_wait<1>();  // the previous k-block's wgmma are done: its stage can be refilled (in both CTAs)
        if (leader) release<CL>(&empty_bar[prev]);
        prev = stage;
        if (++stage == STAGES) { stage = 0; phase ^= 1u; }
      }
      wgmma_wait<0>();
      fence_acc(d);
      if (leader) release<CL>(&empty_bar[prev]);

      // ---- epilogue: the tile goes to shared memory as bf16 (rounded as the cuBLAS output is); the compaction
      // warps turn it into TwELL while this warpgroup starts the next tile. This lane holds rows r0 and r0 + 8,
      // columns 8j + 2q + {0, 1} (j < 32, q = lane % 4).
      mbar_wait(&drained_bar, (t & 1u) ^ 1u);  // the previous tile has been read out of `staging`
      const int r0 = c * 64 + warp * 16 + (lane >> 2);
      uint32_t* s0 = staging + r0 * ROW_WORDS + (lane & 3);
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        s0[4 * j] = pack2(d[4 * j], d[4 * j + 1]);
        s0[8 * ROW_WORDS + 4 * j] = pack2(d[4 * j + 2], d[4 * j + 3]);
      }
      mbar_arrive(&staged_bar);  // release: these stores are visible to whoever waits on the barrier
    }
  }
  if (CL > 1) cluster_sync();  // no CTA leaves while its peer may still multicast into it or arrive on its barriers
}

typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda needed)
static EncodeTiledFn encode_fn() {
  static EncodeTiledFn fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
            cudaSuccess && q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiledFn>(p);
  }
  return fn;
}

// [rows, K] bf16 row-major, boxes of box_rows x 64 columns (128 bytes: one 128B swizzle row)
static bool encode(CUtensorMap* map, const void* base, int rows, int K, int box_rows) {
  EncodeTiledFn fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
  const cuuint32_t box[2] = {(cuuint32_t)BK, (cuuint32_t)box_rows};
  const cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace d2tg

namespace d2tg {
struct DeviceSetup {
  int device = -1;
  int sms = 0;
  int resident[3] = {0, 0, 0};  // co-resident clusters of CL = 1, 2 CTAs
};

template <int CL>
static cudaError_t setup(DeviceSetup& ds) {
  const cudaError_t e = cudaFuncSetAttribute(d2t_gemm_kernel<CL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             SMEM_BYTES);
  if (e != cudaSuccess) return e;
  if (CL == 1) {
    ds.resident[1] = ds.sms;
    return cudaSuccess;
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CL;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(CL * (ds.sms / CL));
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = SMEM_BYTES;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, d2t_gemm_kernel<CL>, &cfg) != cudaSuccess || n <= 0) {
    cudaGetLastError();  // not fatal: assume every SM group can hold a cluster
    n = ds.sms / CL;
  }
  ds.resident[CL] = n;
  return cudaSuccess;
}

static DeviceSetup g_setup[64];

static DeviceSetup* device_setup(cudaError_t& err) {
  int dev = 0;
  err = cudaGetDevice(&dev);
  if (err != cudaSuccess || dev < 0 || dev >= 64) return nullptr;
  DeviceSetup& ds = g_setup[dev];
  if (ds.device != dev) {
    cudaDeviceGetAttribute(&ds.sms, cudaDevAttrMultiProcessorCount, dev);
    if ((err = setup<1>(ds)) != cudaSuccess || (err = setup<2>(ds)) != cudaSuccess) return nullptr;
    ds.device = dev;
  }
  return &ds;
}

template <int CL>
static cudaError_t launch(const CUtensorMap& tm_x, const CUtensorMap& tm_w, int M, int N, int K, int S,
                          int32_t* packed, int32_t* counts, int32_t* flag, int max_ctas, int resident,
                          cudaStream_t stream) {
  // one cluster per unit at most, all co-resident (persistent)
  const long long units = (long long)(((M + BM - 1) / BM + CL - 1) / CL) * (N / BN);
  long long clusters = units < resident ? units : resident;
  if (max_ctas > 0 && clusters > max_ctas / CL) clusters = max_ctas / CL > 0 ? max_ctas / CL : 1;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CL;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3((unsigned)(CL * clusters));
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = SMEM_BYTES;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = CL > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, d2t_gemm_kernel<CL>, tm_x, tm_w, M, N, K, S, packed, counts, flag);
}
}  // namespace d2tg

extern "C" {

// 1 when this device can run the fused d2t (sm_90 and the driver's tensor-map encoder is reachable), else 0.
int twell_d2t_gemm_supported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return 0;
  return (major == 9 && minor == 0 && d2tg::encode_fn() != nullptr) ? 1 : 0;
}

// x [M, K], w [N, K] bf16 row-major, 16-byte aligned; K % 64 == 0, N % 256 == 0. packed [M, N/256, S], counts
// [M, N/256] int32 (fully written), flag [M] int32 zeroed by the caller. cluster: 1 (each CTA loads its own W
// tile) or 2 (CTA pairs share it through TMA multicast). max_ctas > 0 caps the persistent grid (whole clusters).
cudaError_t twell_d2t_gemm_launch(const void* x, const void* w, int M, int N, int K, int S, int32_t* packed,
                                  int32_t* counts, int32_t* flag, int cluster, int max_ctas, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (K <= 0 || K % d2tg::BK != 0 || N <= 0 || N % d2tg::BN != 0 || S < 1 || S > d2tg::BN) return cudaErrorInvalidValue;
  if (cluster != 1 && cluster != 2) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) return cudaErrorInvalidValue;
  CUtensorMap tm_x, tm_w;
  if (!d2tg::encode(&tm_x, x, M, K, d2tg::BM) || !d2tg::encode(&tm_w, w, N, K, d2tg::BN / cluster))
    return cudaErrorNotSupported;
  cudaError_t err = cudaSuccess;
  d2tg::DeviceSetup* ds = d2tg::device_setup(err);
  if (ds == nullptr) return err != cudaSuccess ? err : cudaErrorInvalidDevice;
  return cluster == 1 ? d2tg::launch<1>(tm_x, tm_w, M, N, K, S, packed, counts, flag, max_ctas, ds->resident[1], stream)
                      : d2tg::launch<2>(tm_x, tm_w, M, N, K, S, packed, counts, flag, max_ctas, ds->resident[2], stream);
}

// co-resident clusters of `cluster` CTAs on the current device (after a first launch; for logs), else -1
int twell_d2t_gemm_resident(int cluster) {
  cudaError_t err = cudaSuccess;
  d2tg::DeviceSetup* ds = d2tg::device_setup(err);
  return (ds != nullptr && (cluster == 1 || cluster == 2)) ? ds->resident[cluster] : -1;
}

}  // extern "C"
