// cuBLASLt gemm with cached handles, per-stream workspaces and per-problem algorithms; linear_forward and
// linear_backward (and the GPT-2 MLP GELU fusions) on top of it. Host code only (compiled by the host
// compiler, so it may use fmt).
#include "cuda/cublaslt.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_ops.h"

namespace ndt::cuda {

namespace detail {
void broadcast_rows(void* out, const void* row, bool bf16, int64_t rows, int64_t cols, cudaStream_t stream);
}

void cublas_failed(cublasStatus_t status, const char* expr, const char* file, int line) {
  check_failed(
      file, line, expr,
      fmt::format("cuBLAS status {} ({})", cublasGetStatusName(status), cublasGetStatusString(status)));
}

namespace {
constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // what NVIDIA recommends for Hopper

struct DeviceState {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;  // cublasGemmEx fallback, created on first need
  std::map<cudaStream_t, void*> workspace;
};

// What the matmul does after the product (cublasLtEpilogue_t values in make_plan).
enum class Epi : int { none = 0, bias, gelu_aux, gelu_aux_bias, dgelu };

// Everything that decides the algorithm: device, types, transposes, m, n, k, leading dims, epilogue, the
// alignments of the actual pointers (capped at 256), then the GELU aux buffer's alignment and leading dim.
using PlanKey = std::tuple<int, int, int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int, int, int, int, int, int64_t>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;  // false: no cuBLASLt algorithm, use cublasGemmEx
};

std::mutex g_mutex;
std::map<int, DeviceState> g_devices;
std::map<PlanKey, Plan> g_plans;
// Problems whose sizes change from call to call (the MoE experts' rows) share one algorithm per class:
// m, n and k rounded up to powers of two. The heuristic query costs far more than a small matmul, so it
// runs once per class instead of once per size; the class plan's layouts take each call's sizes.
std::map<PlanKey, Plan> g_class_plans;
int64_t g_fallbacks = 0;
int64_t g_gelu_fused = 0;

int current_device() {
  int dev = 0;
  NDT_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

DeviceState& device_state(int dev) {
  DeviceState& s = g_devices[dev];
  if (!s.lt) NDT_CUBLAS_CHECK(cublasLtCreate(&s.lt));
  return s;
}

void* workspace(DeviceState& s, cudaStream_t stream) {
  auto it = s.workspace.find(stream);
  if (it != s.workspace.end()) return it->second;
  void* p = nullptr;
  NDT_CUDA_CHECK(cudaMalloc(&p, kWorkspaceBytes));
  s.workspace.emplace(stream, p);
  return p;
}

int alignment(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && (addr % (2 * a)) == 0) a *= 2;
  return a;
}

cudaDataType_t cuda_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// Column-major problem handed to cuBLAS: D(m, n) = op(A)(m, k) op(B)(k, n).
struct ColMajor {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  const void *A, *B;
};

cublasLtEpilogue_t lt_epilogue(Epi e) {
  switch (e) {
    case Epi::none:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case Epi::bias:
      return CUBLASLT_EPILOGUE_BIAS;
    case Epi::gelu_aux:
      return CUBLASLT_EPILOGUE_GELU_AUX;
    case Epi::gelu_aux_bias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epi::dgelu:
      return CUBLASLT_EPILOGUE_DGELU;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// The GELU aux pointer and its leading dim are set before the heuristic query, which reads the pointer's
// alignment. The aux type is left at its default, the output type (bf16 aux for a bf16 output).
Plan make_plan(cublasLtHandle_t lt, DType ab, DType c, const ColMajor& p, Epi epi, int align_a, int align_b,
               int align_c, void* aux = nullptr, int64_t ldaux = 0) {
  Plan plan;
  NDT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opa = p.ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = p.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  if (epi != Epi::none) {
    const cublasLtEpilogue_t e = lt_epilogue(epi);
    NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
  }
  if (epi == Epi::bias || epi == Epi::gelu_aux_bias) {
    const cudaDataType_t bt = cuda_type(c);
    NDT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  if (aux) {
    NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                    &aux, sizeof(aux)));
    NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldaux,
                                                    sizeof(ldaux)));
  }
  const auto rows = [](bool t, int64_t r, int64_t cl) { return static_cast<uint64_t>(t ? cl : r); };
  NDT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan.a, cuda_type(ab), rows(p.ta, p.m, p.k), rows(p.ta, p.k, p.m), p.lda));
  NDT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan.b, cuda_type(ab), rows(p.tb, p.k, p.n), rows(p.tb, p.n, p.k), p.ldb));
  NDT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, cuda_type(c), static_cast<uint64_t>(p.m),
                                              static_cast<uint64_t>(p.n), p.ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  NDT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  const uint32_t aa = align_a, ab_ = align_b, ac = align_c;
  NDT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  NDT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa,
                                                        sizeof(aa)));
  NDT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                        &ab_, sizeof(ab_)));
  NDT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac,
                                                        sizeof(ac)));
  NDT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac,
                                                        sizeof(ac)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    plan.algo = result.algo;
    plan.ok = true;
  } else if (st != CUBLAS_STATUS_NOT_SUPPORTED && !(aux && st == CUBLAS_STATUS_INVALID_VALUE)) {
    NDT_CUBLAS_CHECK(st);  // (a GELU epilogue this cuBLASLt refuses is no error: it runs unfused)
  }
  return plan;
}

int64_t pow2_ceil(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// A class plan's layouts set to this problem's sizes (same types, transposes and leading dimensions).
void set_sizes(Plan& plan, const ColMajor& p) {
  auto set = [](cublasLtMatrixLayout_t l, uint64_t rows, uint64_t cols) {
    NDT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof(rows)));
    NDT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols)));
  };
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  set(plan.a, u(p.ta ? p.k : p.m), u(p.ta ? p.m : p.k));
  set(plan.b, u(p.tb ? p.n : p.k), u(p.tb ? p.k : p.n));
  set(plan.c, u(p.m), u(p.n));
}

void fallback_gemm(DeviceState& s, DType ab, DType c, const ColMajor& p, float alpha, float beta, void* C,
                   cudaStream_t stream) {
  if (!s.blas) NDT_CUBLAS_CHECK(cublasCreate(&s.blas));  // default math mode: no TF32
  NDT_CUBLAS_CHECK(cublasSetStream(s.blas, stream));
  NDT_CUBLAS_CHECK(cublasGemmEx(s.blas, p.ta ? CUBLAS_OP_T : CUBLAS_OP_N, p.tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), &alpha,
                                p.A, cuda_type(ab), static_cast<int>(p.lda), p.B, cuda_type(ab),
                                static_cast<int>(p.ldb), &beta, C, cuda_type(c), static_cast<int>(p.ldc),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  ++g_fallbacks;
}

// C = c_in + C (C holding the product), where cuBLASLt cannot read c_in itself.
void add_c_in(DType c, void* C, const void* c_in, int64_t M, int64_t N, int64_t ldc, float beta,
              cudaStream_t stream) {
  NDT_CHECK(ldc == N && beta == 1.0f, "gemm: c_in off cuBLASLt needs ldc == N (got {}, N = {}) and beta = 1",
            ldc, N);
  if (c == DType::bf16)
    residual_forward<__nv_bfloat16>(static_cast<__nv_bfloat16*>(C), static_cast<const __nv_bfloat16*>(c_in),
                                    static_cast<const __nv_bfloat16*>(C), M * N, stream);
  else
    residual_forward<float>(static_cast<float*>(C), static_cast<const float*>(c_in),
                            static_cast<const float*>(C), M * N, stream);
}

PlanKey plan_key(int dev, DType ab, DType c, const ColMajor& p, Epi epi, int aa, int ab_, int ac,
                 int aaux = 0, int64_t ldaux = 0) {
  return PlanKey{dev,
                 static_cast<int>(ab),
                 static_cast<int>(c),
                 p.ta,
                 p.tb,
                 p.m,
                 p.n,
                 p.k,
                 p.lda,
                 p.ldb,
                 p.ldc,
                 static_cast<int>(epi),
                 aa,
                 ab_,
                 ac,
                 aaux,
                 ldaux};
}

// The plan to run a problem on, with g_mutex held: its exact plan, made on first use; but before that
// exists, its size class's plan set to this problem's sizes when `run` succeeds on it (then nullptr: done).
template <typename Run, typename Make>
Plan* find_plan(const PlanKey& key, const ColMajor& p, Run&& run, Make&& make) {
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return &it->second;
  PlanKey ck = key;
  std::get<5>(ck) = pow2_ceil(p.m);
  std::get<6>(ck) = pow2_ceil(p.n);
  std::get<7>(ck) = pow2_ceil(p.k);
  auto cit = g_class_plans.find(ck);
  if (cit != g_class_plans.end() && cit->second.ok) {
    set_sizes(cit->second, p);
    if (run(cit->second) == CUBLAS_STATUS_SUCCESS) return nullptr;
    // This size needs an algorithm of its own: plan it exactly below.
  }
  it = g_plans.emplace(key, make()).first;
  if (cit == g_class_plans.end()) g_class_plans.emplace(ck, make());
  return &it->second;
}
}  // namespace

void gemm(DType ab, DType c, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc,
          const void* bias, cudaStream_t stream, const void* c_in) {
  if (M <= 0 || N <= 0) return;
  NDT_CHECK(K > 0, "gemm: K = {} (callers handle empty inner dims)", K);
  NDT_CHECK(!(ab == DType::f32 && c == DType::bf16),
            "gemm: fp32 inputs with a bf16 output are not supported");
  // Row-major C(M, N) is column-major C^T(N, M) = op(B)^T op(A)^T: swap the operands.
  const ColMajor p{trans_b, trans_a, N, M, K, ldb, lda, ldc, B, A};
  // A bias epilogue needs an aligned bias vector; otherwise pre-fill C with the bias and accumulate.
  const bool epilogue_bias = bias && (reinterpret_cast<uintptr_t>(bias) % 16) == 0;
  if (c_in == C || beta == 0.0f) c_in = nullptr;
  // An unaligned bias (and the fallback's) is pre-filled into C, which would drop what C holds.
  NDT_CHECK(!(bias && beta != 0.0f && !c_in),
            "gemm: a bias with beta = {} accumulating into C in place is not supported (pass the addend as c_in)",
            beta);
  if (c_in && bias && !epilogue_bias) {  // the product with the bias pre-filled, then c_in by its own kernel
    gemm(ab, c, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, 0.0f, C, ldc, bias, stream);
    add_c_in(c, C, c_in, M, N, ldc, beta, stream);
    return;
  }
  if (bias && !epilogue_bias) {
    detail::broadcast_rows(C, bias, c == DType::bf16, M, N, stream);
    beta = 1.0f;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  const int dev = current_device();
  DeviceState& s = device_state(dev);
  const int aa = alignment(p.A), ab_ = alignment(p.B),
            ac = c_in ? std::min(alignment(C), alignment(c_in)) : alignment(C);
  const Epi epi = epilogue_bias ? Epi::bias : Epi::none;
  const PlanKey key = plan_key(dev, ab, c, p, epi, aa, ab_, ac);
  const void* C_read = c_in ? c_in : C;
  const auto run = [&](Plan& pl) {
    if (epilogue_bias)
      NDT_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    return cublasLtMatmul(s.lt, pl.desc, &alpha, p.A, pl.a, p.B, pl.b, &beta, C_read, pl.c, C, pl.c, &pl.algo,
                          workspace(s, stream), kWorkspaceBytes, stream);
  };
  Plan* plan = find_plan(key, p, run, [&] { return make_plan(s.lt, ab, c, p, epi, aa, ab_, ac); });
  if (!plan) return;  // ran on its size class's plan
  if (!plan->ok) {
    if (epilogue_bias) {
      detail::broadcast_rows(C, bias, c == DType::bf16, M, N, stream);
      fallback_gemm(s, ab, c, p, alpha, 1.0f, C, stream);
    } else {
      fallback_gemm(s, ab, c, p, alpha, c_in ? 0.0f : beta, C, stream);
    }
    // cublasGemmEx reads and writes one C: c_in is added after the product.
    if (c_in) add_c_in(c, C, c_in, M, N, ldc, beta, stream);
    return;
  }
  NDT_CUBLAS_CHECK(run(*plan));
}

bool gemm_gelu(GeluEpilogue kind, DType t, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               const void* A, int64_t lda, const void* B, int64_t ldb, void* C, int64_t ldc, const void* bias,
               void* aux, int64_t ldaux, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0) return false;
  NDT_CHECK(kind == GeluEpilogue::forward || !bias, "gemm_gelu: the backward epilogue takes no bias");
  // cuBLASLt's limit on the GELU aux matrix (ld a multiple of 8); 16-byte aligned epilogue operands.
  const auto aligned16 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) % 16) == 0; };
  if (ldaux % 8 != 0 || ldaux < N || !aligned16(aux) || (bias && !aligned16(bias))) return false;
  const ColMajor p{trans_b, trans_a, N, M, K, ldb, lda, ldc, B, A};
  const Epi epi = kind == GeluEpilogue::backward ? Epi::dgelu : bias ? Epi::gelu_aux_bias : Epi::gelu_aux;
  std::lock_guard<std::mutex> lock(g_mutex);
  const int dev = current_device();
  DeviceState& s = device_state(dev);
  const int aa = alignment(p.A), ab_ = alignment(p.B), ac = alignment(C);
  const PlanKey key = plan_key(dev, t, t, p, epi, aa, ab_, ac, alignment(aux), ldaux);
  const float alpha = 1.0f, beta = 0.0f;
  const auto run = [&](Plan& pl) {
    NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                                    sizeof(aux)));
    if (bias)
      NDT_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    return cublasLtMatmul(s.lt, pl.desc, &alpha, p.A, pl.a, p.B, pl.b, &beta, C, pl.c, C, pl.c, &pl.algo,
                          workspace(s, stream), kWorkspaceBytes, stream);
  };
  // Size classes as in gemm: decode and prefill steps change the row count from call to call.
  Plan* plan = find_plan(key, p, run, [&] { return make_plan(s.lt, t, t, p, epi, aa, ab_, ac, aux, ldaux); });
  if (plan) {
    if (!plan->ok) return false;
    const cublasStatus_t st = run(*plan);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // offered by the heuristic yet refused: never try it again
      plan->ok = false;
      return false;
    }
    NDT_CUBLAS_CHECK(st);
  }
  ++g_gelu_fused;
  return true;
}

cublasLtHandle_t cublaslt_handle() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return device_state(current_device()).lt;
}

int64_t gemm_fallback_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_fallbacks;
}

int64_t gemm_gelu_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_gelu_fused;
}

// ---- linear ----
namespace {
template <typename E>
constexpr DType dtype_of() {
  return std::is_same_v<E, float> ? DType::f32 : DType::bf16;
}
}  // namespace

template <typename E>
void linear_forward(E* out, const E* inp, const E* weight, const E* bias, int64_t T, int64_t IC, int64_t OC,
                    cudaStream_t stream, bool accumulate, const E* residual) {
  if (T <= 0 || OC <= 0) return;
  NDT_CHECK(!accumulate || IC > 0, "linear_forward: accumulating an empty product");
  NDT_CHECK(!(accumulate && residual), "linear_forward: accumulate and a residual are exclusive");
  constexpr DType dt = dtype_of<E>();
  if (IC == 0) {  // out = bias (or 0), as on CPU
    if (bias)
      detail::broadcast_rows(out, bias, dt == DType::bf16, T, OC, stream);
    else
      NDT_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(E) * T * OC, stream));
    if (residual) residual_forward<E>(out, residual, out, T * OC, stream);
    return;
  }
  // out(T, OC) = [residual +] inp(T, IC) @ weight(OC, IC)^T + bias
  gemm(dt, dt, false, true, T, OC, IC, 1.0f, inp, IC, weight, IC, accumulate || residual ? 1.0f : 0.0f, out,
       OC, bias, stream, residual);
}

template <typename E>
void linear_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                     int64_t T, int64_t IC, int64_t OC, cudaStream_t stream, bool accumulate_dinp) {
  if (T <= 0 || OC <= 0) return;
  constexpr DType dt = dtype_of<E>();
  if (IC > 0) {
    // dinp(T, IC) (+)= dout(T, OC) @ weight(OC, IC)
    if (dinp)
      gemm(dt, dt, false, false, T, IC, OC, 1.0f, dout, OC, weight, IC, accumulate_dinp ? 1.0f : 0.0f, dinp,
           IC, nullptr, stream);
    // dweight(OC, IC) += dout(T, OC)^T @ inp(T, IC), fp32 output
    if (dweight)
      gemm(dt, DType::f32, true, false, OC, IC, T, 1.0f, dout, OC, inp, IC, 1.0f, dweight, IC, nullptr,
           stream);
  }
  if (dbias) bias_backward<E>(dbias, dout, T, OC, stream);
}

bool linear_gelu_forward(__nv_bfloat16* act, __nv_bfloat16* pre, const __nv_bfloat16* inp,
                         const __nv_bfloat16* weight, const __nv_bfloat16* bias, int64_t T, int64_t IC,
                         int64_t OC, cudaStream_t stream) {
  if (T <= 0 || IC <= 0 || OC <= 0) return false;
  // act(T, OC) = gelu(inp @ weight^T + bias), pre = the GELU input (aux, same layout as act)
  return gemm_gelu(GeluEpilogue::forward, DType::bf16, false, true, T, OC, IC, inp, IC, weight, IC, act, OC,
                   bias, pre, OC, stream);
}

bool linear_dgelu_backward(__nv_bfloat16* dpre, const __nv_bfloat16* dout, const __nv_bfloat16* weight,
                           const __nv_bfloat16* pre, int64_t T, int64_t IC, int64_t OC, cudaStream_t stream) {
  if (T <= 0 || IC <= 0 || OC <= 0) return false;
  // dpre(T, IC) = gelu'(pre) * (dout(T, OC) @ weight(OC, IC)); cuBLASLt only reads the aux input here.
  return gemm_gelu(GeluEpilogue::backward, DType::bf16, false, false, T, IC, OC, dout, OC, weight, IC, dpre,
                   IC, nullptr, const_cast<__nv_bfloat16*>(pre), IC, stream);
}

#define NDT_INSTANTIATE(E)                                                                                   \
  template void linear_forward<E>(E*, const E*, const E*, const E*, int64_t, int64_t, int64_t, cudaStream_t, \
                                  bool, const E*);                                                           \
  template void linear_backward<E>(E*, float*, float*, const E*, const E*, const E*, int64_t, int64_t,       \
                                   int64_t, cudaStream_t, bool);
NDT_INSTANTIATE(float)
NDT_INSTANTIATE(__nv_bfloat16)
#undef NDT_INSTANTIATE

}  // namespace ndt::cuda
