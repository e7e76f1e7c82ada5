// Energy per matmul for each of cuBLASLt's heuristic candidates, under sustained load (issue 17).
//
// On an H200 the 1B Llama's step runs at the board's power cap, so its matmuls run at whatever clock the
// cap allows: the algorithm that is fastest at full clock is not necessarily the one that does the most
// work per joule. For each of the Llama step's matmul shapes (forward, input and weight gradient, as
// ndtrain's linear layers call them: bf16 operands, fp32 accumulation, the weight gradient accumulated
// into fp32), this runs each of the heuristic's first K algorithms back to back for a fixed time and
// reads the board's energy counter (NVML) around it: milliseconds and millijoules per call, the average
// power and SM clock. Then the whole step's matmul mix twice, once with the heuristic's first answers and
// once with the lowest-energy ones, each for the same time, to see whether the choice moves the step.
//
// Usage: ndtrain_gemm_energy [--seconds S] [--candidates K]   (prints a table; nothing is written)
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cublaslt.h"
#include "cuda/cuda_check.h"
#include "cuda/dl_symbol.h"

namespace {

// NVML, loaded at run time (the driver ships it; the toolkit's stub would not run).
struct Nvml {
  using Device = void*;
  int (*init)() = nullptr;
  int (*handle)(unsigned, Device*) = nullptr;
  int (*energy)(Device, unsigned long long*) = nullptr;
  int (*clock)(Device, int, unsigned*) = nullptr;
  Device dev = nullptr;
  bool ok = false;

  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    ok = lib && ndt::cuda::load_symbol(lib, "nvmlInit_v2", init) &&
         ndt::cuda::load_symbol(lib, "nvmlDeviceGetHandleByIndex_v2", handle) &&
         ndt::cuda::load_symbol(lib, "nvmlDeviceGetTotalEnergyConsumption", energy) &&
         ndt::cuda::load_symbol(lib, "nvmlDeviceGetClockInfo", clock) && init() == 0 && handle(0, &dev) == 0;
  }
  unsigned long long millijoules() const {
    unsigned long long e = 0;
    if (ok) energy(dev, &e);
    return e;
  }
  unsigned sm_mhz() const {
    unsigned c = 0;
    if (ok) clock(dev, /*NVML_CLOCK_SM*/ 1, &c);
    return c;
  }
};

// One of the step's products, in cuBLAS's column-major terms: D(m, n) = op(A)(m, k) op(B)(k, n) (+ D).
struct Shape {
  std::string name;
  bool ta, tb;
  int64_t m, n, k;
  bool accumulate_f32;  // the weight gradient: fp32 output, beta = 1
  int calls;            // per step
};

struct Problem {
  Shape s;
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t a{}, b{}, c{};
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
  void *A = nullptr, *B = nullptr, *C = nullptr;
};

constexpr size_t kWorkspace = size_t{32} << 20;

Problem make(cublasLtHandle_t lt, const Shape& s, int candidates) {
  Problem p{s};
  NDT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t oa = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof(oa)));
  NDT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof(ob)));
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  NDT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, u(s.ta ? s.k : s.m), u(s.ta ? s.m : s.k),
                                              s.ta ? s.k : s.m));
  NDT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, u(s.tb ? s.n : s.k), u(s.tb ? s.k : s.n),
                                              s.tb ? s.n : s.k));
  const cudaDataType_t ct = s.accumulate_f32 ? CUDA_R_32F : CUDA_R_16BF;
  NDT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, ct, u(s.m), u(s.n), s.m));
  cublasLtMatmulPreference_t pref{};
  NDT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspace;
  NDT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  p.algos.resize(candidates);
  int found = 0;
  NDT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.c, p.c, pref, candidates,
                                                  p.algos.data(), &found));
  p.algos.resize(found);
  cublasLtMatmulPreferenceDestroy(pref);
  const size_t ab = 2, cb = s.accumulate_f32 ? 4 : 2;
  NDT_CUDA_CHECK(cudaMalloc(&p.A, u(s.m * s.k) * ab));
  NDT_CUDA_CHECK(cudaMalloc(&p.B, u(s.k * s.n) * ab));
  NDT_CUDA_CHECK(cudaMalloc(&p.C, u(s.m * s.n) * cb));
  // Operands of random sign and mantissa, magnitudes in [1/128, 1/64): zeros would draw less power.
  std::vector<uint16_t> host(std::max(s.m * s.k, s.k * s.n));
  uint32_t x = 12345;
  for (auto& h : host) {
    x = x * 1664525u + 1013904223u;
    h = static_cast<uint16_t>(0x3c00 | ((x >> 16) & 0x7f) | ((x >> 8) & 0x8000));
  }
  NDT_CUDA_CHECK(cudaMemcpy(p.A, host.data(), u(s.m * s.k) * ab, cudaMemcpyHostToDevice));
  NDT_CUDA_CHECK(cudaMemcpy(p.B, host.data(), u(s.k * s.n) * ab, cudaMemcpyHostToDevice));
  NDT_CUDA_CHECK(cudaMemset(p.C, 0, u(s.m * s.n) * cb));
  return p;
}

void run(cublasLtHandle_t lt, const Problem& p, int algo, void* ws, cudaStream_t st) {
  const float alpha = 1.0f, beta = p.s.accumulate_f32 ? 1.0f : 0.0f;
  NDT_CUBLAS_CHECK(cublasLtMatmul(lt, p.desc, &alpha, p.A, p.a, p.B, p.b, &beta, p.C, p.c, p.C, p.c,
                                  &p.algos[algo].algo, ws, kWorkspace, st));
}

struct Measure {
  double ms_per_iter, mj_per_iter, watts;
  unsigned mhz;
};

// Runs `iter` (one unit of work) for `seconds`, in batches between host checks; energy and time around it.
template <typename F>
Measure sustained(const Nvml& nvml, double seconds, cudaStream_t st, F&& iter) {
  // A batch of calls between host checks lasts about 50 ms: the GPU idles only for a relaunch per batch.
  const auto w0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) iter();
  NDT_CUDA_CHECK(cudaStreamSynchronize(st));
  const double one = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count() / 3;
  const int batch = std::max(1, static_cast<int>(0.05 / std::max(one, 1e-6)));
  const auto t0 = std::chrono::steady_clock::now();
  const unsigned long long e0 = nvml.millijoules();
  int64_t n = 0;
  unsigned mhz = 0;
  double elapsed = 0;
  while (elapsed < seconds) {
    for (int i = 0; i < batch; ++i, ++n) iter();
    NDT_CUDA_CHECK(cudaStreamSynchronize(st));
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (elapsed > seconds / 2 && mhz == 0) mhz = nvml.sm_mhz();
  }
  const unsigned long long e1 = nvml.millijoules();
  const double mj = static_cast<double>(e1 - e0);
  return {elapsed * 1e3 / n, mj / n, mj / 1e3 / elapsed, mhz};
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 2.0;
  int candidates = 8;
  CLI::App app{"Energy per matmul of cuBLASLt's heuristic candidates under sustained load"};
  app.add_option("--seconds", seconds, "time per candidate (the step mix runs 4x as long)")
      ->check(CLI::PositiveNumber);
  app.add_option("--candidates", candidates, "heuristic answers tried per shape")->check(CLI::Range(1, 64));
  CLI11_PARSE(app, argc, argv);
  try {
    Nvml nvml;
    if (!nvml.ok) std::fprintf(stderr, "NVML not found: energies read as 0\n");
    // configs/llama-1b.yaml on one GPU: 8192 tokens a microbatch, 2 microbatches, 16 layers.
    const int64_t T = 8192, D = 2048, F = 8192, V = 32000, L = 16, M = 2;
    struct Linear {
      const char* name;
      int64_t in, out;
      int calls;
    };
    const Linear linears[] = {{"qkv", D, D + 2 * 512, L * M},
                              {"o", D, D, L * M},
                              {"gate_up", D, 2 * F, L * M},
                              {"down", F, D, L * M},
                              {"head", D, V, M}};
    std::vector<Shape> shapes;
    for (const auto& l : linears) {
      const std::string n = l.name;
      shapes.push_back({n + " fwd", true, false, l.out, T, l.in, false, l.calls});  // y = x W^T
      shapes.push_back({n + " dX", false, false, l.in, T, l.out, false, l.calls});  // dx = dy W
      shapes.push_back({n + " dW", false, true, l.in, l.out, T, true, l.calls});    // dW += dy^T x
    }
    const cublasLtHandle_t lt = ndt::cuda::cublaslt_handle();
    cudaStream_t st{};
    NDT_CUDA_CHECK(cudaStreamCreate(&st));
    void* ws = nullptr;
    NDT_CUDA_CHECK(cudaMalloc(&ws, kWorkspace));
    std::vector<Problem> problems;
    for (const auto& s : shapes) problems.push_back(make(lt, s, candidates));

    std::printf("%-13s %4s %9s %9s %7s %6s %8s\n", "shape", "algo", "ms/call", "mJ/call", "W", "MHz",
                "TFLOP/s");
    std::vector<int> best(problems.size(), 0);
    for (size_t i = 0; i < problems.size(); ++i) {
      const Problem& p = problems[i];
      const double flop = 2.0 * p.s.m * p.s.n * p.s.k;
      double best_mj = 1e30;
      for (int a = 0; a < static_cast<int>(p.algos.size()); ++a) {
        const Measure r = sustained(nvml, seconds, st, [&] { run(lt, p, a, ws, st); });
        std::printf("%-13s %4d %9.4f %9.2f %7.0f %6u %8.0f\n", p.s.name.c_str(), a, r.ms_per_iter,
                    r.mj_per_iter, r.watts, r.mhz, flop / r.ms_per_iter / 1e9);
        std::fflush(stdout);
        if (r.mj_per_iter < best_mj) best_mj = r.mj_per_iter, best[i] = a;
      }
    }
    // The step's mix, each product as often as a step calls it.
    const auto mix = [&](const std::vector<int>& pick) {
      return sustained(nvml, 4 * seconds, st, [&] {
        for (size_t i = 0; i < problems.size(); ++i)
          for (int c = 0; c < problems[i].s.calls; ++c) run(lt, problems[i], pick[i], ws, st);
      });
    };
    const std::vector<int> first(problems.size(), 0);
    for (int round = 0; round < 2; ++round) {
      for (const std::vector<int>* pick : {&first, &std::as_const(best)}) {
        const Measure r = mix(*pick);
        std::printf("step mix, %-17s: %8.2f ms %8.0f mJ %6.0f W %5u MHz\n",
                    pick == &first ? "heuristic's first" : "lowest energy", r.ms_per_iter, r.mj_per_iter,
                    r.watts, r.mhz);
      }
    }
    std::printf("lowest-energy picks:");
    for (size_t i = 0; i < problems.size(); ++i) std::printf(" %s=%d", problems[i].s.name.c_str(), best[i]);
    std::printf("\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ndtrain_gemm_energy: %s\n", e.what());
    return 1;
  }
  return 0;
}
