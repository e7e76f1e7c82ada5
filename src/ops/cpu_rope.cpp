// Rotary position embedding, rotate_half layout: pairs (i, i + D/2), angle = pos * theta^(-2i/D).
// Angles and their cos/sin are computed in double (positions can be large). Backward accumulates (+=)
// the inverse rotation of dout.
#include <cmath>
#include <vector>

#include "core/check.h"
#include "ops/cpu_ops.h"

namespace ndt::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves (and threads spin on a
// loaded machine).
constexpr int64_t kMinParallelWork = 1 << 15;

// Rotates every head of token t by angle sign * pos * freq_i; writes (accumulate=false) or adds.
void rotate(float* out, const float* inp, const int32_t* pos, int64_t T, int64_t H, int64_t D, float theta,
            float sign, bool accumulate) {
  NDT_CHECK(D % 2 == 0, "rope: head dim {} must be even", D);
  const int64_t half = D / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] =
        std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(D));
#pragma omp parallel if (T * H * D >= kMinParallelWork)
  {
    std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(pos[t]) * inv_freq[i];
        cs[i] = static_cast<float>(std::cos(a));
        sn[i] = sign * static_cast<float>(std::sin(a));
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* x = inp + (t * H + h) * D;
        float* o = out + (t * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];  // read both before writing: inp may alias out
          const float y1 = x1 * cs[i] - x2 * sn[i];
          const float y2 = x2 * cs[i] + x1 * sn[i];
          if (accumulate) {
            o[i] += y1;
            o[i + half] += y2;
          } else {
            o[i] = y1;
            o[i + half] = y2;
          }
        }
      }
    }
  }
}

}  // namespace

void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t T, int64_t H, int64_t D,
                  float theta) {
  rotate(out, inp, pos, T, H, D, theta, 1.0f, false);
}

void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t T, int64_t H, int64_t D,
                   float theta) {
  if (!dinp) return;
  rotate(dinp, dout, pos, T, H, D, theta, -1.0f, true);
}

}  // namespace ndt::cpu
