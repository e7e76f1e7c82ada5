#include "generate/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/rng.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/cuda_ops.h"
#include "cuda/runtime.h"
#endif

namespace ndt {

double sampling_uniform(uint64_t seed, int64_t step, uint64_t prompt_key, uint64_t sample_key, int64_t i) {
  // One Philox stream per (step, prompt, sample), itself drawn by Philox: key seed ^ (odd * step) (distinct
  // per step for a seed), counter (prompt_key, sample_key); the token index is the stream's counter.
  const std::array<uint32_t, 4> w =
      philox4x32(seed ^ (0x5DEECE66Dull * static_cast<uint64_t>(step)), prompt_key, sample_key);
  const uint64_t stream = static_cast<uint64_t>(w[0]) << 32 | w[1];
  // 53-bit uniform from 64 random bits (philox_uniform has 24: too coarse for large vocabularies).
  return static_cast<double>(philox_u64(seed, stream, static_cast<uint64_t>(i)) >> 11) * 0x1.0p-53;
}

TokenChoice choose_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double top_p,
                         double u) {
  NDT_CHECK(vocab >= 1, "sampling from an empty vocabulary");
  int64_t arg = 0;
  for (int64_t j = 1; j < vocab; ++j)
    if (logits[j] > logits[arg]) arg = j;  // strict: ties keep the smaller id
  const double mx = logits[arg];
  double z = 0;
  for (int64_t j = 0; j < vocab; ++j) z += std::exp(static_cast<double>(logits[j]) - mx);
  const double logz = mx + std::log(z);
  auto choice = [&](int64_t j) {
    return TokenChoice{static_cast<int32_t>(j), static_cast<float>(static_cast<double>(logits[j]) - logz)};
  };
  if (temperature <= 0) return choice(arg);

  const int64_t k = top_k > 0 ? std::min(top_k, vocab) : vocab;
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  if (k < vocab || top_p < 1.0) {  // descending logits, ties to the smaller id
    auto before = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
    ids.resize(static_cast<size_t>(k));
  }
  std::vector<double> w(ids.size());
  double total = 0;
  for (size_t i = 0; i < ids.size(); ++i) total += w[i] = std::exp((logits[ids[i]] - mx) / temperature);
  if (top_p < 1.0) {  // the smallest prefix (most likely first) whose mass reaches top_p
    double acc = 0;
    size_t keep = 0;
    while (keep < w.size() && acc < top_p * total) acc += w[keep++];
    keep = std::max<size_t>(1, keep);
    ids.resize(keep);
    w.resize(keep);
    total = acc;
  }
  const double target = u * total;
  double acc = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    acc += w[i];
    if (target < acc) return choice(ids[i]);
  }
  // Rounding at the top end: the last token with nonzero weight.
  size_t last = ids.size() - 1;
  while (last > 0 && w[last] == 0) --last;
  return choice(ids[last]);
}

std::vector<TokenChoice> choose_tokens(const Tensor& logits, double temperature, int64_t top_k, double top_p,
                                       const std::vector<double>& u) {
  NDT_CHECK(logits.dim() == 2 && logits.size(0) == static_cast<int64_t>(u.size()),
            "choose_tokens: logits {} for {} uniforms", shape_str(logits.shape()), u.size());
  const int64_t n = logits.size(0), V = logits.size(1);
  std::vector<TokenChoice> out(static_cast<size_t>(n));
  if (logits.device() == Device::CPU) {
    NDT_CHECK(logits.dtype() == DType::F32, "choose_tokens: host logits must be f32");
    for (int64_t r = 0; r < n; ++r)
      out[static_cast<size_t>(r)] =
          choose_token(logits.f32() + r * V, V, temperature, top_k, top_p, u[static_cast<size_t>(r)]);
    return out;
  }
#ifdef NDT_HAVE_CUDA
  Tensor tok = Tensor::empty({n}, DType::I32, Device::CUDA),
         lp = Tensor::empty({n}, DType::F32, Device::CUDA);
  choose_tokens_on_device(tok, lp, logits, temperature, top_k, top_p,
                          Tensor::from_vector(u, {n}).to(Device::CUDA));
  const std::vector<int32_t> t = tok.to_vector<int32_t>();
  const std::vector<float> l = lp.to_vector<float>();
  for (int64_t r = 0; r < n; ++r)
    out[static_cast<size_t>(r)] = {t[static_cast<size_t>(r)], l[static_cast<size_t>(r)]};
  return out;
#else
  NDT_FAIL("choose_tokens: logits on a device, but this ndtrain was built without the CUDA backend");
#endif
}

void choose_tokens_on_device([[maybe_unused]] Tensor& token, [[maybe_unused]] Tensor& logprob,
                             const Tensor& logits, [[maybe_unused]] double temperature,
                             [[maybe_unused]] int64_t top_k, [[maybe_unused]] double top_p,
                             [[maybe_unused]] const Tensor& u) {
  NDT_CHECK(logits.device() == Device::CUDA && logits.dim() == 2,
            "choose_tokens_on_device: CUDA (n, V) logits");
#ifdef NDT_HAVE_CUDA
  const int64_t n = logits.size(0), V = logits.size(1);
  NDT_CHECK(n * V < (int64_t{1} << 31),
            "choose_tokens: {} x {} logits exceed the device sorter's int32 range", n, V);
  NDT_CHECK(token.numel() == n && logprob.numel() == n && u.numel() == n && token.dtype() == DType::I32 &&
                logprob.dtype() == DType::F32 && u.dtype() == DType::F64 && token.device() == Device::CUDA &&
                logprob.device() == Device::CUDA && u.device() == Device::CUDA,
            "choose_tokens_on_device: outputs and uniforms must be {} device values", n);
  const double* up = u.data<double>();
  if (logits.dtype() == DType::F32)
    cuda::sample_tokens(token.data<int32_t>(), logprob.f32(), logits.f32(), n, V, temperature, top_k, top_p,
                        up, cuda::stream());
  else if (logits.dtype() == DType::BF16)
    cuda::sample_tokens(token.data<int32_t>(), logprob.f32(),
                        static_cast<const __nv_bfloat16*>(logits.data_ptr()), n, V, temperature, top_k, top_p,
                        up, cuda::stream());
  else
    NDT_FAIL("choose_tokens: logits must be f32 or bf16, got {}", dtype_name(logits.dtype()));
#else
  NDT_FAIL("choose_tokens_on_device: this ndtrain was built without the CUDA backend");
#endif
}

}  // namespace ndt
