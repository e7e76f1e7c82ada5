#pragma once
// cuBLASLt matmuls (fmt-free; usable from .cu files). linear_forward/linear_backward (cuda_ops.h) are
// built on `gemm` below, which the LM head / attention paths may also call directly.
//
// Resources: one cuBLASLt handle per device and one 32 MiB workspace per (device, stream), created on
// first use and kept for the life of the process (concurrent matmuls on different streams never share a
// workspace). The algorithm of each problem (types, transposes, sizes, leading dims, epilogue, pointer
// alignment) comes from cublasLtMatmulAlgoGetHeuristic once and is cached. Calls are serialized by a
// mutex (they only enqueue work), so several host threads may use them.
//
// Alignment: none required. cuBLASLt is told the real alignment of every pointer; when it offers no
// algorithm (odd leading dims with bf16), the call falls back to cublasGemmEx (+ a bias pre-fill), which
// accepts any leading dim. For speed keep K, N and the leading dims multiples of 8 (bf16) / 4 (fp32) and
// pointers 16-byte aligned. fp32 gemms use exact fp32 math (CUBLAS_COMPUTE_32F, no TF32).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace ndt::cuda {

// Throws ndt::Error naming the expression, the cuBLAS status and file:line.
[[noreturn]] void cublas_failed(cublasStatus_t status, const char* expr, const char* file, int line);

enum class DType : int { f32 = 0, bf16 = 1 };

// Row-major: C(M, N) = alpha * op(A) @ op(B) + beta * C (+ bias(N) added to every row when bias is set).
// op(A) is (M, K): A is stored (M, K) with row stride lda, or (K, M) when trans_a. op(B) is (K, N): B is
// stored (K, N) with row stride ldb, or (N, K) when trans_b. A and B have type ab; C and bias have type c
// (supported: f32/f32, bf16/bf16, bf16/f32). Accumulation is fp32.
// c_in (same type and row stride as C): read in place of C, which is then only written,
// C = alpha * op(A) @ op(B) + beta * c_in (+ bias), rounded once: a residual add in the epilogue. Where
// cuBLASLt cannot run it (no algorithm, an unaligned bias) a kernel adds c_in after the product, which
// needs ldc == N and beta = 1. A bias with beta != 0 needs a separate c_in (accumulating in place into C with a
// bias is refused: the bias's pre-fill would drop C).
void gemm(DType ab, DType c, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc,
          const void* bias, cudaStream_t stream = 0, const void* c_in = nullptr);

// GELU epilogues for the GPT-2 MLP, row-major like gemm, alpha = 1, beta = 0 (C is overwritten, never
// read); A, B, C, bias and aux all of type t. cuBLASLt's GELU is the tanh approximation of ops::gelu_*.
//   forward:  pre = op(A) @ op(B) (+ bias(N)), C = gelu(pre), aux = pre (GELU_AUX[_BIAS]);
//   backward: C = gelu'(aux) * (op(A) @ op(B)) (DGELU; no bias gradient: ours is fp32 and accumulates).
// aux(M, N) has row stride ldaux. Returns false, doing nothing, where the fused epilogue does not apply
// (ldaux not a multiple of 8, aux or bias not 16-byte aligned, or no cuBLASLt algorithm): there is no
// cublasGemmEx twin of these epilogues, so the caller runs the unfused ops instead.
enum class GeluEpilogue : int { forward = 0, backward = 1 };
bool gemm_gelu(GeluEpilogue kind, DType t, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               const void* A, int64_t lda, const void* B, int64_t ldb, void* C, int64_t ldc, const void* bias,
               void* aux, int64_t ldaux, cudaStream_t stream = 0);

// The cached cuBLASLt handle of the current device.
cublasLtHandle_t cublaslt_handle();
// Number of gemm calls that took the cublasGemmEx fallback (tests and diagnostics).
int64_t gemm_fallback_count();
// Number of gemm_gelu calls that ran fused (tests and diagnostics).
int64_t gemm_gelu_count();

}  // namespace ndt::cuda

#define NDT_CUBLAS_CHECK(expr)                                                                            \
  do {                                                                                                    \
    cublasStatus_t ndt_st_ = (expr);                                                                      \
    if (ndt_st_ != CUBLAS_STATUS_SUCCESS) ::ndt::cuda::cublas_failed(ndt_st_, #expr, __FILE__, __LINE__); \
  } while (0)
