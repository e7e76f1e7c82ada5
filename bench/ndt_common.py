"""Torch-free helpers shared by the GPU benchmark scripts (bench/torch_model.py, bench/bench_report.py).

Everything here mirrors ndtrain's C++ exactly, so that the PyTorch run sees the same model shape,
hyperparameters and batches as `ndtrain train`:
  - read_config: ndtrain's YAML configs (the block-mapping subset they use, nested sections such as
    model.moe included) + `--set a.b=v` overrides, with ndtrain's defaults (src/train/config.h) and
    derived sizes (ffn_dim, kv_heads, tied, the MoE layers and expert width);
  - sample_index: the data order (src/data/batch.cpp: Philox4x32-10 keyed Feistel permutation);
  - lr_at: the schedule (src/train/schedule.cpp);
  - token shards: the NDTSHARD format (src/data/shards.h);
  - flops_per_token: the model FLOPs the benchmark's MFU uses (MoE: the ACTIVE weights, matmul_params);
  - param_counts: total and active parameters.
Python standard library only.
"""
import math
import os
import struct

# ---- config -------------------------------------------------------------------------------------

# ndtrain's defaults (src/train/config.h) for the keys the benchmark reads.
DEFAULTS = {
    "model.style": "llama", "model.vocab_size": 320, "model.d_model": 128, "model.n_layers": 2,
    "model.n_heads": 4, "model.n_kv_heads": 0, "model.head_dim": 0, "model.d_ff": 0, "model.max_seq_len": 256,
    "model.rope_theta": 10000.0, "model.norm_eps": 1e-5, "model.tie_embeddings": -1, "model.init_std": 0.02,
    "model.qk_norm": False,
    "data.task": "addition", "data.path": "", "data.seq_len": 64, "data.seed": 1234, "data.packing": False,
    "train.seed": 42, "train.steps": 1000, "train.global_batch": 32, "train.micro_batch": 0,
    "train.lr": 1e-3, "train.min_lr": 1e-4, "train.warmup_steps": 50, "train.beta1": 0.9, "train.beta2": 0.95,
    "train.adam_eps": 1e-8, "train.weight_decay": 0.1, "train.grad_clip": 1.0, "train.recompute": False,
    "parallel.dp": 1,
    # model.moe (MoeConfig)
    "model.moe.num_experts": 0, "model.moe.top_k": 2, "model.moe.d_ff_expert": 0, "model.moe.shared_experts": 0,
    "model.moe.first_dense": 0, "model.moe.every": 1, "model.moe.router": "softmax", "model.moe.renormalize": True,
    "model.moe.aux_loss_coef": 0.01, "model.moe.z_loss_coef": 0.0, "model.moe.bias_update_rate": 1e-3,
    "model.moe.capacity_factor": 0.0,
}


def _scalar(text):
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def _strip_comment(line):
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"":
            quote = None if quote == ch else (quote or ch)
        elif ch == "#" and quote is None and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def parse_yaml_flat(path):
    """The subset of YAML ndtrain's configs use: block mappings of scalars, any depth (`model:` then
    `  moe:` then `    top_k: 2` gives "model.moe.top_k"); `preset: NAME` on top."""
    out = {}
    stack = []  # (indent, key) of the open mappings
    with open(path) as f:
        for raw in f:
            line = _strip_comment(raw.rstrip("\n")).rstrip()
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            key, sep, value = line.strip().partition(":")
            if not sep:
                raise ValueError(f"{path}: cannot parse line: {raw!r}")
            while stack and stack[-1][0] >= indent:
                stack.pop()
            name = ".".join([k for _, k in stack] + [key.strip()])
            if value.strip() == "":
                stack.append((indent, key.strip()))
            else:
                out[name] = _scalar(value)
    if "preset" in out:  # a preset's keys first, then this file's
        name = out.pop("preset")
        here = os.path.join(os.path.dirname(path), f"{name}.yaml")
        repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", f"{name}.yaml")
        base = parse_yaml_flat(here if os.path.exists(here) else repo)
        base.update(out)
        out = base
    return out


class Config(dict):
    """Dotted keys -> values, with ndtrain's defaults and derived model sizes."""

    @property
    def gpt2(self):
        return self["model.style"] == "gpt2"

    @property
    def head_dim(self):
        if self["model.head_dim"] > 0:
            return self["model.head_dim"]
        return self["model.d_model"] // self["model.n_heads"]

    @property
    def kv_heads(self):
        return self["model.n_kv_heads"] if self["model.n_kv_heads"] > 0 else self["model.n_heads"]

    @property
    def ffn_dim(self):
        if self["model.d_ff"] > 0:
            return self["model.d_ff"]
        c = self["model.d_model"]
        if self.gpt2:
            return 4 * c
        return (8 * c // 3 + 31) // 32 * 32  # ModelConfig::ffn_dim: 8C/3 rounded up to 32

    @property
    def tied(self):
        t = self["model.tie_embeddings"]
        return self.gpt2 if t < 0 else t != 0

    @property
    def moe(self):
        return self["model.moe.num_experts"] > 0

    def is_moe_layer(self, l):
        """ModelConfig::is_moe_layer: l >= first_dense and (l - first_dense) % every == 0."""
        first, every = self["model.moe.first_dense"], self["model.moe.every"]
        return self.moe and l >= first and (l - first) % every == 0

    @property
    def expert_ffn_dim(self):
        return self["model.moe.d_ff_expert"] if self["model.moe.d_ff_expert"] > 0 else self.ffn_dim

    @property
    def shared_ffn_dim(self):
        """Width of the shared experts' dense MLP (0: none)."""
        return self["model.moe.shared_experts"] * self.expert_ffn_dim if self.moe else 0

    @property
    def micro_batch(self):
        mb = self["train.micro_batch"]
        return mb if mb > 0 else self["train.global_batch"] // self["parallel.dp"]


def read_config(path, overrides=()):
    vals = dict(DEFAULTS)
    vals.update(parse_yaml_flat(path))
    for ov in overrides:
        k, sep, v = ov.partition("=")
        if not sep:
            raise ValueError(f"override {ov!r} must look like key=value")
        vals[k.strip()] = _scalar(v) if not isinstance(DEFAULTS.get(k.strip()), str) else v.strip()
    return Config(vals)


# ---- data order (src/data/batch.cpp, src/core/rng.cpp) -------------------------------------------

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def philox4x32(key, counter_hi, counter_lo):
    c0, c1 = counter_lo & _M32, (counter_lo >> 32) & _M32
    c2, c3 = counter_hi & _M32, (counter_hi >> 32) & _M32
    k0, k1 = key & _M32, (key >> 32) & _M32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        n0 = ((p1 >> 32) ^ c1 ^ k0) & _M32
        n2 = ((p0 >> 32) ^ c3 ^ k1) & _M32
        c1, c3 = p1 & _M32, p0 & _M32
        c0, c2 = n0, n2
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def philox_u64(seed, stream, index):
    r = philox4x32(seed & _M64, stream & _M64, index & _M64)
    return (r[0] << 32) | r[1]


def _feistel(x, half, seed, epoch):
    mask = (1 << half) - 1
    left, right = x >> half, x & mask
    for rnd in range(6):
        f = philox_u64(seed, (epoch * 8 + rnd + 0x5851F42D4C957F2D) & _M64, right) & mask
        left, right = right, left ^ f
    return (left << half) | right


def sample_index(data_seed, step, j, global_batch, dataset_size):
    """Index of the j-th sample of step `step` (ndt::sample_index)."""
    g = step * global_batch + j
    if dataset_size < 0:
        return g
    n = dataset_size
    epoch, x = divmod(g, n)
    bits = 2
    while (1 << bits) < n:
        bits += 2
    while True:
        x = _feistel(x, bits // 2, data_seed & _M64, epoch)
        if x < n:
            return x


# ---- schedule (src/train/schedule.cpp) -----------------------------------------------------------

def lr_at(step, total_steps, warmup_steps, lr, min_lr):
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# ---- token shards (src/data/shards.h) ------------------------------------------------------------

SHARD_MAGIC = b"NDTSHARD"
SHARD_HEADER = 64


def write_shard_header(f, num_tokens, vocab_size):
    tb = 2 if vocab_size <= 65536 else 4
    f.write(SHARD_MAGIC + struct.pack("<IIQQ", 1, tb, num_tokens, vocab_size) + bytes(32))
    return tb


def read_shard_header(path):
    with open(path, "rb") as f:
        h = f.read(SHARD_HEADER)
    if h[:8] != SHARD_MAGIC:
        raise ValueError(f"{path}: not an NDTSHARD token shard")
    version, tb, n, vocab = struct.unpack("<IIQQ", h[8:32])
    if version != 1 or tb not in (2, 4):
        raise ValueError(f"{path}: version {version} token_bytes {tb} not supported")
    return tb, n, vocab


# ---- FLOPs --------------------------------------------------------------------------------------

def matmul_params(cfg, active=True):
    """Weights that take part in matmuls: every layer's linear weights and the output head (tied or not).
    Embedding / position lookups, norms and biases are not counted. MoE layers: the router (E x C), the
    shared experts, and the routed experts' weights times top_k / E when `active` (the weights one token
    meets: what the FLOPs of a step are made of), all E experts otherwise."""
    c, hd, kv, f, L, v = (cfg["model.d_model"], cfg["model.n_heads"] * cfg.head_dim, cfg.kv_heads * cfg.head_dim,
                          cfg.ffn_dim, cfg["model.n_layers"], cfg["model.vocab_size"])
    mats = 2 if cfg.gpt2 else 3  # gpt2: fc, proj; llama: w1, w3, w2
    attn = c * hd + 2 * c * kv + hd * c
    total = v * c
    for l in range(L):
        total += attn
        if cfg.is_moe_layer(l):
            E, k = cfg["model.moe.num_experts"], cfg["model.moe.top_k"]
            expert = mats * c * cfg.expert_ffn_dim
            total += (k if active else E) * expert + E * c + mats * c * cfg.shared_ffn_dim
        else:
            total += mats * c * f
    return total


def param_counts(cfg):
    """(total, active) parameters as ndtrain's model holds them: embeddings (tokens; gpt2 also positions),
    untied head, norms (gpt2: with biases), linear biases (gpt2), routers; active counts top_k of the E
    routed experts of each MoE layer."""
    c, L, v = cfg["model.d_model"], cfg["model.n_layers"], cfg["model.vocab_size"]
    hd, kvd = cfg["model.n_heads"] * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    norm = 2 * c if cfg.gpt2 else c
    emb = v * c + (cfg["model.max_seq_len"] * c if cfg.gpt2 else 0) + (0 if cfg.tied else v * c)
    total = active = emb + norm  # + final norm

    def mlp(width):  # weights and (gpt2) biases of one dense MLP
        return (2 * c * width + width + c) if cfg.gpt2 else 3 * c * width

    for l in range(L):
        layer = 2 * norm + c * hd + 2 * c * kvd + hd * c + ((hd + kvd + c) if cfg.gpt2 else 0)  # no key bias
        if cfg.is_moe_layer(l):
            E, k = cfg["model.moe.num_experts"], cfg["model.moe.top_k"]
            expert = mlp(cfg.expert_ffn_dim)
            shared = mlp(cfg.shared_ffn_dim) if cfg.shared_ffn_dim else 0
            router = E * c + (E if cfg["model.moe.router"] == "sigmoid" else 0)  # + expert_bias
            total += layer + router + shared + E * expert
            active += layer + router + shared + k * expert
        else:
            total += layer + mlp(cfg.ffn_dim)
            active += layer + mlp(cfg.ffn_dim)
    return total, active


def flops_per_token(cfg, seq_len):
    """6 N + 6 L H D S: 6 FLOPs per matmul weight per token (forward 2, backward 4), plus causal attention:
    per layer and token the forward computes QK^T and PV over S/2 keys on average, 2 * 2 * (S/2) * H * D,
    and the backward twice that (PaLM's 12 L H D S counts the full, non-causal square). N is
    matmul_params(cfg, active=True): for an MoE model the ACTIVE weights (top_k of the E routed experts)."""
    return 6 * matmul_params(cfg) + 6 * cfg["model.n_layers"] * cfg["model.n_heads"] * cfg.head_dim * seq_len


def cuda_ms(fn, calls, warmup=3):
    """Milliseconds a call of fn takes on the GPU: `warmup` calls, then `calls` back to back between two
    CUDA events (no host synchronisation in between)."""
    import torch  # only the GPU benchmarks need it

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls
