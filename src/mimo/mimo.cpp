#include "mimo/mimo.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <numeric>

#include "data/image_caption.h"
#include "data/packing.h"
#include "ops/ops.h"
#include "parallel/layout.h"
#include "parallel/tp/gather_params.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

#ifdef NDT_HAVE_CUDA
#include "cuda/runtime.h"
#endif
#ifdef NDT_HAVE_CUDA
#include "dist/device_communicator.h"
#endif

namespace ndt {

MimoEncoder::MimoEncoder(const Config& cfg, Communicator& world, Communicator& llm_dp,
                         Communicator* llm_replica, const Tokenizer& tok, const Dataset& train)
    : cfg_(cfg),
      world_(world),
      llm_dp_(llm_dp),
      llm_replica_(llm_replica),
      tok_(tok),
      train_(train),
      image_token_(image_token_id(cfg.encoder, tok)),
      patches_(cfg.encoder.patches()) {
  const EncoderConfig& e = cfg_.encoder;
  NDT_CHECK(e.enabled(), "MimoEncoder needs encoder.image_size > 0");
  NDT_CHECK(image_token_ < cfg_.model.vocab_size, "encoder.image_token {} is outside model.vocab_size {}",
            image_token_, cfg_.model.vocab_size);
  const int64_t etp = e.tp, edp = e.dp > 0 ? e.dp : world.size() / etp;
  GridSpec spec;
  spec.sizes = {{"tp", etp}, {"dp", edp}};
  auto grid = Grid::create(world, spec);
  if (!grid) throw AgreedError("encoder layout: " + grid.status().message());
  grid_ = std::move(grid).value();
  tp_ = &grid_->comm({"tp"});
  dp_ = &grid_->comm({"dp"});
  const bool cuda = cfg_.train.device == "cuda";
  if (cuda) {
#ifdef NDT_HAVE_CUDA
    const int dev = cuda::select_device(world.rank());
    for (Communicator** c : {&tp_, &dp_}) {
      device_comms_.push_back(make_device_communicator(**c, dev, cfg_.train.device_comm));
      *c = device_comms_.back().get();
    }
#else
    throw AgreedError("train.device is cuda but this ndtrain was built without the CUDA backend");
#endif
  }
  if (const char* t = std::getenv("NDT_MIMO_TIMING")) sync_timing_ = std::string(t) == "1";
  tp_hooks_ = std::make_unique<CommTpHooks>(*tp_, /*sequence_parallel=*/false);
  enc_ = std::make_unique<VisionEncoder>(e, cfg_.model.d_model, cfg_.model.norm_eps, cfg_.model.init_std,
                                         etp > 1 ? tp_hooks_.get() : nullptr, store_);
  store_.flatten(edp);
  store_.init(static_cast<uint64_t>(cfg_.train.seed));  // names differ from the LLM's: independent values
  if (cuda) {
#ifdef NDT_HAVE_CUDA
    store_.to_device(Device::CUDA, cfg_.train.effective_precision() == "bf16" ? DType::BF16 : DType::F32);
#endif
  }
  OptimizerComms oc;
  oc.dp = dp_;
  oc.tp = tp_;
  oc.zero1 = cfg_.parallel.zero1;
  opt_ = std::make_unique<Optimizer>(store_, cfg_.train, oc);

  // Every rank's coordinates in both layouts (the bridge routes with them).
  int64_t mine[3] = {grid_->coord("dp"), grid_->coord("tp"), llm_dp.rank()};
  std::vector<int64_t> all(static_cast<size_t>(3 * world.size()));
  world.all_gather(mine, all.data(), 3, DType::I64);
  map_.batch = cfg_.train.global_batch;
  map_.enc_dp = edp;
  map_.enc_tp = etp;
  map_.llm_dp = llm_dp.size();
  for (int r = 0; r < world.size(); ++r) {
    map_.enc_dp_of.push_back(all[static_cast<size_t>(3 * r)]);
    map_.enc_tp_of.push_back(all[static_cast<size_t>(3 * r + 1)]);
    map_.llm_dp_of.push_back(all[static_cast<size_t>(3 * r + 2)]);
  }
  if (Status st = agree(map_.validate(), world); !st) throw AgreedError(st.message());
  bridge_ = std::make_unique<Bridge>(map_, world, llm_replica_);
}

std::string MimoEncoder::describe() const {
  const char* kind =
      map_.enc_dp == map_.llm_dp ? "equal" : (map_.enc_dp > map_.llm_dp ? "fan-in" : "fan-out");
  return fmt::format("encoder tp={} dp={} -> LLM dp={} ({})", map_.enc_tp, map_.enc_dp, map_.llm_dp, kind);
}

int64_t MimoEncoder::index_at(int64_t step, int64_t j) const {
  return sample_index(cfg_.data.seed, step, j, cfg_.train.global_batch, train_.size(), cfg_.data.shuffle);
}

int64_t MimoEncoder::first_placeholder(const std::vector<int32_t>& tokens) const {
  const auto it = std::find(tokens.begin(), tokens.end(), image_token_);
  NDT_CHECK(it != tokens.end(), "a multimodal sample has no image placeholder token ({})", image_token_);
  const int64_t first = it - tokens.begin();
  for (int64_t k = 0; k < patches_; ++k)
    NDT_CHECK(first + k < static_cast<int64_t>(tokens.size()) &&
                  tokens[static_cast<size_t>(first + k)] == image_token_,
              "a sample's image placeholders must be one run of {} tokens", patches_);
  return first;
}

double MimoEncoder::now() const {
#ifdef NDT_HAVE_CUDA
  if (sync_timing_ && store_.device() == Device::CUDA) cuda::synchronize();
#endif
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void MimoEncoder::fill_table(const Bridge& bridge, const Tensor& images, EncoderActs& acts,
                             std::vector<int64_t> first_pos) {
  const double t0 = now();
  Tensor out = enc_->forward(images, acts);  // (Be * patches, C), replicated over the encoder's TP
  const double t1 = now();
  table_ = bridge.forward(out, patches_);
  const double t2 = now();
  if (&acts == &acts_ && times_.steps > 0) {  // training steps after the first
    times_.enc_fwd += t1 - t0;
    times_.bridge_fwd += t2 - t1;
  }
  first_pos_ = std::move(first_pos);
  dtable_ = Tensor::zeros(table_.shape(), table_.dtype(), table_.device());
}

std::vector<float> MimoEncoder::render(int64_t step) const {
  const EncoderConfig& e = cfg_.encoder;
  // Not a structured binding: clang before 16 cannot capture one in the OpenMP region below.
  const auto block = map_.enc_block(world_.rank());
  const int64_t ef = block.first, ec = block.second;
  // Rendering images is pure per sample: spread over the host's threads.
  const int64_t pix = e.channels * e.image_size * e.image_size;
  std::vector<float> pixels(static_cast<size_t>(ec * pix));
  std::vector<int64_t> bad(static_cast<size_t>(ec), -1);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < ec; ++i) {
    const Sample s = train_.get(index_at(step, ef + i));
    if (static_cast<int64_t>(s.image.size()) != pix) {
      bad[static_cast<size_t>(i)] = static_cast<int64_t>(s.image.size());
      continue;
    }
    std::copy(s.image.begin(), s.image.end(), pixels.begin() + i * pix);
  }
  for (int64_t i = 0; i < ec; ++i)
    NDT_CHECK(bad[static_cast<size_t>(i)] < 0, "sample {} of step {} has {} pixels, expected {} x {} x {}",
              ef + i, step, bad[static_cast<size_t>(i)], e.channels, e.image_size, e.image_size);
  return pixels;
}

void MimoEncoder::begin_step(int64_t step) {
  const EncoderConfig& e = cfg_.encoder;
  const int me = world_.rank();
  const auto [ef, ec] = map_.enc_block(me);
  const double t_data = now();
  std::vector<float> pixels = prefetch_step_ == step ? prefetch_.get() : render(step);
  prefetch_step_ = -1;
  const auto [lf, lc] = map_.llm_block(me);
  std::vector<int64_t> first;
  for (int64_t j = lf; j < lf + lc; ++j)
    first.push_back(first_placeholder(train_.get_tokens(index_at(step, j)).tokens));
  ++times_.steps;
  if (times_.steps > 0) times_.data += now() - t_data;
  store_.zero_grad();
  if (early_reduce_) opt_->reduce_grads();  // (test fault) reduces zeros: the gradients do not exist yet
  acts_ = EncoderActs();
  fill_table(*bridge_, Tensor::from_vector(pixels, {ec, e.channels, e.image_size, e.image_size}), acts_,
             std::move(first));
  // On a GPU the host would otherwise render the next step's images while the device waits: render them now,
  // under this step's device work (a rank's next step is step + 1 unless a run ends or resumes).
  if (store_.device() != Device::CPU) {
    prefetch_step_ = step + 1;
    prefetch_ = std::async(std::launch::async, [this, next = step + 1] { return render(next); });
  }
}

void MimoEncoder::placeholder_rows(const Microbatch& mb, int64_t tok0, int64_t Tl,
                                   std::vector<int64_t>& x_rows, std::vector<int64_t>& table_rows) const {
  const int32_t* cu = mb.cu_seqlens.i32();
  const int32_t* tok = mb.tokens.i32();
  const int32_t* pos = mb.positions.i32();
  const int64_t n = static_cast<int64_t>(first_pos_.size());
  for (int64_t s = 0; s < mb.nseq; ++s) {
    const int64_t id =
        s < static_cast<int64_t>(mb.sample_ids.size()) ? mb.sample_ids[static_cast<size_t>(s)] : -1;
    if (id < 0) continue;  // a pad-only sequence
    NDT_CHECK(id < n, "microbatch sample {} is outside the {} samples with images", id, n);
    const int64_t b = std::max<int64_t>(cu[s], tok0), e = std::min<int64_t>(cu[s + 1], tok0 + Tl);
    for (int64_t t = b; t < e; ++t) {
      if (tok[t] != image_token_) continue;
      // Positions are global inside the sequence (also on a CP shard): the k-th patch of the image.
      const int64_t k = pos[t] - first_pos_[static_cast<size_t>(id)];
      NDT_CHECK(k >= 0 && k < patches_, "image placeholder at position {} is outside its run", pos[t]);
      x_rows.push_back(t - tok0);
      table_rows.push_back(id * patches_ + k);
    }
  }
}

void MimoEncoder::inject(const Microbatch& mb, int64_t tok0, Tensor& x) {
  std::vector<int64_t> rows, src;
  placeholder_rows(mb, tok0, x.size(0), rows, src);
  if (rows.empty()) return;
  const std::vector<int32_t> r32(rows.begin(), rows.end());
  ops::scatter_rows(x, Tensor::from_vector(r32, {static_cast<int64_t>(r32.size())}),
                    ops::gather_rows(table_, src));
}

void MimoEncoder::take_grad(const Microbatch& mb, int64_t tok0, Tensor& dx) {
  std::vector<int64_t> rows, dst;
  placeholder_rows(mb, tok0, dx.size(0), rows, dst);
  if (rows.empty()) return;
  ops::scatter_add_rows(dtable_, ops::gather_rows(dx, rows), dst);
  const std::vector<int32_t> r32(rows.begin(), rows.end());
  const int64_t n = static_cast<int64_t>(r32.size());
  ops::scatter_rows(dx, Tensor::from_vector(r32, {n}),
                    Tensor::zeros({n, dx.size(1)}, dx.dtype(), dx.device()));
}

void MimoEncoder::finish_backward() {
  const double t0 = now();
  const Tensor denc = skip_replica_sum_ ? bridge_->backward_unreduced(dtable_, patches_)
                                        : bridge_->backward(dtable_, patches_);
  const double t1 = now();
  enc_->backward(denc, acts_);
  acts_ = EncoderActs();
  if (times_.steps > 0) {
    times_.bridge_bwd += t1 - t0;
    times_.enc_bwd += now() - t1;
  }
}

std::string MimoEncoder::report(double mean_step_seconds) const {
  if (times_.steps <= 0 || mean_step_seconds <= 0) return "";
  const double n = static_cast<double>(times_.steps), step = mean_step_seconds;
  auto part = [&](const char* name, double total) {
    return fmt::format("{} {:.2f} ms ({:.1f}%)", name, 1e3 * total / n, 100.0 * total / n / step);
  };
  return fmt::format(
      "multimodal phases per step ({} steps, step {:.2f} ms{}): {}, {}, {}, {}, {}; bridge total {:.2f}%",
      times_.steps, 1e3 * step, sync_timing_ || store_.device() == Device::CPU ? "" : ", unsynchronized",
      part("images (host)", times_.data), part("encoder fwd", times_.enc_fwd),
      part("bridge fwd", times_.bridge_fwd), part("bridge bwd", times_.bridge_bwd),
      part("encoder bwd", times_.enc_bwd), 100.0 * (times_.bridge_fwd + times_.bridge_bwd) / n / step);
}

double MimoEncoder::reduce_grads() {
  if (!early_reduce_) return opt_->reduce_grads();
  // (test fault) the local, unreduced gradients go to the update
  Tensor g = store_.flat_grads().to(Device::CPU);
  double sq = 0;
  for (int64_t i = 0; i < g.numel(); ++i) sq += static_cast<double>(g.f32()[i]) * g.f32()[i];
  return std::sqrt(sq);
}

void MimoEncoder::set_test_fault(const std::string& fault) {
  NDT_CHECK(fault.empty() || fault == "skip_bridge_sum" || fault == "early_reduce",
            "NDT_MIMO_TEST_FAULT must be skip_bridge_sum or early_reduce, got '{}'", fault);
  skip_replica_sum_ = fault == "skip_bridge_sum";
  early_reduce_ = fault == "early_reduce";
}

void MimoEncoder::clip_and_step(double total_norm, double clip, double lr) {
  opt_->clip_grads(total_norm, clip);
  opt_->step(lr);
}

void MimoEncoder::encode_items(BridgeMap m, int64_t n, const std::function<const Sample&(int64_t)>& item) {
  const EncoderConfig& e = cfg_.encoder;
  const Bridge bridge(m, world_, nullptr);
  const int me = world_.rank();
  const auto [ef, ec] = m.enc_block(me);
  std::vector<float> pixels;
  for (int64_t j = ef; j < ef + ec; ++j) {
    const auto& img = item(j % n).image;
    NDT_CHECK(static_cast<int64_t>(img.size()) == e.channels * e.image_size * e.image_size,
              "item {} has {} pixels, expected {} x {} x {}", j % n, img.size(), e.channels, e.image_size,
              e.image_size);
    pixels.insert(pixels.end(), img.begin(), img.end());
  }
  const auto [lf, lc] = m.llm_block(me);
  std::vector<int64_t> first;
  for (int64_t j = lf; j < lf + lc; ++j) first.push_back(first_placeholder(item(j % n).tokens));
  EncoderActs acts;
  fill_table(bridge, Tensor::from_vector(pixels, {ec, e.channels, e.image_size, e.image_size}), acts,
             std::move(first));
}

void MimoEncoder::prepare_scoring(const std::vector<Sample>& samples) {
  // Every rank gets the rows of every sample (scoring splits samples over DP its own way): the bridge
  // towards a single LLM replica that all ranks belong to, over the samples padded to a multiple of the
  // encoder's DP degree.
  const int64_t n = static_cast<int64_t>(samples.size());
  NDT_CHECK(n > 0, "nothing to score");
  BridgeMap m = map_;
  m.batch = (n + map_.enc_dp - 1) / map_.enc_dp * map_.enc_dp;
  m.llm_dp = 1;
  m.llm_dp_of.assign(m.llm_dp_of.size(), 0);
  encode_items(m, n, [&](int64_t i) -> const Sample& { return samples[static_cast<size_t>(i)]; });
}

std::optional<std::pair<double, int64_t>> MimoEncoder::exact_match(const ArgmaxFn& llm) {
  const int64_t n = cfg_.train.eval_samples;
  if (cfg_.data.task != "image_caption" || n <= 0) return std::nullopt;
  // The held-out problems padded (by repeating) to a multiple of both DP degrees, moved like a batch.
  const int64_t L = std::lcm(map_.enc_dp, map_.llm_dp), P = (n + L - 1) / L * L;
  std::vector<Sample> problems;  // the prompt as tokens, with its image
  std::vector<std::string> answers;
  for (auto& p : image_caption_eval_problems(cfg_.data, cfg_.encoder, tok_, n)) {
    problems.push_back(Sample{std::move(p.prompt), {}, std::move(p.image)});
    answers.push_back(std::move(p.answer));
  }
  BridgeMap m = map_;
  m.batch = P;
  encode_items(m, n, [&](int64_t i) -> const Sample& { return problems[static_cast<size_t>(i)]; });
  const auto [lf, lc] = m.llm_block(world_.rank());
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t j = lf; j < lf + lc; ++j) prompts.push_back(problems[static_cast<size_t>(j % n)].tokens);
  const PackLayout layout =
      pack_layout(cfg_.parallel.cp, cfg_.parallel.tp, cfg_.parallel.sequence_parallel, cfg_.data.seq_len);
  const auto gen = greedy_generate(llm, prompts, cfg_.data.caption_digits + 1, tok_.eos_id(), tok_.pad_id(),
                                   layout, cfg_.parallel.ep > 1 ? &llm_dp_ : nullptr);
  int64_t correct = 0;
  for (int64_t i = 0; i < lc; ++i)
    if (lf + i < n)
      correct += tok_.decode(gen[static_cast<size_t>(i)]) == answers[static_cast<size_t>(lf + i)];
  llm_dp_.all_reduce(&correct, 1, DType::I64, ReduceOp::Sum);
  table_ = Tensor();
  dtable_ = Tensor();
  return std::make_pair(static_cast<double>(correct) / static_cast<double>(n), n);
}

void MimoEncoder::load_weights(const std::vector<std::pair<std::string, Tensor>>& full) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : full)
    if (store_.find(name)) by_name[name] = &t;
  if (by_name.empty()) return;  // an LLM-only checkpoint: the encoder keeps its initialization
  store_.with_host_values([&] { copy_global_slices(store_, by_name, "initial weights (encoder)"); },
                          /*write_back=*/true);
}

std::vector<std::pair<std::string, Tensor>> MimoEncoder::full_weights() {
  std::vector<std::pair<std::string, Tensor>> full;
  store_.with_host_values([&] { full = gather_full_params(store_, *tp_, nullptr); }, /*write_back=*/false);
  return full;
}

std::vector<std::pair<std::string, Tensor>> MimoEncoder::full_grads() {
  return gather_full_tensors(store_, opt_->gather_grads(), *tp_, nullptr);
}

int64_t MimoEncoder::count_params() const { return store_.global_numel(); }

void MimoEncoder::save_checkpoint(const std::string& root, int64_t step) {
  Tensor full_m, full_v;
  opt_->gather_moments(full_m, full_v);
  CheckpointMeta meta;
  meta.step = step;
  meta.optimizer_steps = opt_->steps_taken();
  meta.config_yaml = config_to_yaml(cfg_);
  meta.layout = fmt::format("encoder tp={} dp={}", map_.enc_tp, map_.enc_dp);
  // Encoder DP replicas hold identical slices: DP rank 0 of each TP coordinate writes.
  store_.with_host_values(
      [&] {
        ndt::save_checkpoint(root, store_, full_m, full_v, meta, dp_->rank() == 0,
                             static_cast<int>(cfg_.train.keep_last), world_)
            .throw_if_error();
      },
      /*write_back=*/false);
}

Status MimoEncoder::load_checkpoint(const std::string& root, int64_t step) {
  const std::string dir = (std::filesystem::path(root) / checkpoint_step_name(step)).string();
  auto meta = read_checkpoint_meta(dir);
  if (!meta)
    return Status::error(fmt::format("encoder checkpoint for step {}: {}", step, meta.status().message()));
  const int64_t n = store_.flat_values().numel();
  Tensor full_m = Tensor::zeros({n}), full_v = Tensor::zeros({n});
  Status st;
  store_.with_host_values([&] { st = ndt::load_checkpoint(dir, store_, &full_m, &full_v); },
                          /*write_back=*/true);
  if (!st) return st;
  opt_->scatter_moments(full_m, full_v);
  opt_->set_steps_taken(meta.value().optimizer_steps);
  return Status::ok();
}

std::unique_ptr<MimoEncoder> attach_encoder(Trainer& trainer, Communicator& world, Layout* layout,
                                            const Tokenizer& tok, const Dataset& train) {
  const Config& cfg = trainer.config();
  if (!cfg.encoder.enabled()) return nullptr;
  auto enc = std::make_unique<MimoEncoder>(cfg, world, *trainer.comms().dp,
                                           layout ? &layout->bridge_group() : nullptr, tok, train);
  trainer.set_companion(enc.get());
  return enc;
}

}  // namespace ndt
