#pragma once
// External input embeddings: a multimodal model's image tokens enter the language model as rows of its
// input that come from another module (the projected encoder output) instead of the token embedding
// table. The first pipeline stage calls these hooks; the model stays ignorant of where the rows come
// from (mimo/ implements them).
#include <cstdint>

#include "core/tensor.h"
#include "data/dataset.h"

namespace ndt {

class EmbedHooks {
 public:
  virtual ~EmbedHooks() = default;
  // x (Tl, C) holds tokens [tok0, tok0 + Tl) of mb's stream (after the token embedding and its TP
  // reduction, before position embeddings): overwrite the rows that take external embeddings.
  virtual void inject(const Microbatch& mb, int64_t tok0, Tensor& x) = 0;
  // dx (Tl, C), the gradient of the same rows: keep the gradient of the injected rows (accumulated into
  // the source's gradient) and zero them in dx, so that the placeholder token's embedding gets none.
  virtual void take_grad(const Microbatch& mb, int64_t tok0, Tensor& dx) = 0;
};

}  // namespace ndt
