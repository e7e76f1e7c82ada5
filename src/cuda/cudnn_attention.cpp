// cuDNN fused attention (see cudnn_attention.h). The graphs are the composite forms cuDNN's fused
// flash-attention engines recognise (the ones cudnn-frontend lowers its SDPA nodes to on cuDNN 9):
//   forward:  S = scale * Q K^T, causal mask (row >= col), softmax with stats = max + log(sum exp),
//             O = P V;
//   backward: Dsum = rowsum(dO * O); P = exp(scale * Q K^T - stats) under the mask; dV = P^T dO;
//             dS = P * (dO V^T - Dsum) * scale; dK = dS^T Q; dQ = dS K (through an fp32 accumulator).
// GQA: K/V carry KV heads that the matmuls broadcast; dK/dV are reduced from per-query-head results.
// cuDNN versions differ in the exact forms they accept (where the mask sits, whether the statistics
// may be strided like our (rows, H) lse), so each shape tries a short list of variants and keeps the
// first one an engine finalizes.
#include "cuda/cudnn_attention.h"

#ifdef NDT_HAVE_CUDNN_HEADERS
#include <cudnn_graph.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/dl_symbol.h"
#include "cuda/runtime.h"

namespace ndt::cuda {
namespace {

// ---- the library, loaded on first use ----
struct Api {
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnGetVersion) version = nullptr;
  decltype(&cudnnGetLastErrorString) last_error = nullptr;
  decltype(&cudnnBackendCreateDescriptor) make = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy = nullptr;
  decltype(&cudnnBackendSetAttribute) set = nullptr;
  decltype(&cudnnBackendGetAttribute) get = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;
  bool loaded = false;
  std::string status;  // "cuDNN 9.x.y" or why not
};

const Api& api() {
  static const Api a = [] {
    Api r;
    const char* env = std::getenv("NDT_CUDNN_LIB");
    const char* path = env && *env ? env : "libcudnn.so.9";
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      r.status = fmt::format("cuDNN not loaded ({}): {}", path, dlerror());
      return r;
    }
    bool ok = load_symbol(lib, "cudnnCreate", r.create) && load_symbol(lib, "cudnnSetStream", r.set_stream) &&
              load_symbol(lib, "cudnnGetVersion", r.version) &&
              load_symbol(lib, "cudnnGetLastErrorString", r.last_error) &&
              load_symbol(lib, "cudnnBackendCreateDescriptor", r.make) &&
              load_symbol(lib, "cudnnBackendDestroyDescriptor", r.destroy) &&
              load_symbol(lib, "cudnnBackendSetAttribute", r.set) &&
              load_symbol(lib, "cudnnBackendGetAttribute", r.get) &&
              load_symbol(lib, "cudnnBackendFinalize", r.finalize) &&
              load_symbol(lib, "cudnnBackendExecute", r.execute);
    if (!ok) {
      r.status = fmt::format("cuDNN at {} lacks the backend API", path);
      return r;
    }
    const size_t v = r.version();
    r.loaded = v >= 90000;
    r.status = r.loaded ? fmt::format("cuDNN {}.{}.{}", v / 10000, v / 100 % 100, v % 100)
                        : fmt::format("cuDNN {} is older than 9", v);
    return r;
  }();
  return a;
}

bool g_enabled = [] {
  const char* e = std::getenv("NDT_ATTENTION");
  return !(e && std::string(e) == "native");
}();

struct Refused {
  std::string what;
};

void check(cudnnStatus_t s, const char* what) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  char msg[512] = {0};
  api().last_error(msg, sizeof msg);
  throw Refused{fmt::format("{}: status {} {}", what, static_cast<int>(s), msg)};
}

using Dims = std::array<int64_t, 4>;
struct Tn {
  cudnnBackendDescriptor_t d = nullptr;
  int64_t uid = 0;
};

// Tensor ids of the variant pack (virtual tensors are numbered from 100).
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kDO, kDQ, kDK, kDV, kSum, kDqAcc, kOne };

// Owns every descriptor it creates: a finalized plan keeps referring to them.
class Graph {
 public:
  explicit Graph(cudnnHandle_t h) : handle_(h) {}
  ~Graph() {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api().destroy(*it);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t t) {
    cudnnBackendDescriptor_t d = nullptr;
    check(api().make(t, &d), "create descriptor");
    owned_.push_back(d);
    return d;
  }
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t,
           int64_t n, const void* v) {
    check(api().set(d, a, t, n, v), "set attribute");
  }
  void fin(cudnnBackendDescriptor_t d, const char* what) { check(api().finalize(d), what); }

  Tn tensor(int64_t uid, cudnnDataType_t dt, Dims dims, Dims strides, bool is_virtual,
            bool by_value = false) {
    Tn t{make(CUDNN_BACKEND_TENSOR_DESCRIPTOR), uid};
    const int64_t align = by_value ? 4 : 16;
    set(t.d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set(t.d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    set(t.d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    set(t.d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    set(t.d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    set(t.d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) set(t.d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    fin(t.d, "tensor");
    return t;
  }
  Tn virt(cudnnDataType_t dt, Dims dims, Dims strides) {
    return tensor(next_uid_++, dt, dims, strides, true);
  }
  Tn scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

  void matmul(Tn a, Tn b, Tn c) {
    auto mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    fin(mm, "matmul");
    auto op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a.d);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b.d);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c.d);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
    fin(op, "matmul operation");
    ops_.push_back(op);
  }
  // y = mode(x [, b [, t]]); GEN_INDEX takes `axis`.
  void pointwise(cudnnPointwiseMode_t mode, Tn x, Tn y, const Tn* b = nullptr, const Tn* t = nullptr,
                 cudnnDataType_t prec = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    fin(pw, "pointwise");
    auto op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.d);
    if (b) set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b->d);
    if (t) set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t->d);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.d);
    fin(op, "pointwise operation");
    ops_.push_back(op);
  }
  void reduction(cudnnReduceTensorOp_t mode, Tn x, Tn y) {
    auto rd = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    fin(rd, "reduction");
    auto op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.d);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.d);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd);
    fin(op, "reduction operation");
    ops_.push_back(op);
  }
  void reshape(Tn x, Tn y) {
    auto op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.d);
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.d);
    fin(op, "reshape operation");
    ops_.push_back(op);
  }

  // The operation graph, then the first engine configuration (heuristics A, then fallback) whose
  // execution plan finalizes. Returns the plan and its workspace size.
  std::pair<cudnnBackendDescriptor_t, int64_t> plan() {
    auto graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
        static_cast<int64_t>(ops_.size()), ops_.data());
    fin(graph, "operation graph");
    std::string last = "no engine configuration";
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      auto heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
      set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      try {
        fin(heur, "heuristics");
      } catch (const Refused& r) {
        last = r.what;
        continue;
      }
      int64_t count = 0;
      check(api().get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
            "heuristics count");
      std::vector<cudnnBackendDescriptor_t> cfgs;
      for (int64_t i = 0; i < count; ++i) cfgs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      int64_t got = 0;
      if (count > 0)
        check(api().get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                        cfgs.data()),
              "heuristics results");
      for (int64_t i = 0; i < got; ++i) {
        auto plan = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        try {
          set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
          set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
          fin(plan, "execution plan");
        } catch (const Refused& r) {
          last = r.what;
          continue;
        }
        int64_t ws = 0, n = 0;
        check(api().get(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws),
              "workspace size");
        return {plan, ws};
      }
    }
    throw Refused{last};
  }

 private:
  cudnnHandle_t handle_;
  std::vector<cudnnBackendDescriptor_t> owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_uid_ = 100;
};

// B blocks of Sq query and Sk key rows, qs / ks rows apart (AttentionBlocks); dq_row / dkv_row: elements
// between consecutive tokens' rows of dQ and of dK, dV (H * D and KV * D when they are tensors of their own;
// the fused q/k/v gradient's width when they are its column blocks); causal or no mask.
struct Shape {
  int64_t B, Sq, Sk, qs, ks, H, KV, D, dq_row, dkv_row;
  bool causal;
  auto key() const { return std::make_tuple(B, Sq, Sk, qs, ks, H, KV, D, dq_row, dkv_row, causal); }
};

// Variants tried in order: statistics strided like our lse first (no conversion), then packed (B, H, S);
// in the backward, the causal mask after subtracting the statistics (cuDNN 9 frontends), then before.
struct Variant {
  bool packed_stats;
  bool mask_first;
};
constexpr Variant kVariants[] = {{false, false}, {false, true}, {true, false}, {true, true}};

struct Plan {
  std::unique_ptr<Graph> graph;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace = 0;
  Variant variant{};
  bool ok = false;
};

// Layouts shared by both graphs.
struct Layout {
  Dims q, q_str, kt, kt_str, v, v_str, s, s_str, st, st_str, red_str, dq_str, dkv_str;
  Layout(const Shape& x, bool packed_stats) {
    const int64_t B = x.B, Sq = x.Sq, Sk = x.Sk, H = x.H, KV = x.KV, D = x.D, qs = x.qs, ks = x.ks;
    q = {B, H, Sq, D}, q_str = {qs * H * D, D, H * D, 1};
    dq_str = {qs * x.dq_row, D, x.dq_row, 1}, dkv_str = {ks * x.dkv_row, D, x.dkv_row, 1};
    kt = {B, KV, D, Sk}, kt_str = {ks * KV * D, D, 1, KV * D};
    v = {B, KV, Sk, D}, v_str = {ks * KV * D, D, KV * D, 1};
    s = {B, H, Sq, Sk}, s_str = {H * Sq * Sk, Sq * Sk, Sk, 1};
    st = {B, H, Sq, 1}, red_str = {H * Sq, Sq, 1, 1};
    st_str = packed_stats ? red_str : Dims{qs * H, 1, H, 1};
  }
};

// mask ? s : -big, with mask = row >= col (top-left causal).
Tn causal(Graph& g, const Layout& L, Tn s, Tn neg) {
  Tn row = g.virt(CUDNN_DATA_INT32, L.s, L.s_str), col = g.virt(CUDNN_DATA_INT32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, row, nullptr, nullptr, CUDNN_DATA_INT32, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, col, nullptr, nullptr, CUDNN_DATA_INT32, 3);
  Tn mask = g.virt(CUDNN_DATA_BOOLEAN, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, mask, &col, nullptr, CUDNN_DATA_BOOLEAN);
  Tn out = g.virt(CUDNN_DATA_FLOAT, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, out, &neg, &mask);
  return out;
}

void build_forward(Graph& g, const Shape& x, Variant var) {
  const Layout L(x, var.packed_stats);
  const auto bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  Tn Q = g.tensor(kQ, bf, L.q, L.q_str, false), K = g.tensor(kK, bf, L.kt, L.kt_str, false);
  Tn V = g.tensor(kV, bf, L.v, L.v_str, false), O = g.tensor(kO, bf, L.q, L.q_str, false);
  Tn stats = g.tensor(kStats, f32, L.st, L.st_str, false);
  Tn scale = g.scalar(kScale);

  Tn s = g.virt(f32, L.s, L.s_str);
  g.matmul(Q, K, s);
  Tn ss = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_MUL, s, ss, &scale);
  Tn sm = x.causal ? causal(g, L, ss, g.scalar(kNegInf)) : ss;
  Tn mx = g.virt(f32, L.st, L.red_str);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, sm, mx);
  Tn sub = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_SUB, sm, sub, &mx);
  Tn ex = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_EXP, sub, ex);
  Tn sum = g.virt(f32, L.st, L.red_str);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
  Tn lg = g.virt(f32, L.st, L.red_str);
  g.pointwise(CUDNN_POINTWISE_LOG, sum, lg);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, stats, &lg);
  Tn p = g.virt(bf, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_DIV, ex, p, &sum);
  g.matmul(p, V, O);
}

void build_backward(Graph& g, const Shape& x, Variant var) {
  const Layout L(x, var.packed_stats);
  const int64_t B = x.B, Sq = x.Sq, Sk = x.Sk, H = x.H, KV = x.KV, D = x.D;
  const auto bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  const Dims full = {B, H, Sq, D}, full_str = {H * Sq * D, Sq * D, D, 1};
  const Dims sT_str = {H * Sq * Sk, Sq * Sk, 1, Sk};  // (b, h, kv pos, q pos) view of an (Sq, Sk) score block
  Tn Q = g.tensor(kQ, bf, L.q, L.q_str, false), K = g.tensor(kK, bf, L.kt, L.kt_str, false);
  Tn V = g.tensor(kV, bf, L.kt, L.kt_str, false);  // V^T, like K
  Tn O = g.tensor(kO, bf, L.q, L.q_str, false), dO = g.tensor(kDO, bf, L.q, L.q_str, false);
  Tn stats = g.tensor(kStats, f32, L.st, L.st_str, false);
  Tn dQ = g.tensor(kDQ, bf, L.q, L.dq_str, false);
  Tn dK = g.tensor(kDK, bf, L.v, L.dkv_str, false), dV = g.tensor(kDV, bf, L.v, L.dkv_str, false);
  Tn dsum = g.tensor(kSum, f32, L.st, L.red_str, false);
  Tn dq_acc = g.tensor(kDqAcc, f32, full, full_str, false);
  Tn scale = g.scalar(kScale), one = g.scalar(kOne);

  // Dsum = rowsum(dO * O)
  Tn m = g.virt(f32, full, {H * Sq * D, Sq * D, H * D, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, dO, m, &O);
  Tn r = g.virt(f32, L.st, L.red_str);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, m, r);
  g.pointwise(CUDNN_POINTWISE_MUL, r, dsum, &one);

  // P = exp(scale * Q K^T - stats), masked
  Tn s = g.virt(f32, L.s, L.s_str);
  g.matmul(Q, K, s);
  Tn ss = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_MUL, s, ss, &scale);
  Tn pre;
  if (x.causal && var.mask_first) {
    Tn sm = causal(g, L, ss, g.scalar(kNegInf));
    pre = g.virt(f32, L.s, L.s_str);
    g.pointwise(CUDNN_POINTWISE_SUB, sm, pre, &stats);
  } else {
    Tn sub = g.virt(f32, L.s, L.s_str);
    g.pointwise(CUDNN_POINTWISE_SUB, ss, sub, &stats);
    pre = x.causal ? causal(g, L, sub, g.scalar(kNegInf)) : sub;
  }
  Tn p = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_EXP, pre, p);

  // dV = P^T dO (per query head, then summed over each KV group)
  auto grad_kv = [&](Tn scores, Tn rhs, Tn out) {
    Tn t = g.virt(bf, {B, H, Sk, Sq}, sT_str);
    g.reshape(scores, t);
    if (H == KV) {
      g.matmul(t, rhs, out);
    } else {
      Tn f = g.virt(bf, {B, H, Sk, D}, {H * Sk * D, Sk * D, D, 1});
      g.matmul(t, rhs, f);
      g.reduction(CUDNN_REDUCE_TENSOR_ADD, f, out);
    }
  };
  grad_kv(p, dO, dV);

  // dS = P * (dO V^T - Dsum) * scale
  Tn dp = g.virt(f32, L.s, L.s_str);
  g.matmul(dO, V, dp);
  Tn d1 = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, d1, &dsum);
  Tn d2 = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_MUL, d1, d2, &p);
  Tn ds = g.virt(f32, L.s, L.s_str);
  g.pointwise(CUDNN_POINTWISE_MUL, d2, ds, &scale);

  grad_kv(ds, Q, dK);  // dK = dS^T Q

  // dQ = dS K, accumulated in fp32
  Tn k = g.virt(bf, L.v, L.v_str);
  g.reshape(K, k);
  g.matmul(ds, k, dq_acc);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_acc, dQ);
}

cudnnHandle_t handle_for_current_device() {
  static std::map<int, cudnnHandle_t> handles;
  int dev = 0;
  NDT_CUDA_CHECK(cudaGetDevice(&dev));
  auto it = handles.find(dev);
  if (it != handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t st = api().create(&h);
  if (st != CUDNN_STATUS_SUCCESS) return nullptr;
  return handles[dev] = h;
}

std::mutex g_mutex;

// The cached plan for (direction, device, shape), built on first use; nullptr when cuDNN refuses.
const Plan* plan_for(bool backward, const Shape& x, cudnnHandle_t h) {
  using Key = decltype(std::tuple_cat(std::make_tuple(false, cudnnHandle_t{}), Shape{}.key()));
  static std::map<Key, Plan> cache;
  const auto key = std::tuple_cat(std::make_tuple(backward, h), x.key());
  auto it = cache.find(key);
  if (it != cache.end()) return it->second.ok ? &it->second : nullptr;
  Plan p;
  std::string why;
  for (const Variant& var : kVariants) {
    if ((!backward || !x.causal) && var.mask_first) continue;  // (one mask position, or none)
    auto g = std::make_unique<Graph>(h);
    try {
      if (backward)
        build_backward(*g, x, var);
      else
        build_forward(*g, x, var);
      std::tie(p.plan, p.workspace) = g->plan();
      p.graph = std::move(g);
      p.variant = var;
      p.ok = true;
      break;
    } catch (const Refused& r) {
      if (why.empty()) why = r.what;
    }
  }
  if (!p.ok)
    std::fprintf(stderr,
                 "cuDNN attention %s refused B=%lld Sq=%lld Sk=%lld H=%lld KV=%lld D=%lld %s (%s); using the "
                 "built-in kernel\n",
                 backward ? "backward" : "forward", static_cast<long long>(x.B), static_cast<long long>(x.Sq),
                 static_cast<long long>(x.Sk), static_cast<long long>(x.H), static_cast<long long>(x.KV),
                 static_cast<long long>(x.D), x.causal ? "causal" : "unmasked", why.c_str());
  else if (std::getenv("NDT_CUDNN_DEBUG"))
    std::fprintf(stderr, "cuDNN attention %s: stats %s, mask %s, workspace %lld bytes\n",
                 backward ? "backward" : "forward", p.variant.packed_stats ? "packed" : "strided",
                 p.variant.mask_first ? "first" : "after stats", static_cast<long long>(p.workspace));
  auto [pos, inserted] = cache.emplace(key, std::move(p));
  return pos->second.ok ? &pos->second : nullptr;
}

bool usable(int64_t D) { return g_enabled && api().loaded && (D == 64 || D == 128); }

void execute(cudnnHandle_t h, const Plan& p, cudaStream_t stream, std::vector<int64_t> uids,
             std::vector<void*> ptrs, void* workspace) {
  Graph g(h);
  auto pack = g.make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  g.set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()),
        uids.data());
  g.set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()),
        ptrs.data());
  g.set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  g.fin(pack, "variant pack");
  check(api().set_stream(h, stream), "set stream");
  check(api().execute(h, p.plan, pack), "execute");
}

int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

bool valid(const AttentionBlocks& b) {
  return b.B > 0 && b.Sq > 0 && b.Sk > 0 && b.q_stride >= b.Sq && b.k_stride >= b.Sk &&
         (!b.causal || b.Sq == b.Sk);
}

Shape shape_of(const AttentionBlocks& b, int64_t H, int64_t KV, int64_t D, int64_t dq_row, int64_t dkv_row) {
  return Shape{b.B, b.Sq, b.Sk, b.q_stride, b.k_stride, H, KV, D, dq_row, dkv_row, b.causal};
}

// The packed (B, H, Sq) statistics <-> our lse rows (row b * q_stride + i of (rows, H)), block by block
// where the blocks are not back to back.
void stats_to_rows(float* lse, const float* stats, const AttentionBlocks& b, int64_t H, cudaStream_t stream) {
  if (b.q_stride == b.Sq) return lse_bhs_to_rows(lse, stats, b.B, b.Sq, H, stream);
  for (int64_t i = 0; i < b.B; ++i)
    lse_bhs_to_rows(lse + i * b.q_stride * H, stats + i * H * b.Sq, 1, b.Sq, H, stream);
}
void rows_to_stats(float* stats, const float* lse, const AttentionBlocks& b, int64_t H, cudaStream_t stream) {
  if (b.q_stride == b.Sq) return lse_rows_to_bhs(stats, lse, b.B, b.Sq, H, stream);
  for (int64_t i = 0; i < b.B; ++i)
    lse_rows_to_bhs(stats + i * H * b.Sq, lse + i * b.q_stride * H, 1, b.Sq, H, stream);
}

}  // namespace

bool cudnn_attention_enabled() { return g_enabled && api().loaded; }
std::string cudnn_attention_status() {
  if (!g_enabled) return "cuDNN attention disabled (NDT_ATTENTION=native)";
  return api().status;
}
void set_cudnn_attention_enabled(bool on) { g_enabled = on; }

bool cudnn_attention_forward_blocks(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q,
                                    const __nv_bfloat16* k, const __nv_bfloat16* v, const AttentionBlocks& b,
                                    int64_t H, int64_t KV, int64_t D, float scale, cudaStream_t stream) {
  if (!usable(D) || !valid(b) || H % KV != 0) return false;
  std::lock_guard<std::mutex> lock(g_mutex);
  cudnnHandle_t h = handle_for_current_device();
  if (!h) return false;
  const Plan* p = plan_for(false, shape_of(b, H, KV, D, H * D, KV * D), h);
  if (!p) return false;
  const int64_t stats_bytes = p->variant.packed_stats ? align256(b.B * b.Sq * H * 4) : 0;
  Scratch ws(static_cast<size_t>(align256(p->workspace) + stats_bytes), stream);
  float* stats =
      p->variant.packed_stats ? reinterpret_cast<float*>(ws.as<char>() + align256(p->workspace)) : lse;
  float s = scale, neg = -1e30f;
  std::vector<int64_t> uids = {kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs = {const_cast<__nv_bfloat16*>(q),
                             const_cast<__nv_bfloat16*>(k),
                             const_cast<__nv_bfloat16*>(v),
                             out,
                             stats,
                             &s};
  if (b.causal) uids.push_back(kNegInf), ptrs.push_back(&neg);
  try {
    execute(h, *p, stream, uids, ptrs, ws.as<char>());
  } catch (const Refused& r) {
    throw Error(fmt::format("cuDNN attention forward failed: {}", r.what));
  }
  if (p->variant.packed_stats) stats_to_rows(lse, stats, b, H, stream);
  return true;
}

bool cudnn_attention_backward_blocks(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                                     const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                     const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                     const float* lse, const AttentionBlocks& b, int64_t H, int64_t KV,
                                     int64_t D, float scale, cudaStream_t stream, int64_t dq_row,
                                     int64_t dkv_row) {
  if (!usable(D) || !valid(b) || H % KV != 0 || !dq || !dk || !dv) return false;
  std::lock_guard<std::mutex> lock(g_mutex);
  cudnnHandle_t h = handle_for_current_device();
  if (!h) return false;
  const Plan* p =
      plan_for(true, shape_of(b, H, KV, D, dq_row > 0 ? dq_row : H * D, dkv_row > 0 ? dkv_row : KV * D), h);
  if (!p) return false;
  // workspace | Dsum (B, H, Sq) | dQ accumulator (B, H, Sq, D) fp32 [| packed stats]
  const int64_t rows = b.B * b.Sq;
  const int64_t w0 = align256(p->workspace), w1 = align256(rows * H * 4), w2 = align256(rows * H * D * 4);
  const int64_t w3 = p->variant.packed_stats ? align256(rows * H * 4) : 0;
  Scratch ws(static_cast<size_t>(w0 + w1 + w2 + w3), stream);
  float* dsum = reinterpret_cast<float*>(ws.as<char>() + w0);
  float* acc = reinterpret_cast<float*>(ws.as<char>() + w0 + w1);
  const float* stats = lse;
  if (p->variant.packed_stats) {
    float* packed = reinterpret_cast<float*>(ws.as<char>() + w0 + w1 + w2);
    rows_to_stats(packed, lse, b, H, stream);
    stats = packed;
  }
  // cuDNN 9.6 and later initialise the dQ accumulator themselves (cudnn-frontend stopped clearing it then).
  if (api().version() < 90600)
    NDT_CUDA_CHECK(cudaMemsetAsync(acc, 0, static_cast<size_t>(rows * H * D * 4), stream));
  float s = scale, neg = -1e30f, one = 1.0f;
  std::vector<int64_t> uids = {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSum, kDqAcc, kScale, kOne};
  std::vector<void*> ptrs = {const_cast<__nv_bfloat16*>(q),
                             const_cast<__nv_bfloat16*>(k),
                             const_cast<__nv_bfloat16*>(v),
                             const_cast<__nv_bfloat16*>(out),
                             const_cast<__nv_bfloat16*>(dout),
                             const_cast<float*>(stats),
                             dq,
                             dk,
                             dv,
                             dsum,
                             acc,
                             &s,
                             &one};
  if (b.causal) uids.push_back(kNegInf), ptrs.push_back(&neg);
  try {
    execute(h, *p, stream, uids, ptrs, ws.as<char>());
  } catch (const Refused& r) {
    throw Error(fmt::format("cuDNN attention backward failed: {}", r.what));
  }
  return true;
}

bool cudnn_attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, int64_t B, int64_t S, int64_t H, int64_t KV, int64_t D,
                             float scale, cudaStream_t stream) {
  return cudnn_attention_forward_blocks(out, lse, q, k, v, AttentionBlocks{B, S, S, S, S, true}, H, KV, D,
                                        scale, stream);
}

bool cudnn_attention_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                              const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse, int64_t B,
                              int64_t S, int64_t H, int64_t KV, int64_t D, float scale, cudaStream_t stream,
                              int64_t dq_row, int64_t dkv_row) {
  return cudnn_attention_backward_blocks(dq, dk, dv, dout, q, k, v, out, lse,
                                         AttentionBlocks{B, S, S, S, S, true}, H, KV, D, scale, stream,
                                         dq_row, dkv_row);
}

}  // namespace ndt::cuda
#else  // built without cuDNN's headers: the built-in kernels serve every call

namespace ndt::cuda {
bool cudnn_attention_enabled() { return false; }
std::string cudnn_attention_status() { return "built without cuDNN headers (cudnn_graph.h)"; }
void set_cudnn_attention_enabled(bool) {}
bool cudnn_attention_forward(__nv_bfloat16*, float*, const __nv_bfloat16*, const __nv_bfloat16*,
                             const __nv_bfloat16*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                             cudaStream_t) {
  return false;
}
bool cudnn_attention_backward(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, const __nv_bfloat16*,
                              const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                              const __nv_bfloat16*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                              float, cudaStream_t, int64_t, int64_t) {
  return false;
}
bool cudnn_attention_forward_blocks(__nv_bfloat16*, float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                    const __nv_bfloat16*, const AttentionBlocks&, int64_t, int64_t, int64_t,
                                    float, cudaStream_t) {
  return false;
}
bool cudnn_attention_backward_blocks(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, const __nv_bfloat16*,
                                     const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                                     const __nv_bfloat16*, const float*, const AttentionBlocks&, int64_t,
                                     int64_t, int64_t, float, cudaStream_t, int64_t, int64_t) {
  return false;
}
}  // namespace ndt::cuda
#endif
