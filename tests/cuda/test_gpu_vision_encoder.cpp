// The vision encoder + projector on the GPU against its CPU run (same seed, same images): fp32 outputs and
// every parameter gradient within 1e-4 of the tensor's largest CPU value; bf16 outputs within 3e-2 (bf16
// rounding of activations and weights through 2 layers). Both styles; head dim 64 (the flash kernels).
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "../tiny_model.h"
#include "gpu_test.h"
#include "model/vision_encoder.h"

namespace ndt {
namespace {

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

struct EncRun {
  std::vector<float> out;
  std::map<std::string, std::vector<float>> grads;
};

EncRun run(const std::string& style, Device dev, DType dt, const Tensor& images, const Tensor& dout) {
  ParamStore store;
  VisionEncoder enc(testing::tiny_encoder(style, 128, 16, 3, 0), 96, 1e-5, 0.02, nullptr, store);
  store.flatten();
  store.init(7);
  if (dev == Device::CUDA) store.to_device(Device::CUDA, dt);
  EncoderActs acts;
  Tensor y = enc.forward(images, acts);
  EncRun r;
  Tensor yf = Tensor::empty(y.shape(), DType::F32, y.device());
  ops::cast_into(yf, y);
  r.out = yf.to_vector<float>();
  Tensor d = dev == Device::CUDA ? testing::to_device_as(dout, dt) : dout;
  enc.backward(d, acts);
  store.with_host_values([] {}, false);
  for (auto& p : store.all()) r.grads[p->name] = p->grad.to_vector<float>();
  return r;
}

TEST(GpuVisionEncoder, MatchesCpu) {
  NDT_REQUIRE_GPU();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> px(4 * 3 * 16 * 16), g(4 * 16 * 96);
  for (auto& x : px) x = nd(rng);
  for (auto& x : g) x = nd(rng);
  const Tensor images = Tensor::from_vector(px, {4, 3, 16, 16}), dout = Tensor::from_vector(g, {4 * 16, 96});
  for (const std::string style : {"gpt2", "llama"}) {
    const EncRun cpu = run(style, Device::CPU, DType::F32, images, dout);
    const EncRun gpu = run(style, Device::CUDA, DType::F32, images, dout);
    const double s = max_abs(cpu.out);
    for (size_t i = 0; i < cpu.out.size(); ++i)
      ASSERT_NEAR(gpu.out[i], cpu.out[i], 1e-4 * s) << style << " out " << i;
    for (const auto& [name, cg] : cpu.grads) {
      const auto& gg = gpu.grads.at(name);
      const double gs = std::max(max_abs(cg), 1e-12);
      for (size_t i = 0; i < cg.size(); ++i)
        ASSERT_NEAR(gg[i], cg[i], 1e-4 * gs) << style << " " << name << " " << i;
    }
    const EncRun bf = run(style, Device::CUDA, DType::BF16, images, dout);
    for (size_t i = 0; i < cpu.out.size(); ++i)
      ASSERT_NEAR(bf.out[i], cpu.out[i], 3e-2 * s) << style << " bf16 out " << i;
  }
}

}  // namespace
}  // namespace ndt
