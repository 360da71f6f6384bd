// The extern "C" launchers of backup_rows.cu (plain CUDA, no torch headers): the dense backup rows of the sparse
// FFN, used by the inference runtime and the training op. Each returns cudaErrorInvalidValue for a shape it cannot
// serve, else the launch's error.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
// dst [n, K] = src rows idx (a zero row where idx < 0); K % 8 == 0, src and dst 16-byte aligned.
cudaError_t sfl_gather_rows_launch(const void* src, const int64_t* idx, int n, int K, void* dst, cudaStream_t stream);
// y[idx[i]] = yb[i] for idx[i] >= 0; with hb (bf16 [n, N]) also rowabs[idx[i]] = sum |hb[i]|, and with `last`
// (int64 [N], needs ab) the tracker of the rows where each neuron is active. hb, ab, rowabs, last may be null.
cudaError_t sfl_scatter_rows_launch(const void* yb, const void* hb, const void* ab, const int64_t* idx, int n, int K,
                                    int N, void* y, float* rowabs, int64_t* last, cudaStream_t stream);
// rows[start .. *count) of x, or with `flag` (int32 [M]; rows and count unused) every row r with flag[r], computed
// densely on CUDA cores into y (and rowabs, last when not null); K <= 4096.
cudaError_t sfl_dense_rows_fwd_launch(int gated, const void* x, const void* wf, const void* wu, const void* wdt,
                                      int M, int K, int N, const int64_t* rows, const int64_t* count, int start,
                                      const int32_t* flag, void* y, float* rowabs, int64_t* last, int grid,
                                      cudaStream_t stream);
// The training backward of rows[start .. *count) on CUDA cores (the rows past the caller's cuBLAS block): dx[row]
// written, their contributions added to the written weight gradients dwf, dwu (gated), dwdt (neuron-major [N, K]);
// l1c: the L1 term's coefficient dL/d|h| (fp32 [1], device); K <= 4096; grid: CTAs per row-loop (dW gets up to 4x).
cudaError_t sfl_dense_rows_bwd_launch(int gated, const void* x, const void* dy, const void* wf, const void* wu,
                                      const void* wdt, int M, int K, int N, const int64_t* rows, const int64_t* count,
                                      int start, const float* l1c, void* dx, void* dwf, void* dwu, void* dwdt,
                                      int grid, cudaStream_t stream);
}
