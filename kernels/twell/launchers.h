// The extern "C" launchers of twell_kernels.cu and d2t_gemm.cu (plain CUDA, no torch headers), shared by the
// kernel wrappers (binding.cpp) and the runtime (runtime.cpp). Each returns cudaErrorInvalidValue for a shape or
// setting it cannot serve, else the launch's error.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
cudaError_t twell_compact_launch(const void* g, long long ldg, int rows, int N, int S, int32_t* packed,
                                 int32_t* counts, int32_t* flag, cudaStream_t stream);
cudaError_t twell_gated_up_launch(const void* x, const void* wu, int rows, int K, int N, int S, int tiles_per_warp,
                                  const int32_t* packed, const int32_t* counts, const int32_t* flag, float* hval,
                                  cudaStream_t stream);
cudaError_t twell_down_launch(const void* wdt, int rows, int K, int N, int S, int nb, int tiles_per_warp,
                              int nan_fill, const int32_t* packed, const int32_t* counts, const int32_t* flag,
                              const float* hval, void* y, float* yacc, cudaStream_t stream);
cudaError_t twell_up_down_launch(const void* x, const void* wu, const void* wdt, int rows, int K, int N, int S,
                                 int nan_fill, const int32_t* packed, const int32_t* counts, const int32_t* flag,
                                 void* y, cudaStream_t stream);
cudaError_t twell_up_list_launch(const void* x, const void* wu, int rows, int K, int N, int S, const int32_t* packed,
                                 const int32_t* counts, const int32_t* flag, int32_t* lcol, float* lh, int32_t* lnnz,
                                 cudaStream_t stream);
cudaError_t twell_finalize_launch(const float* yacc, const int32_t* flag, int rows, int K, int nan_fill, void* y,
                                  cudaStream_t stream);
cudaError_t twell_row_stats_launch(const int32_t* counts, const int32_t* flag, const int32_t* extra, int rows, int N,
                                   unsigned long long* out, unsigned long long* acc, cudaStream_t stream);
// flag_from: the first column whose tiles may flag a row (a multiple of 256; 0: every tile)
cudaError_t twell_relu_mul_stats_launch(const void* g, long long ldg, const void* u, long long ldu, void* out,
                                        long long ldo, int rows, int N, int S, int row_cap, int flag_from,
                                        int32_t* rownnz, unsigned long long* stats, float* l1_row,
                                        unsigned long long* acc, cudaStream_t stream);
int twell_d2t_gemm_supported(int device);
cudaError_t twell_d2t_gemm_launch(const void* x, const void* w, int M, int N, int K, int S, int32_t* packed,
                                  int32_t* counts, int32_t* flag, int overlap, int max_ctas, cudaStream_t stream);
cudaError_t twell_decode_fused_launch(const void* x, const void* wg, const void* wu, const void* wdt, int rows,
                                      int K, int N, float* yacc, int32_t* nnz, int32_t* flag, cudaStream_t stream);
cudaError_t twell_decode_rows_launch(const void* g, long long ldg, const void* x, const void* wu, const void* wdt,
                                     int rows, int K, int N, int slices, void* y, unsigned long long* out,
                                     unsigned long long* acc, cudaStream_t stream);
cudaError_t twell_decode_finish_launch(float* yacc, int32_t* nnz, int32_t* flag, int rows, int K, void* y,
                                       unsigned long long* out, unsigned long long* acc, cudaStream_t stream);
}
