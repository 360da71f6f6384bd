// Fused d2t for Hopper (sm_90a): the gate GEMM g = x W^T on the tensor cores (wgmma; both operands brought into
// shared memory by the TMA engine), with an epilogue that rounds g to bf16, applies ReLU and writes TwELL. No dense
// [M, N] g ever reaches device memory.
//
// Tiles are 256 columns wide = exactly one TwELL tile. Persistent and warp-specialised:
// - warpgroup 0, warp 0: one thread issues the TMA loads into a ring of stages guarded by mbarriers;
// - warpgroups 1 and 2 issue m64n256k16 wgmma (128 fp32 accumulators per thread).
// Tiles are walked in groups of 2048 rows, column-tile major inside a group (L2 reuse of x and W).
// Two epilogues (template OV; the host picks by K, kernels/README.md):
// - OV = false, ping-pong (4 stages): a tile is 64 rows and the two consumer warpgroups take the CTA's tiles in
//   turn, so one warpgroup writes TwELL from its registers while the other's wgmma keep the tensor cores busy. A
//   turn barrier lets a warpgroup's mainloop start only once the other has waited for its last stage. A quad of
//   lanes holds a row's tile; each lane loops over its own active entries only, ranking them with the quad's
//   activity masks.
// - OV = true (3 stages): a tile is 128 rows, each consumer warpgroup owns 64 of them; the consumers store the
//   tile as bf16 into shared memory and go straight on to the next tile; warps 1-3 of warpgroup 0 compact it (one
//   warp per row, as the compaction kernel) meanwhile. This hides the epilogue behind the mainloop when K is large
//   enough for the mainloop to cover it.
//
// Output is bit-compatible with kernels/FORMAT.md (ascending columns, true counts, flag on overflow or a
// non-finite gate value; an overflowing tile's words, which FORMAT.md leaves undefined, are not written). The fp32 summation order differs from cuBLAS, so a value within rounding of 0 may be
// classified differently than a cuBLAS-then-compact d2t would (its h is ~0 either way; tests allow exactly that).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"

namespace d2tg {

using namespace sfl;

constexpr int BN = 256, BK = 64, THREADS = 384;
constexpr int B_BYTES = BN * BK * 2;             // 32 KB
// OV (overlapped epilogue): the finished tile goes to shared memory as bf16 for the compaction warps: 128 rows of
// 256 values, rows padded by 4 words so that the consumers' stores (8 rows x 4 words per instruction) hit 32
// different banks.
constexpr int ROW_WORDS = BN / 2 + 4;
constexpr int STAGING_BYTES = 128 * ROW_WORDS * 4;  // 66 KB
constexpr int COMPACT_WARPS = 3;                   // OV: warps 1-3 of the producer warpgroup
constexpr int RB = 4;                              // OV: rows per compaction step (interleaved warp scans)
template <bool OV>
struct Cfg {
  static constexpr int TM = OV ? 128 : 64;             // rows per tile
  static constexpr int A_BYTES = TM * BK * 2;         // x: TM rows x 128 bytes (one 128B swizzle row each)
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = OV ? 3 : 4;
  static constexpr int GM = 2048 / TM;                // row tiles per group of the tile order
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + (OV ? STAGING_BYTES : 0) + 1024;  // + align
};

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

// ReLU activity of the two bf16 of a pair (bit 0: low half, bit 1: high half): positive (sign clear, non-zero;
// +Inf included) or NaN, as sfl::relu_active; nonfinite |= an Inf or NaN among them. Float compares on the halves
// as fp32 (a bf16 is the top half of an fp32): active = !(v <= 0), non-finite = !(|v| < Inf); exact because the
// kernels build without flush-to-zero (a positive subnormal stays active). The SIMD integer compares this replaced
// (__vcmpgts2 and co.) are emulated on sm_90: the d2t ran 2-4% longer with them.
__device__ __forceinline__ unsigned pair_active(uint32_t p, bool& nonfinite) {
  const float lo = bf16lo(p), hi = bf16hi(p);
  nonfinite |= !(fabsf(lo) < __int_as_float(0x7f800000)) || !(fabsf(hi) < __int_as_float(0x7f800000));
  return (unsigned)!(lo <= 0.f) | ((unsigned)!(hi <= 0.f) << 1);
}

// v[j] for a run-time j < 32 without local memory: a tree of selects (31 of them, for the rare active entries)
__device__ __forceinline__ uint32_t pick32(const uint32_t (&v)[32], int j) {
  uint32_t a[16], b[8], c[4], d[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) a[i] = (j & 16) ? v[i + 16] : v[i];
#pragma unroll
  for (int i = 0; i < 8; ++i) b[i] = (j & 8) ? a[i + 8] : a[i];
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] = (j & 4) ? b[i + 4] : b[i];
#pragma unroll
  for (int i = 0; i < 2; ++i) d[i] = (j & 2) ? c[i + 2] : c[i];
  return (j & 1) ? d[1] : d[0];
}

// Epilogue of one row (all 32 lanes call it; quads of lanes share a row): m = this lane's activity bits (bit 2j+b =
// column 8j + 2q + b), vals[j] = this lane's bf16 pair j. Writes the row's tile words in ascending column order
// (none when the tile overflows: its row is flagged), its true count and its flag (overflow or a non-finite value).
// The loop runs over this lane's active entries only, in ascending column order.
__device__ __forceinline__ void write_row(const uint32_t (&vals)[32], uint64_t m, bool bad, int lane, int row, int M,
                                          int tile, int T, int S, int32_t* __restrict__ packed,
                                          int32_t* __restrict__ counts, int32_t* __restrict__ flag) {
  const int q = lane & 3;
  uint64_t quad[4];  // the row's four masks
#pragma unroll
  for (int qq = 0; qq < 4; ++qq) quad[qq] = __shfl_sync(kFull, m, (lane & ~3) | qq);
  if (row >= M) return;
  const int total = __popcll(quad[0]) + __popcll(quad[1]) + __popcll(quad[2]) + __popcll(quad[3]);
  if (total > S) {  // an overflowing tile: its row is flagged and never read from its words (FORMAT.md), so none
    if (q == 0) {   // are written (a heavy row's S entries per tile held the other warpgroup's mainloop up)
      counts[(long long)row * T + tile] = total;
      flag[row] = 1;
    }
    return;
  }
  int32_t* out = packed + ((long long)row * T + tile) * S;
  for (uint64_t left = m; left != 0; left &= left - 1) {
    const int p = __ffsll((long long)left) - 1, j = p >> 1, b = p & 1;
    const uint64_t low = (1ull << (2 * j)) - 1ull;   // columns of octets before j
    int rank = __popcll(quad[0] & low) + __popcll(quad[1] & low) + __popcll(quad[2] & low) + __popcll(quad[3] & low);
#pragma unroll
    for (int qq = 0; qq < 3; ++qq) rank += qq < q ? __popc((unsigned)(quad[qq] >> (2 * j)) & 3u) : 0;
    rank += b & (int)(m >> (2 * j));                 // the low column of my own pair
    const uint32_t bits = (pick32(vals, j) >> (16 * b)) & 0xffffu;
    out[rank] = (int32_t)((bits << 16) | (uint32_t)(8 * j + 2 * q + b));
  }
  if (q == 0) {
    counts[(long long)row * T + tile] = total;
    if (total > S || bad) flag[row] = 1;  // benign race: every writer stores 1
  }
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
    if (act[q] && total <= S) {  // an overflowing tile's words are not written (FORMAT.md: never read)
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

// Tile order: groups of GM row tiles, column-tile major inside a group, so the CTAs running at once touch ~GM row
// tiles of x and a few column tiles of W: both stay in L2 even when W does not fit (4096 x 11008).
template <int GM>
__device__ __forceinline__ void tile_of(int u, int m_tiles, int T, int& mt, int& nt) {
  const int group = u / (GM * T), first = group * GM;
  const int gm = min(GM, m_tiles - first);
  const int local = u - group * GM * T;
  nt = local / gm;
  mt = first + (local - nt * gm);
}

template <bool OV>
__global__ void __launch_bounds__(THREADS, 1)
    d2t_gemm_kernel(const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_w, int M,
                    int N, int K, int S, int32_t* __restrict__ packed, int32_t* __restrict__ counts,
                    int32_t* __restrict__ flag) {
  using C = Cfg<OV>;
  constexpr bool PP = !OV;  // ping-pong tiles
  constexpr int STAGES = C::STAGES, STAGE_BYTES = C::STAGE_BYTES, A_BYTES = C::A_BYTES, TM = C::TM;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[STAGES];
  __shared__ __align__(8) uint64_t empty_bar[STAGES];
  __shared__ __align__(8) uint64_t staged_bar;   // OV: the consumers wrote a tile into `staging`
  __shared__ __align__(8) uint64_t drained_bar;  // OV: the compaction warps are done reading it
  __shared__ __align__(8) uint64_t turn_bar[2];  // PP: warpgroup c may start its next mainloop
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint32_t* staging = reinterpret_cast<uint32_t*>(ring + STAGES * STAGE_BYTES);  // OV

  const int T = N / BN;
  const int m_tiles = (M + TM - 1) / TM;
  const int units = m_tiles * T;
  const int KB = K / BK;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full_bar[s], 1);   // the producer's arrive (+ the stage's TMA bytes)
      mbar_init(&empty_bar[s], PP ? 1 : 2);  // one arrive per consumer warpgroup reading the stage
    }
    mbar_init(&staged_bar, 256);           // every consumer thread
    mbar_init(&drained_bar, COMPACT_WARPS * 32);  // every compaction lane
    mbar_init(&turn_bar[0], 1);
    mbar_init(&turn_bar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer warpgroup: warp 0 issues the TMA loads; OV: warps 1-3 write TwELL from `staging`
    asm volatile("setmaxnreg.dec.sync.aligned.u32 80;");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp == 0) {
      if (lane == 0) {
        int stage = 0;
        unsigned phase = 0;
        for (int u = blockIdx.x; u < units; u += gridDim.x) {
          int mt, nt;
          tile_of<C::GM>(u, m_tiles, T, mt, nt);
          for (int kb = 0; kb < KB; ++kb) {
            mbar_wait(&empty_bar[stage], phase ^ 1u);  // the consumer warpgroups reading this stage are done
            uint8_t* a = ring + stage * STAGE_BYTES;
            mbar_expect_tx(&full_bar[stage], STAGE_BYTES);
            tma_load(a, &tm_x, &full_bar[stage], kb * BK, mt * TM);  // rows past M arrive as zeros
            tma_load(a + A_BYTES, &tm_w, &full_bar[stage], kb * BK, nt * BN);
            if (++stage == STAGES) { stage = 0; phase ^= 1u; }
          }
        }
      }
    } else if (OV) {
      // Compaction of each finished tile (one warp per row, 8 values per lane, RB rows' warp scans interleaved)
      // while the consumers already run the next tile's mainloop.
      unsigned t = 0;
      for (int u = blockIdx.x; u < units; u += gridDim.x, ++t) {
        int mt, nt;
        tile_of<C::GM>(u, m_tiles, T, mt, nt);
        mbar_wait(&staged_bar, t & 1u);
        for (int r = (warp - 1) * RB; r < TM && mt * TM + r < M; r += COMPACT_WARPS * RB) {
          uint4 v[RB];
#pragma unroll
          for (int q = 0; q < RB; ++q) v[q] = *reinterpret_cast<const uint4*>(staging + (r + q) * ROW_WORDS + 4 * lane);
          compact_rows<RB>(v, lane, mt * TM + r, M, nt, T, S, packed, counts, flag);
        }
        // Every lane arrives: an arrive releases only its own thread's reads (one lane after __syncwarp left the
        // other lanes' reads to cumulativity, and racecheck reported them against the consumers' next writes).
        mbar_arrive(&drained_bar);
      }
    }
  } else {  // consumers: warpgroup c owns rows [64 c, 64 c + 64) of each tile (PP: the CTA's tiles t = c mod 2)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 208;");
    const int c = wg - 1;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const bool leader = (threadIdx.x & 127) == 0;
    const int a_off = PP ? 0 : c * (64 * 128);
    float d[128];
    int stage = 0;
    unsigned phase = 0, t = PP ? c : 0;
    for (int u = blockIdx.x + (PP ? c * gridDim.x : 0); u < units; u += (PP ? 2 : 1) * gridDim.x, t += PP ? 2 : 1) {
      int mt, nt;
      tile_of<C::GM>(u, m_tiles, T, mt, nt);
      if (PP) {
        // The CTA's tile t fills ring slots t KB .. t KB + KB - 1. Wait for the other warpgroup to have seen its
        // tile t - 1 loaded: every earlier fill of a slot is then complete, so a parity wait cannot pass early.
        const long long k0 = (long long)t * KB;
        stage = (int)(k0 % STAGES);
        phase = (unsigned)(k0 / STAGES) & 1u;
        if (t > 0) mbar_wait(&turn_bar[c], ((t >> 1) - (c == 0 ? 1u : 0u)) & 1u);
      }
      // k-block 0 is peeled so that the accumulators are provably dead between tiles (write-only first wgmma)
      mbar_wait(&full_bar[stage], phase);
      {
        const uint8_t* a = ring + stage * STAGE_BYTES + a_off;
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
        const uint8_t* a = ring + stage * STAGE_BYTES + a_off;
        const uint8_t* b = ring + stage * STAGE_BYTES + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) wgmma_m64n256k16(d, desc_sw128(a + 32 * kk), desc_sw128(b + 32 * kk));
        wgmma_commit();
        wgmma_wait<1>();  // the previous k-block's wgmma are done: its stage can be refilled
        if (leader) mbar_arrive(&empty_bar[prev]);
        prev = stage;
        if (++stage == STAGES) { stage = 0; phase ^= 1u; }
      }
      if (PP && leader) mbar_arrive(&turn_bar[c ^ 1]);  // every stage of this tile has been loaded
      wgmma_wait<0>();
      fence_acc(d);
      if (leader) mbar_arrive(&empty_bar[prev]);

      // This lane holds rows r0 and r0 + 8 of the tile, columns 8j + 2q + {0, 1} (j < 32, q = lane % 4).
      const int r0 = a_off / 128 + warp * 16 + (lane >> 2);
      if (OV) {
        // to shared memory as bf16 (rounded as the cuBLAS output is); the compaction warps take it from there
        mbar_wait(&drained_bar, (t & 1u) ^ 1u);  // the previous tile has been read out of `staging`
        uint32_t* s0 = staging + r0 * ROW_WORDS + (lane & 3);
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          s0[4 * j] = pack2(d[4 * j], d[4 * j + 1]);
          s0[8 * ROW_WORDS + 4 * j] = pack2(d[4 * j + 2], d[4 * j + 3]);
        }
        mbar_arrive(&staged_bar);  // release: these stores are visible to whoever waits on the barrier
      } else {
        // TwELL straight from the registers: bit 2j + b of m0 / m1 marks column 8j + 2q + b of row r0 / r0 + 8
        // active; an active entry's value is picked from p0 / p1 by a select tree (no shared memory).
        uint32_t p0[32], p1[32];
        uint64_t m0 = 0, m1 = 0;
        bool bad0 = false, bad1 = false;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          p0[j] = pack2(d[4 * j], d[4 * j + 1]);
          p1[j] = pack2(d[4 * j + 2], d[4 * j + 3]);
          m0 |= (uint64_t)pair_active(p0[j], bad0) << (2 * j);
          m1 |= (uint64_t)pair_active(p1[j], bad1) << (2 * j);
        }
        int bads = (bad0 ? 1 : 0) | (bad1 ? 2 : 0);
        bads |= __shfl_xor_sync(kFull, bads, 1);
        bads |= __shfl_xor_sync(kFull, bads, 2);
        const int row0 = mt * TM + r0;
        write_row(p0, m0, bads & 1, lane, row0, M, nt, T, S, packed, counts, flag);
        write_row(p1, m1, bads & 2, lane, row0 + 8, M, nt, T, S, packed, counts, flag);
      }
    }
  }
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
template <bool OV>
static cudaError_t set_smem() {
  return cudaFuncSetAttribute(d2t_gemm_kernel<OV>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg<OV>::SMEM_BYTES);
}

static int g_device_ready[64];  // 1 + SM count once the smem attributes are set on that device

template <bool OV>
static cudaError_t launch(const void* x, const void* w, int M, int N, int K, int S, int32_t* packed, int32_t* counts,
                          int32_t* flag, long long sms, int max_ctas, cudaStream_t stream) {
  using C = Cfg<OV>;
  CUtensorMap tm_x, tm_w;
  if (!encode(&tm_x, x, M, K, C::TM) || !encode(&tm_w, w, N, K, BN)) return cudaErrorNotSupported;
  const long long units = (long long)((M + C::TM - 1) / C::TM) * (N / BN);
  long long grid = units < sms ? units : sms;  // persistent: one CTA per SM at most
  if (max_ctas > 0 && grid > max_ctas) grid = max_ctas;
  d2t_gemm_kernel<OV><<<(unsigned)grid, THREADS, C::SMEM_BYTES, stream>>>(tm_x, tm_w, M, N, K, S, packed, counts,
                                                                        flag);
  return cudaGetLastError();
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
// [M, N/256] int32 (fully written), flag [M] int32 zeroed by the caller. overlap: 1 = the overlapped epilogue
// (compaction warps), 0 = ping-pong tiles whose consumers write TwELL themselves. max_ctas > 0 caps the persistent
// grid.
cudaError_t twell_d2t_gemm_launch(const void* x, const void* w, int M, int N, int K, int S, int32_t* packed,
                                  int32_t* counts, int32_t* flag, int overlap, int max_ctas, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (K <= 0 || K % d2tg::BK != 0 || N <= 0 || N % d2tg::BN != 0 || S < 1 || S > d2tg::BN) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) return cudaErrorInvalidValue;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (d2tg::g_device_ready[dev] == 0) {
    if ((e = d2tg::set_smem<false>()) != cudaSuccess || (e = d2tg::set_smem<true>()) != cudaSuccess) return e;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    d2tg::g_device_ready[dev] = 1 + sms;
  }
  const long long sms = d2tg::g_device_ready[dev] - 1;
  if (overlap) return d2tg::launch<true>(x, w, M, N, K, S, packed, counts, flag, sms, max_ctas, stream);
  return d2tg::launch<false>(x, w, M, N, K, S, packed, counts, flag, sms, max_ctas, stream);
}

}  // extern "C"
