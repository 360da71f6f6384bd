// The extern "C" launcher of slices.cu (plain CUDA, no torch headers), shared by the training op and the inference
// runtime. Returns cudaErrorInvalidValue for a shape it cannot serve, else the launch's error.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
// out[r] = sum_{e < nnz[r]} c[r, e] B[col[r, e]] (+ d[r, e] B2[col[r, e]] when b2 is not null), ascending e, for every
// row with flag[r] == 0 (flagged rows are not written). B, B2 bf16 [N, K]; col int32, c and d fp32 [M, W]; out bf16
// [M, K]; K % 8 == 0. rows: rows per block, 1, 2 or 4 (0: the default, 4).
cudaError_t sfl_slices_launch(const void* b, const void* b2, int M, int K, int W, const int32_t* col,
                              const int32_t* nnz, const int32_t* flag, const float* c, const float* d, void* out,
                              int rows, cudaStream_t stream);
}
