#include "plan/act_mirror.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "plan/alloc_trace.h"

namespace ndt::plan {

ActDims act_dims(const Config& cfg, int64_t T) {
  const ModelConfig& m = cfg.model;
  const ParallelConfig& p = cfg.parallel;
  ActDims d;
  d.T = T;
  d.sp = p.sequence_parallel && p.tp > 1;  // one TP rank has no TP hooks, hence no SP
  d.loss_in_backward = p.tp == 1;
  d.Tl = d.sp ? T / p.tp : T;
  d.C = m.d_model;
  d.D = m.head_dim();
  d.Hl = m.n_heads / p.tp;
  d.KVl = m.kv_heads() / p.tp;
  d.Fl = m.ffn_dim() / p.tp;
  d.Vl = m.vocab_size / p.tp;
  d.cp = p.cp;
  d.ep = p.ep;
  d.ring = p.cp_attention != "allgather";
  d.b = cfg.train.precision == "fp32" ? 4 : 2;  // train.device cuda: bf16 unless fp32 is asked for
  d.gpt2 = m.is_gpt2();
  d.qk_norm = !d.gpt2 && m.qk_norm;
  d.moe = m.moe.enabled();
  if (d.moe) {
    const MoeConfig& e = m.moe;
    d.Fe = m.expert_ffn_dim();
    d.Fs = e.shared_experts * d.Fe / p.tp;
    d.E = e.num_experts;
    d.El = e.num_experts / p.ep;
    d.k = e.top_k;
    // The routed block runs on the residual rows. Balanced routing: every expert gets N k / E slots, so
    // a capacity keeps min(that, capacity) per expert and each EP rank receives as many rows as it sends.
    const int64_t N = d.Tl, slots = N * d.k;
    d.R = slots;
    if (e.capacity_factor > 0) {
      const auto cap = static_cast<int64_t>(
          std::ceil(e.capacity_factor * static_cast<double>(slots) / static_cast<double>(d.E)));
      d.R = std::min(slots, d.E * cap);
    }
    d.Re = d.R;
    d.moe_aux = e.aux_loss_coef > 0;
    d.moe_z = e.z_loss_coef > 0;
    d.seqs = std::max<int64_t>(1, cfg.train.micro_batch);
  }
  return d;
}

namespace {

using Id = AllocTrace::Id;
constexpr Id kNone = AllocTrace::kNone;

// What one layer's forward keeps (LayerActs), its MoE part separately (freed inside the MoE backward).
struct LayerSaved {
  Id x_in = kNone;
  std::vector<Id> main, moe;
};

// Replays the engine's allocations; every function names the code it mirrors.
class Mirror {
 public:
  Mirror(AllocTrace& t, const ActDims& d, const Config& cfg) : t_(t), d_(d), cfg_(cfg) {}

  // Transformer::layer_forward. Saved tensors go to s; returns the layer output.
  Id layer_forward(int64_t l, LayerSaved& s) {
    const ActDims& d = d_;
    auto keep = [&](std::vector<Id>& v, int64_t bytes) {
      v.push_back(t_.alloc(bytes));
      return v.back();
    };
    const int64_t TC = d.T * d.C * d.b, TlC = d.Tl * d.C * d.b;
    const int64_t q = d.T * d.Hl * d.D * d.b, kv = d.T * d.KVl * d.D * d.b;
    t_.at(fmt::format("layer {} forward: attention", l));
    norm(s.main);
    if (d.sp) keep(s.main, TC);  // a_in: tokens all-gathered over TP
    keep(s.main, q);
    keep(s.main, kv);
    keep(s.main, kv);
    if (d.qk_norm) {  // q and k normalised into fresh tensors; the raw ones stay for the backward
      keep(s.main, q);
      keep(s.main, d.T * d.Hl * 4);
      keep(s.main, kv);
      keep(s.main, d.T * d.KVl * 4);
    }
    keep(s.main, q);               // att
    keep(s.main, d.T * d.Hl * 4);  // lse
    cp_attention_forward();
    const Id o_partial = t_.alloc(TC);
    const Id o = d.sp ? t_.alloc(TlC) : kNone;  // reduce-scatter; else all-reduced in place
    keep(s.main, TlC);                          // h
    t_.at(fmt::format("layer {} forward: MLP", l));
    norm(s.main);
    std::vector<Id> temps;
    if (!cfg_.model.is_moe_layer(l)) {
      temps.push_back(mlp_forward(d.Fl, s.main));
    } else {
      t_.at(fmt::format("layer {} forward: MoE", l));
      temps.push_back(moe_forward(s.moe));
      if (d.Fs > 0) {
        temps.push_back(mlp_forward(d.Fs, s.main));
        temps.push_back(t_.alloc(TlC));  // routed + shared
      }
    }
    const Id out = t_.alloc(TlC);  // h + MLP output
    t_.free(temps);
    t_.free(o);
    t_.free(o_partial);
    return out;
  }

  // Transformer::layer_backward; dout stays live (the caller frees it). Frees the MoE part of s.
  Id layer_backward(int64_t l, LayerSaved& s) {
    const ActDims& d = d_;
    const int64_t TC = d.T * d.C * d.b, TlC = d.Tl * d.C * d.b;
    const int64_t q = d.T * d.Hl * d.D * d.b, kv = d.T * d.KVl * d.D * d.b;
    t_.at(fmt::format("layer {} backward: MLP", l));
    const Id dh = t_.alloc(TlC);
    Id dn2;
    if (!cfg_.model.is_moe_layer(l)) {
      dn2 = mlp_backward(d.Fl);
    } else {
      t_.at(fmt::format("layer {} backward: MoE", l));
      dn2 = moe_backward(s.moe);
      if (d.Fs > 0) t_.free(mlp_backward(d.Fs));  // added into dn2, then released
    }
    t_.at(fmt::format("layer {} backward: attention", l));
    const Id dx = t_.alloc(TlC);
    const Id do_full = d.sp ? t_.alloc(TC) : kNone;
    const Id datt = t_.alloc(q);
    Id dq = t_.alloc(q), dk = t_.alloc(kv);
    const Id dv = t_.alloc(kv);
    cp_attention_backward();
    if (!d.gpt2) {  // rope_backward rotates through a zeroed copy
      t_.free(t_.alloc(q));
      t_.free(t_.alloc(kv));
    }
    if (d.qk_norm) {  // head_norm_backward returns fresh gradients
      const Id dq2 = t_.alloc(q);
      t_.free(dq);
      dq = dq2;
      const Id dk2 = t_.alloc(kv);
      t_.free(dk);
      dk = dk2;
    }
    const Id da_in = t_.alloc(TC);
    const Id dn1 = d.sp ? t_.alloc(TlC) : kNone;  // reduce-scatter; else all-reduced in place
    t_.free({dh, dn2, do_full, datt, dq, dk, dv, da_in, dn1});
    return dx;
  }

  // Transformer::forward of a chunk; input is the received stage input (kNone on the first stage).
  // Fills the chunk's saved state; returns the output (the next stage's input, or x_final).
  struct ChunkSaved {
    std::vector<LayerSaved> layers;
    std::vector<Id> head;  // x_final's norm, head_in, logits statistics (Activations), logits last
    Id logits = kNone;
    Id out = kNone;
  };
  void chunk_forward(const ChunkSpec& c, Id input, ChunkSaved& cs) {
    const ActDims& d = d_;
    const int64_t TC = d.T * d.C * d.b, TlC = d.Tl * d.C * d.b;
    Id x = input;
    if (c.has_embedding) {
      t_.at("embedding forward");
      const Id partial = t_.alloc(TC);
      x = partial;
      if (d.sp) {  // reduce-scatter into the local rows
        x = t_.alloc(TlC);
        t_.free(partial);
      }
    }
    const bool recompute = cfg_.train.recompute;
    cs.layers.resize(static_cast<size_t>(c.last_layer - c.first_layer));
    for (int64_t l = c.first_layer; l < c.last_layer; ++l) {
      LayerSaved& s = cs.layers[static_cast<size_t>(l - c.first_layer)];
      if (recompute) {  // keep only the layer input; the rest dies with the scratch LayerActs
        LayerSaved scratch;
        const Id y = layer_forward(l, scratch);
        t_.free(scratch.main);
        t_.free(scratch.moe);
        s.x_in = x;
        x = y;
      } else {
        s.x_in = x;
        x = layer_forward(l, s);
      }
    }
    cs.out = x;
    if (!c.has_head) return;
    t_.at("head forward: logits");
    norm(cs.head);                              // fn (x_final is the output itself)
    if (d.sp) cs.head.push_back(t_.alloc(TC));  // head_in
    cs.logits = t_.alloc(d.T * d.Vl * d.b);
    if (d.loss_in_backward) return;  // the statistics and logprob come with the backward
    for (int i = 0; i < 2; ++i) cs.head.push_back(t_.alloc(d.T * 4));  // rowmax, sumexp
    const Id target_logit = t_.alloc(d.T * 4);
    cs.head.push_back(t_.alloc(d.T * 4));  // logprob
    t_.free(target_logit);
  }

  // Transformer::backward of a chunk; dy is the received output gradient (kNone on the last stage), left
  // live. Frees the layers' activations as the engine does; returns the input gradient (kNone on the
  // first stage). The caller then releases cs (the engine's acts.erase / y_out.erase).
  Id chunk_backward(const ChunkSpec& c, Id dy, ChunkSaved& cs) {
    const ActDims& d = d_;
    const int64_t TC = d.T * d.C * d.b, TlC = d.Tl * d.C * d.b;
    Id dx = dy;
    bool own_dx = false;
    if (c.has_head) {
      t_.at("head backward");
      const Id dloss = t_.alloc(d.T * 4);
      if (d.loss_in_backward) cs.head.push_back(t_.alloc(d.T * 4));  // logprob, kept for the loss sum
      const Id dhead_in = t_.alloc(TC);  // the logits become their own gradient in place
      const Id dfn = d.sp ? t_.alloc(TlC) : kNone;
      dx = t_.alloc(TlC);
      own_dx = true;
      t_.free({dloss, cs.logits, dhead_in, dfn});
    }
    for (int64_t l = c.last_layer - 1; l >= c.first_layer; --l) {
      LayerSaved& s = cs.layers[static_cast<size_t>(l - c.first_layer)];
      if (cfg_.train.recompute) {
        t_.at(fmt::format("layer {} recompute", l));
        t_.free(layer_forward(l, s));  // the recomputed output is discarded
      }
      const Id ndx = layer_backward(l, s);
      if (own_dx) t_.free(dx);
      dx = ndx;
      own_dx = true;
      t_.free(s.main);
      t_.free(s.x_in);
    }
    if (!c.has_embedding) return dx;
    t_.at("embedding backward");
    const Id dfull = d.sp ? t_.alloc(TC) : kNone;  // all-gathered tokens
    t_.free(t_.alloc(3 * d.T * 4));                // the sort scratch of the deterministic backward
    t_.free({dfull, dx});
    return kNone;
  }

 private:
  // Transformer::norm_forward: output, rstd (and the mean for LayerNorm).
  void norm(std::vector<Id>& v) {
    v.push_back(t_.alloc(d_.Tl * d_.C * d_.b));
    v.push_back(t_.alloc(d_.Tl * 4));
    if (d_.gpt2) v.push_back(t_.alloc(d_.Tl * 4));
  }

  // Transformer::mlp_forward of local width fl: saved m_in (SP), fc1, act, fc3; returns the block output.
  Id mlp_forward(int64_t fl, std::vector<Id>& s) {
    const ActDims& d = d_;
    const int64_t TC = d.T * d.C * d.b;
    if (d.sp) s.push_back(t_.alloc(TC));    // m_in
    s.push_back(t_.alloc(d.T * fl * d.b));  // fc1
    s.push_back(t_.alloc(d.T * fl * d.b));  // act
    const Id m_partial = t_.alloc(TC);
    if (!d.gpt2) s.push_back(t_.alloc(d.T * fl * d.b));  // fc3
    if (!d.sp) return m_partial;                         // all-reduced in place
    const Id out = t_.alloc(d.Tl * d.C * d.b);
    t_.free(m_partial);
    return out;
  }

  // Transformer::mlp_backward; returns the norm-output gradient. GPT-2: ops::linear_dgelu_backward writes
  // dfc1 without dact in the bf16 GELU epilogue (width a multiple of 8), else dact is that op's scratch.
  Id mlp_backward(int64_t fl) {
    const ActDims& d = d_;
    const int64_t TC = d.T * d.C * d.b, TF = d.T * fl * d.b;
    const Id dm = d.sp ? t_.alloc(TC) : kNone;
    const Id dact = d.gpt2 ? kNone : t_.alloc(TF);
    const Id dm_in = t_.alloc(TC), dfc1 = t_.alloc(TF);
    if (d.gpt2 && !(d.b == 2 && fl % 8 == 0)) t_.free(t_.alloc(TF));
    const Id dfc3 = d.gpt2 ? kNone : t_.alloc(TF);
    Id out = dm_in;
    if (d.sp) {
      out = t_.alloc(d.Tl * d.C * d.b);
      t_.free(dm_in);
    }
    t_.free({dm, dact, dfc1, dfc3});
    return out;
  }

  // MoeLayer::forward on the N = Tl residual rows. Saved tensors go to s; returns the routed output.
  Id moe_forward(std::vector<Id>& s) {
    const ActDims& d = d_;
    const int64_t N = d.Tl;
    if (d.b != 4) s.push_back(t_.alloc(N * d.C * 4));  // xf: fp32 router input
    s.push_back(t_.alloc(N * d.E * 4));                // router logits
    // route_tokens (model/moe_router.h): score, choice, gate, lse, pnorm, slot_pos, kept_gate, row_token,
    // row_gate; then the per-expert counts, read back
    for (int64_t n : {N * d.E * 4, N * d.k * 4, N * d.k * 4, N * 4, N * 4, N * d.k * 4, N * d.k * 4,
                      N * d.k * 4, N * d.k * 4})
      s.push_back(t_.alloc(n));
    t_.free(t_.alloc(d.E * 4));
    if (d.moe_aux || d.moe_z) {  // the loss terms: sequence of each token, statistics (read back)
      s.push_back(t_.alloc(N * 4));
      t_.free(t_.alloc((2 * d.seqs * d.E + 2) * 4));
    }
    if (d.moe_aux)  // balancing-loss weight per sequence and count table
      for (int64_t n : {d.seqs * 4, d.seqs * d.E * 4}) s.push_back(t_.alloc(n));
    const Id xp = t_.alloc(d.R * d.C * d.b);
    Id xe = xp;  // one EP rank: dispatch is the identity
    if (d.ep > 1) {
      const Id recv = t_.alloc(d.Re * d.C * d.b);
      xe = t_.alloc(d.Re * d.C * d.b);  // reordered expert-major
      t_.free(recv);
    }
    s.push_back(xe);
    s.push_back(t_.alloc(d.Re * d.Fe * d.b));               // h1
    if (!d.gpt2) s.push_back(t_.alloc(d.Re * d.Fe * d.b));  // h3
    s.push_back(t_.alloc(d.Re * d.Fe * d.b));               // act
    const Id ye = t_.alloc(d.Re * d.C * d.b);
    Id yp = ye;
    if (d.ep > 1) {
      const Id src_major = t_.alloc(d.Re * d.C * d.b);
      yp = t_.alloc(d.R * d.C * d.b);
      t_.free(src_major);
    }
    s.push_back(yp);
    const Id out = t_.alloc(N * d.C * d.b);
    if (d.ep > 1) t_.free({xp, ye});
    return out;
  }

  // MoeLayer::backward; frees the saved MoE tensors; returns dx.
  Id moe_backward(std::vector<Id>& s) {
    const ActDims& d = d_;
    const int64_t N = d.Tl;
    const Id dgates = t_.alloc(N * d.k * 4);
    const Id dyp = t_.alloc(d.R * d.C * d.b);
    Id dye = dyp;
    if (d.ep > 1) {
      const Id recv = t_.alloc(d.Re * d.C * d.b);
      dye = t_.alloc(d.Re * d.C * d.b);
      t_.free(recv);
    }
    const Id dxe = t_.alloc(d.Re * d.C * d.b);
    // MoeLayer::experts_backward: dact and dh1 over all rows, dh3 (llama); dact dies after the activation.
    const Id dact = t_.alloc(d.Re * d.Fe * d.b), dh1 = t_.alloc(d.Re * d.Fe * d.b);
    const Id dh3 = d.gpt2 ? kNone : t_.alloc(d.Re * d.Fe * d.b);
    t_.free(dact);
    t_.free(dh1);
    if (dh3 != kNone) t_.free(dh3);
    Id dxp = dxe;
    if (d.ep > 1) {
      const Id src_major = t_.alloc(d.Re * d.C * d.b);
      dxp = t_.alloc(d.R * d.C * d.b);
      t_.free(src_major);
    }
    const Id dx = t_.alloc(N * d.C * d.b);
    const Id dl = t_.alloc(N * d.E * 4), dxf = t_.alloc(N * d.C * 4);  // router gradient in fp32
    if (d.b != 4) t_.free(t_.alloc(N * d.C * d.b));                    // cast back
    t_.free({dl, dxf});
    t_.free(s);
    s.clear();
    t_.free({dgates, dyp, dxe});
    if (d.ep > 1) t_.free({dye, dxp});
    return dx;
  }

  // The flash kernels' backward scratch (flash_attention_bwd.cu): fp32 dq accumulator and row statistics.
  void flash_backward_scratch() {
    const int64_t rows = d_.T * d_.Hl;
    const Id stats = t_.alloc(2 * rows * 4), dq_acc = t_.alloc(rows * d_.D * 4);
    t_.free({stats, dq_acc});
  }

  // CpAttention::attention_forward (one CP rank: the local kernel, no scratch worth counting).
  void cp_attention_forward() {
    const ActDims& d = d_;
    if (d.cp == 1) return;
    const int64_t kv = d.T * d.KVl * d.D * d.b;
    if (!d.ring) {  // K and V gathered over CP and reordered into full sequences
      const Id g1 = t_.alloc(d.cp * kv), kf = t_.alloc(d.cp * kv);
      t_.free(g1);
      const Id g2 = t_.alloc(d.cp * kv), vf = t_.alloc(d.cp * kv);
      t_.free(g2);
      t_.free({kf, vf});
      return;
    }
    Id kb = t_.alloc(kv), vb = t_.alloc(kv);
    const Id o = t_.alloc(d.T * d.Hl * d.D * d.b), l = t_.alloc(d.T * d.Hl * 4);
    for (int64_t i = 0; i + 1 < d.cp; ++i) {  // ring_shift: receive into fresh blocks, drop the old ones
      const Id nk = t_.alloc(kv), nv = t_.alloc(kv);
      t_.free({kb, vb});
      kb = nk;
      vb = nv;
    }
    t_.free({kb, vb, o, l});
  }

  // CpAttention::attention_backward, or the local kernel's scratch without CP.
  void cp_attention_backward() {
    const ActDims& d = d_;
    if (d.cp == 1) {
      flash_backward_scratch();
      return;
    }
    const int64_t kv = d.T * d.KVl * d.D * d.b;
    if (!d.ring) {
      const Id g1 = t_.alloc(d.cp * kv), kf = t_.alloc(d.cp * kv);
      t_.free(g1);
      const Id g2 = t_.alloc(d.cp * kv), vf = t_.alloc(d.cp * kv);
      t_.free(g2);
      const Id dkf = t_.alloc(d.cp * kv), dvf = t_.alloc(d.cp * kv);
      flash_backward_scratch();
      for (int i = 0; i < 2; ++i) {  // scatter back to rank-major rows, reduce-scatter the owner's part
        const Id g = t_.alloc(d.cp * kv), mine = t_.alloc(kv);
        t_.free({g, mine});
      }
      t_.free({kf, vf, dkf, dvf});
      return;
    }
    std::vector<Id> blocks = {t_.alloc(kv), t_.alloc(kv), t_.alloc(kv), t_.alloc(kv)};  // k, v, dk, dv
    for (int64_t i = 0; i < d.cp; ++i) {
      flash_backward_scratch();
      // Blocks travel one hop per step, received into fresh buffers before the old ones go (ring_shift);
      // the last hop returns only dk and dv to their owner.
      const size_t first = i + 1 < d.cp ? 0 : 2;
      std::vector<Id> incoming;
      for (size_t j = first; j < blocks.size(); ++j) incoming.push_back(t_.alloc(kv));
      for (size_t j = first; j < blocks.size(); ++j) {
        t_.free(blocks[j]);
        blocks[j] = incoming[j - first];
      }
    }
    t_.free(blocks);
  }

  AllocTrace& t_;
  const ActDims& d_;
  const Config& cfg_;
};

}  // namespace

ChunkProfile chunk_profile(const Config& cfg, const ActDims& d, const ChunkSpec& c) {
  AllocTrace t(d.granule);
  Mirror mirror(t, d, cfg);
  ChunkProfile p;
  const int64_t act = d.Tl * d.C * d.b;  // PipelineEngine::act_buffer: stage inputs and their gradients
  const int64_t rounded = (act + d.granule - 1) / d.granule * d.granule;
  p.input = c.has_embedding ? 0 : rounded;
  p.dy = c.has_head ? 0 : rounded;
  p.dx_out = c.has_embedding ? 0 : rounded;
  const Id input = c.has_embedding ? kNone : t.alloc(act);

  Mirror::ChunkSaved saved;
  int64_t before = t.live();
  t.reset_peak();
  mirror.chunk_forward(c, input, saved);
  p.fwd_peak = t.peak() - before;
  p.fwd_peak_at = t.peak_at();
  p.retained = t.live() - before;

  const Id dy = c.has_head ? kNone : t.alloc(act);
  before = t.live();
  t.at("backward");
  t.reset_peak();
  mirror.chunk_backward(c, dy, saved);  // its input gradient stays live until sent (the schedule walk)
  p.bwd_peak = t.peak() - before;
  p.bwd_peak_at = t.peak_at();
  // The engine's cleanup after the backward: the rest of acts, the stage output, the received gradient.
  t.free(saved.head);
  t.free(saved.out);
  t.free(dy);
  p.bwd_delta = t.live() - before;
  return p;
}

}  // namespace ndt::plan
