#!/usr/bin/env python3
"""PyTorch twin of ndtrain's two model styles, its optimizer, schedule and data order (for bench/gpu_bench.sh).

Computes what src/model/transformer.cpp computes, parameter for parameter (the same names and shapes as
ndtrain's model.safetensors, so one file initializes both):
  gpt2:  learned positions, LayerNorm with bias, tanh-GELU MLP (fc, proj), biases on every linear except
         the key projection (ndtrain has no key bias: softmax ignores it), tied output head.
  llama: RMSNorm, rotate-half RoPE (pairs (i, i + D/2), angle = pos * theta^(-2i/D), angles in double),
         SwiGLU MLP (w2(silu(w1 x) * w3 x)), GQA (query head h uses kv head h // (H / KV)), untied head.
  MoE (llama style, model.moe.num_experts > 0; src/model/moe.cpp): in the MoE layers (model.moe.first_dense,
         every) the MLP is a router mlp.router.weight (E, C), fp32 logits of the block input rounded to the
         compute dtype, softmax, top-k (ties to the smaller expert), gates renormalized to sum 1
         (model.moe.renormalize), y_t = sum_j g_tj * w2_e(silu(w1_e x_t) * w3_e x_t) over the experts
         mlp.experts.{w1,w3,w2}.weight (E, F, C), (E, F, C), (E, C, F), plus the shared experts
         mlp.shared.{w1,w3,w2} (a dense SwiGLU MLP of width shared_experts * d_ff_expert). Dropless; softmax
         router only (no capacity factor, no sigmoid router). The objective adds per MoE layer the aux loss
         alpha E / S * sum_s sum_e c_se / (k T_s) * mean_{t in s} p_te (S sequences of the global batch,
         c_se slots of sequence s routed to e, a constant) and the z-loss beta / R * sum_t logsumexp(l_t)^2
         (R tokens of the global batch); the reported loss is the cross-entropy alone, as ndtrain's.
         Experts: torch._grouped_mm (bf16 on CUDA, when a probe in a subprocess passes; expert groups padded
         to multiples of 8 rows) or a loop over the experts (fp32, CPU, older torch, or a failed probe);
         NDT_TORCH_MOE_GEMM=auto|grouped|loop overrides; the log says which ran.
  both:  pre-norm residual blocks; attention scale 1/sqrt(D); loss = sum of token losses / tokens in the
         global batch (microbatches accumulate); AdamW (PyTorch semantics = ndtrain's: decoupled decay
         lr * wd on matrices only, not norms or biases; bias corrections per step); clipping of the global
         gradient norm; ndtrain's warmup + cosine schedule (lr_at); the batches ndtrain's sample_index picks.
Precision: bf16 autocast over fp32 weights (what a PyTorch user runs), or fp32. Attention:
F.scaled_dot_product_attention(is_causal=True), restricted to the flash backend on CUDA.

  torch_model.py train --config CFG.yaml [--set k=v ...] [--init model.safetensors] --out DIR
                       [--mode eager|compile] [--device cuda] [--precision bf16|fp32] [--steps N]
      writes DIR/metrics.jsonl: one {"type": "train", "step", "loss", "lr", "grad_norm", "step_seconds",
      "elapsed_seconds", "time", "peak_mem_gib"} per step ("time": Unix seconds at the step's end), the
      fields ndtrain's metrics.jsonl has (MoE models also "moe_aux_loss", "moe_z_loss",
      "expert_load_max_over_mean", "expert_load", as ndtrain).
  torch_model.py peak [--n 8192] [--trials 5] [--iters 20]
      prints {"peak_tflops": ...}: the best bf16 torch.matmul n x n x n throughput.
  torch_model.py probe-grouped-mm [--experts E --c C --f F]
      checks torch._grouped_mm (the MoE experts' path) against the per-expert loop, forward and backward, on
      CUDA in bf16; exit 0 when it matches (train runs it in a subprocess: a device-side assert there
      cannot take the training process down).
"""
import argparse
import importlib
import json
import math
import os
import struct
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ndt_common import lr_at, param_counts, read_config, read_shard_header, sample_index  # noqa: E402

HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")


# ---- model ---------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, c, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = eps

    def forward(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(max_seq_len, head_dim, theta):
    """cos, sin (S, D/2) in fp32 from angles computed in double, as ndtrain's rope kernels do."""
    half = head_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    inv_freq = torch.pow(torch.tensor(float(theta), dtype=torch.float64), -2.0 * i / head_dim)
    ang = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x, cos, sin):
    """x (B, T, H, D); rotate-half pairs (i, i + D/2); fp32 math, result in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def causal_attention(q, k, v, scale, gqa_native):
    """q (B, H, T, D), k/v (B, KV, T, D)."""
    H, KV = q.shape[1], k.shape[1]
    if HAVE_SDPA:
        if H != KV and gqa_native:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        if H != KV:
            k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    # torch < 2.0 (CPU checks only): explicit softmax attention.
    if H != KV:
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.float().masked_fill(mask, float("-inf")), dim=-1).to(v.dtype) @ v


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, self.H, self.KV, self.D = cfg["model.d_model"], cfg["model.n_heads"], cfg.kv_heads, cfg.head_dim
        b = cfg.gpt2
        self.wq = nn.Linear(c, self.H * self.D, bias=b)
        self.wk = nn.Linear(c, self.KV * self.D, bias=False)  # no key bias in either style
        self.wv = nn.Linear(c, self.KV * self.D, bias=b)
        self.wo = nn.Linear(self.H * self.D, c, bias=b)
        self.rope = not cfg.gpt2
        self.gqa_native = True
        # model.qk_norm (Qwen3): RMSNorm over D of every head of q and k, before RoPE.
        self.qk_norm = cfg["model.qk_norm"] and not cfg.gpt2
        if self.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.D, cfg["model.norm_eps"]), RMSNorm(self.D, cfg["model.norm_eps"])

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.H, self.D)
        k = self.wk(x).view(B, T, self.KV, self.D)
        v = self.wv(x).view(B, T, self.KV, self.D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 1.0 / math.sqrt(self.D),
                             self.gqa_native)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, cfg, width=None):
        super().__init__()
        c, f = cfg["model.d_model"], width or cfg.ffn_dim
        self.gpt2 = cfg.gpt2
        if self.gpt2:
            self.fc, self.proj = nn.Linear(c, f), nn.Linear(f, c)
        else:
            self.w1, self.w3, self.w2 = nn.Linear(c, f, bias=False), nn.Linear(c, f, bias=False), nn.Linear(f, c, bias=False)

    def forward(self, x):
        if self.gpt2:
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---- Mixture of Experts ---------------------------------------------------------------------------

GROUP_ALIGN = 8  # grouped GEMM: rows of each expert group padded to a multiple of this (16 bytes of bf16)


def route_rows(flat, E, align):
    """Rows of an expert-grouped buffer for the R = N k slots (flat (R): expert of slot t k + j). Expert e's
    slots fill rows [start_e, start_e + count_e) in slot order, i.e. the buffer is sorted by (expert, token,
    slot) as ndtrain's permutation. align > 1: each group is padded to a multiple of align rows (at least
    align: no empty group) and the last group takes the slack up to a static size R + E align (rounded up).
    No host synchronization. Returns slot_row (R) int64, group ends (E) int64, counts (E) int64, rows, and
    the (R, E) one-hot of the choices."""
    R = flat.numel()
    onehot = (flat[:, None] == torch.arange(E, device=flat.device)).long()  # (R, E); no host sync
    cum = onehot.cumsum(0)
    counts = cum[-1]
    rank = cum.gather(1, flat[:, None]).squeeze(1) - 1  # slots of the same expert before this one
    if align > 1:
        size = ((counts + align - 1) // align * align).clamp_min(align)
        rows = (R + E * align + align - 1) // align * align
    else:
        size, rows = counts, R
    ends = torch.cumsum(size, 0)
    slot_row = (ends - size)[flat] + rank
    if align > 1:
        ends = torch.cat([ends[:-1], ends.new_full((1,), rows)])
    return slot_row, ends, counts, rows, onehot


def experts_grouped(xk, slot_row, ends, rows, w1, w3, w2):
    """xk (R, C): the input of each slot; w1, w3 (E, F, C), w2 (E, C, F) in xk's dtype (bf16).
    Three torch._grouped_mm over the padded expert-grouped buffer; returns (R, C), each slot's expert output."""
    offs = ends.to(torch.int32)
    xb = xk.new_zeros(rows, xk.shape[1]).index_copy(0, slot_row, xk)
    # mat_b (E, K, N) as the transposed (column-major) view of the (E, N, K) weights: the layout
    # torch._grouped_mm's tests use and nn.Linear's, no copy.
    h1 = torch._grouped_mm(xb, w1.transpose(-2, -1), offs=offs)
    h3 = torch._grouped_mm(xb, w3.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(h1) * h3, w2.transpose(-2, -1), offs=offs)
    return y.index_select(0, slot_row)


def _experts_loop(xk, slot_row, counts, w1, w3, w2):
    """The per-expert loop (one host sync for the counts); same contract as experts_grouped, unpadded rows."""
    xs = torch.zeros_like(xk).index_copy(0, slot_row, xk)
    outs, row = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            h = xs[row:row + n]
            outs.append(F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e]))
        row += n
    return torch.cat(outs).index_select(0, slot_row)


# Under torch.compile the loop runs eagerly (its sizes change every step: compiling it would recompile).
_compiler_disable = getattr(getattr(torch, "compiler", None), "disable", None)
experts_loop = _compiler_disable(_experts_loop) if _compiler_disable else _experts_loop


class ExpertWeight(nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class Experts(nn.Module):
    def __init__(self, E, f, c):
        super().__init__()
        self.w1, self.w3, self.w2 = ExpertWeight(E, f, c), ExpertWeight(E, f, c), ExpertWeight(E, c, f)


class MoE(nn.Module):
    """ndtrain's MoeLayer (llama style, softmax router, dropless) + shared experts. forward(x (B, T, C)) ->
    (y (B, T, C), aux + z loss (fp32 scalar, normalized over the global batch), stats (E + 2) detached:
    slots per expert, aux, z)."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.gpt2:
            raise SystemExit("torch_model.py: MoE is implemented for model.style llama only")
        if cfg["model.moe.router"] != "softmax":
            raise SystemExit("torch_model.py: MoE needs model.moe.router softmax (the sigmoid router's expert "
                             "bias is updated outside the gradient; not implemented here)")
        if cfg["model.moe.capacity_factor"] > 0:
            raise SystemExit("torch_model.py: MoE is dropless here: model.moe.capacity_factor must be 0")
        c = cfg["model.d_model"]
        self.E, self.k, f = cfg["model.moe.num_experts"], cfg["model.moe.top_k"], cfg.expert_ffn_dim
        self.renormalize = bool(cfg["model.moe.renormalize"])
        self.aux_coef, self.z_coef = float(cfg["model.moe.aux_loss_coef"]), float(cfg["model.moe.z_loss_coef"])
        self.router = nn.Linear(c, self.E, bias=False)
        self.experts = Experts(self.E, f, c)
        self.shared = MLP(cfg, cfg.shared_ffn_dim) if cfg.shared_ffn_dim > 0 else None
        # Set by train(): the compute dtype (bf16 under autocast), the expert GEMM path, and the global
        # batch's sequences and tokens that the aux and z losses are means over.
        self.compute_dtype = torch.float32
        self.gemm = "loop"
        self.norm_seqs, self.norm_tokens = 1.0, 1.0

    def forward(self, x):
        B, T, C = x.shape
        N, E, k, dt = B * T, self.E, self.k, self.compute_dtype
        xc = x.reshape(N, C).to(dt)  # ndtrain's MoE input: the norm's output in the compute dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(xc.float(), self.router.weight.float())  # (N, E) fp32
            p = torch.softmax(logits, dim=-1)
            # top-k, ties to the smaller expert: a stable descending sort keeps equal scores in index order
            top_p, top_e = torch.sort(p, dim=-1, descending=True, stable=True)
            top_p, top_e = top_p[:, :k], top_e[:, :k]
            gates = top_p / top_p.sum(-1, keepdim=True) if self.renormalize else top_p
            flat = top_e.reshape(N * k)
            slot_row, ends, counts, rows, onehot = route_rows(flat, E, GROUP_ALIGN if self.gemm == "grouped" else 1)
            aux = logits.new_zeros(())
            z = logits.new_zeros(())
            if self.aux_coef > 0:
                c_se = onehot.view(B, T * k, E).sum(1).float()  # slots of sequence s routed to e (constant)
                P = p.view(B, T, E).mean(1)  # mean balancing probability of e over the tokens of s
                aux = self.aux_coef * E / self.norm_seqs * (c_se / (k * T) * P).sum()
            if self.z_coef > 0:
                lse = torch.logsumexp(logits, dim=-1)
                z = self.z_coef / self.norm_tokens * (lse * lse).sum()
        w1, w3, w2 = (m.weight.to(dt) for m in (self.experts.w1, self.experts.w3, self.experts.w2))
        xk = xc.unsqueeze(1).expand(N, k, C).reshape(N * k, C)  # slot t k + j: token t
        if self.gemm == "grouped":
            ys = experts_grouped(xk, slot_row, ends, rows, w1, w3, w2)
        else:
            ys = experts_loop(xk, slot_row, counts, w1, w3, w2)
        y = (ys.view(N, k, C).float() * gates.unsqueeze(-1)).sum(1).to(dt)  # gates in fp32, as ndtrain
        if self.shared is not None:
            y = y + self.shared(xc)
        stats = torch.cat([counts.float(), aux.detach().view(1), z.detach().view(1)])
        return y.view(B, T, C), aux + z, stats


def probe_grouped_mm(a):
    """Subprocess check of the grouped path (see the module docstring); prints one line, exit 0 = usable."""
    if not hasattr(torch, "_grouped_mm"):
        print(f"torch {torch.__version__} has no torch._grouped_mm")
        sys.exit(1)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    E, C, Fd = a.experts, a.c, a.f
    # Uneven groups: an empty one, sizes that are not multiples of 8.
    sizes = [0, 1, 37, 5, 130, 3, 64, 17] * ((E + 7) // 8)
    flat = torch.cat([torch.full((n,), e, dtype=torch.long) for e, n in enumerate(sizes[:E])])
    flat = flat[torch.randperm(flat.numel())].to(dev)
    R = flat.numel()
    x = torch.randn(R, C, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(E, Fd, C, device=dev) * C ** -0.5, torch.randn(E, Fd, C, device=dev) * C ** -0.5,
          torch.randn(E, C, Fd, device=dev) * Fd ** -0.5]
    dy = torch.randn(R, C, device=dev, dtype=torch.bfloat16)
    results = []
    for path in ("grouped", "loop"):
        xi = x.clone().requires_grad_(True)
        wi = [w.clone().requires_grad_(True) for w in ws]
        slot_row, ends, counts, rows, _ = route_rows(flat, E, GROUP_ALIGN if path == "grouped" else 1)
        wb = [w.to(torch.bfloat16) for w in wi]
        if path == "grouped":
            y = experts_grouped(xi, slot_row, ends, rows, *wb)
        else:
            y = _experts_loop(xi, slot_row, counts, *wb)
        y.backward(dy)
        torch.cuda.synchronize()
        results.append([y.float(), xi.grad.float()] + [w.grad for w in wi])
    worst = 0.0
    for name, g, r in zip(("y", "dx", "dw1", "dw3", "dw2"), *results):
        err = ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, err)
        if not math.isfinite(err) or err > 2e-2:
            print(f"torch._grouped_mm differs from the loop: {name} max error {err:.3g} (relative to max |ref|)")
            sys.exit(1)
    print(f"torch._grouped_mm ok (torch {torch.__version__}, E {E} C {C} F {Fd}, worst relative error "
          f"{worst:.2e} vs the loop)")


def choose_expert_gemm(cfg, dev, bf16):
    """('grouped' | 'loop', why)."""
    want = os.environ.get("NDT_TORCH_MOE_GEMM", "auto")
    if want == "loop":
        return "loop", "NDT_TORCH_MOE_GEMM=loop"
    if not hasattr(torch, "_grouped_mm"):
        return "loop", f"torch {torch.__version__} has no torch._grouped_mm"
    if dev.type != "cuda" or not bf16:
        return "loop", "torch._grouped_mm's kernel is bf16 on CUDA"
    if want == "grouped":
        return "grouped", "NDT_TORCH_MOE_GEMM=grouped (no probe)"
    cmd = [sys.executable, os.path.abspath(__file__), "probe-grouped-mm", "--experts",
           str(cfg["model.moe.num_experts"]), "--c", str(cfg["model.d_model"]), "--f", str(cfg.expert_ffn_dim)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as ex:
        return "loop", f"grouped-GEMM probe did not run: {ex}"
    out = (r.stdout + r.stderr).strip().splitlines()
    if r.returncode == 0:
        return "grouped", out[-1] if out else "probe passed"
    return "loop", f"grouped-GEMM probe failed (exit {r.returncode}): " + " | ".join(out[-3:])


def make_norm(cfg):
    c, eps = cfg["model.d_model"], cfg["model.norm_eps"]
    return nn.LayerNorm(c, eps=eps) if cfg.gpt2 else RMSNorm(c, eps)


class Block(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm = make_norm(cfg), Attention(cfg), make_norm(cfg)
        self.moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg) if self.moe else MLP(cfg)

    def forward(self, x, cos, sin):
        """-> (x, aux loss, MoE stats); the last two None in a dense layer."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if not self.moe:
            return x + self.mlp(self.mlp_norm(x)), None, None
        y, aux, stats = self.mlp(self.mlp_norm(x))
        return x + y, aux, stats


class Embed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tokens = nn.Embedding(cfg["model.vocab_size"], cfg["model.d_model"])
        if cfg.gpt2:
            self.positions = nn.Embedding(cfg["model.max_seq_len"], cfg["model.d_model"])


class Transformer(nn.Module):
    """Module paths are ndtrain's parameter names: embed.tokens.weight, layers.3.attn.wq.bias, ..."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.layers = nn.ModuleList(Block(cfg, l) for l in range(cfg["model.n_layers"]))
        self.final_norm = make_norm(cfg)
        if not cfg.tied:
            self.lm_head = nn.Linear(cfg["model.d_model"], cfg["model.vocab_size"], bias=False)
        cos, sin = rope_tables(cfg["model.max_seq_len"], cfg.head_dim, cfg["model.rope_theta"])
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.recompute = False

    def init_like_ndtrain(self, seed):
        """Same distributions as ndtrain (normal std init_std, residual projections / sqrt(2 L), norms 1,
        biases 0), not the same values: used only when no ndtrain initial weights are given."""
        g = torch.Generator().manual_seed(seed)
        std = self.cfg["model.init_std"]
        proj_std = std / math.sqrt(2.0 * self.cfg["model.n_layers"])
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                else:
                    s = proj_std if name.endswith(("attn.wo.weight", "mlp.proj.weight", "mlp.w2.weight",
                                                   "experts.w2.weight", "shared.w2.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=g) * s)

    def forward(self, idx, targets):
        """idx, targets (B, T) int64. Returns (the SUM of token losses (fp32), the MoE layers' aux + z losses
        (fp32 scalar, already a global-batch mean) or None, their stats (layers, E + 2) or None)."""
        B, T = idx.shape
        x = self.embed.tokens(idx)
        if self.cfg.gpt2:
            x = x + self.embed.positions.weight[:T]
        aux, stats = None, []
        for layer in self.layers:
            if self.recompute and self.training:
                x, a, st = torch.utils.checkpoint.checkpoint(layer, x, self.rope_cos, self.rope_sin,
                                                             use_reentrant=False)
            else:
                x, a, st = layer(x, self.rope_cos, self.rope_sin)
            if a is not None:
                aux = a if aux is None else aux + a
                stats.append(st)
        x = self.final_norm(x)
        w = self.embed.tokens.weight if self.cfg.tied else self.lm_head.weight
        logits = F.linear(x, w)
        ce = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), reduction="sum")
        return ce, aux, (torch.stack(stats) if stats else None)


# ---- safetensors (F32 / BF16, enough for ndtrain's model.safetensors) ---------------------------

def load_safetensors(path):
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dt = {"F32": torch.float32, "BF16": torch.bfloat16}[info["dtype"]]
            b, e = info["data_offsets"]
            f.seek(base + b)
            buf = bytearray(f.read(e - b))
            out[name] = torch.frombuffer(buf, dtype=dt).reshape(info["shape"]).float()
    return out


def load_init(model, path):
    sd = load_safetensors(path)
    own = dict(model.named_parameters())
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or extra:
        raise SystemExit(f"{path}: parameter names differ from the torch model: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    with torch.no_grad():
        for name, p in own.items():
            if tuple(sd[name].shape) != tuple(p.shape):
                raise SystemExit(f"{path}: {name} has shape {tuple(sd[name].shape)}, torch model {tuple(p.shape)}")
            p.copy_(sd[name])


# ---- data ----------------------------------------------------------------------------------------

class ShardData:
    """ndtrain's ShardDataset over one .bin file: sample i = tokens [i S, i S + S + 1), every target bears loss."""

    def __init__(self, path, seq_len):
        tb, n, _ = read_shard_header(path)
        with open(path, "rb") as f:
            f.seek(64)
            buf = bytearray(f.read(n * tb))
        raw = torch.frombuffer(buf, dtype=torch.int16 if tb == 2 else torch.int32)
        self.tokens = (raw.to(torch.int32) & 0xFFFF).long() if tb == 2 else raw.long()
        self.seq_len = seq_len
        self.size = (n - 1) // seq_len

    def batch(self, indices):
        S = self.seq_len
        rows = torch.stack([self.tokens[i * S: i * S + S + 1] for i in indices])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# ---- training ------------------------------------------------------------------------------------

def train(a):
    cfg = read_config(a.config, a.set)
    if cfg["data.task"] != "shards" or cfg["data.packing"]:
        raise SystemExit("torch_model.py trains on data.task shards without packing")
    steps = a.steps if a.steps is not None else cfg["train.steps"]
    gb, mbs, S = cfg["train.global_batch"], cfg.micro_batch, cfg["data.seq_len"]
    if cfg["parallel.dp"] != 1 or gb % mbs:
        raise SystemExit("torch_model.py runs one process: parallel.dp must be 1 and micro_batch divide global_batch")
    dev = torch.device(a.device)
    torch.manual_seed(0)
    data = ShardData(a.data or cfg["data.path"], S)

    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 mode stays fp32; bf16 autocast is unaffected
        if a.attention == "flash" and HAVE_SDPA and a.precision == "bf16":  # flash has no fp32 kernels
            torch.backends.cuda.enable_flash_sdp(True)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_math_sdp(False)
            if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
                torch.backends.cuda.enable_cudnn_sdp(False)
    model = Transformer(cfg)
    if a.init:
        load_init(model, a.init)
    else:
        model.init_like_ndtrain(cfg["train.seed"])
    model.to(dev)
    model.recompute = bool(cfg["train.recompute"])
    if cfg.kv_heads != cfg["model.n_heads"] and HAVE_SDPA:  # use SDPA's native GQA where the backend has it
        try:
            q = torch.zeros(1, 4, 16, cfg.head_dim, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
            kv = q[:, :2]
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        except Exception:  # noqa: BLE001 (older torch or a backend without GQA)
            for m in model.modules():
                if isinstance(m, Attention):
                    m.gqa_native = False
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]  # ndtrain: matrices decay
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]  # norms, biases
    opt_kw = dict(lr=cfg["train.lr"], betas=(cfg["train.beta1"], cfg["train.beta2"]), eps=cfg["train.adam_eps"])
    if dev.type == "cuda":
        opt_kw["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["train.weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kw)
    bf16 = a.precision == "bf16"
    moe_layers = [l for l, b in enumerate(model.layers) if b.moe]
    if moe_layers:
        # The expert GEMM path: torch._grouped_mm if a probe in a subprocess passes, else the per-expert loop.
        gemm, why = choose_expert_gemm(cfg, dev, bf16)
        set_moe(model, gemm, torch.bfloat16 if bf16 else torch.float32, gb, gb * S)
        print(f"MoE experts: {'torch._grouped_mm' if gemm == 'grouped' else 'per-expert loop'} ({why})", flush=True)
    fwd = (torch.compile(model, mode=a.compile_mode) if a.compile_mode else torch.compile(model)) \
        if a.mode == "compile" else model
    params = list(model.parameters())
    shuffle = bool(cfg.get("data.shuffle", True))

    os.makedirs(a.out, exist_ok=True)
    out = open(os.path.join(a.out, "metrics.jsonl"), "w")
    n_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed.positions"))
    if moe_layers:
        total, active = param_counts(cfg)
        n_desc = (f"{n_params} parameters ({active} active: top-{cfg['model.moe.top_k']} of "
                  f"{cfg['model.moe.num_experts']} experts in {len(moe_layers)} MoE layers)")
    else:
        n_desc = f"{n_params} parameters"
    print(f"torch {torch.__version__} {a.mode}: {cfg['model.style']} model, {n_desc}, "
          f"{gb} x {S} tokens/step (micro {mbs}), {a.precision}, device {dev}, "
          f"{'ndtrain init ' + a.init if a.init else 'own init (no ndtrain weights)'}", flush=True)

    def forward_backward(x_all, y_all, n_tokens):
        """All microbatches of a step: gradients accumulated; (sum of token losses, MoE stats or None)."""
        loss_sum = torch.zeros((), device=dev)
        moe_stats = None
        for m0 in range(0, gb, mbs):
            x = x_all[m0:m0 + mbs].to(dev, non_blocking=True)
            y = y_all[m0:m0 + mbs].to(dev, non_blocking=True)
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
                ls, aux, st = fwd(x, y)
            obj = ls / n_tokens
            if aux is not None:
                obj = obj + aux  # aux / z losses: already means over the global batch
            obj.backward()
            loss_sum += ls.detach()
            if st is not None:
                moe_stats = st if moe_stats is None else moe_stats + st
        return loss_sum, moe_stats

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start, start_unix = time.perf_counter(), time.time()
    pending, t_first = [], start
    for step in range(steps):
        t0 = time.perf_counter()
        idx = [(step * gb + j) % data.size if not shuffle else
               sample_index(cfg["data.seed"], step, j, gb, data.size) for j in range(gb)]
        x_all, y_all = data.batch(idx)
        n_tokens = y_all.numel()  # every target of a shard sample bears loss
        try:
            loss_sum, moe_stats = forward_backward(x_all, y_all, n_tokens)
        except Exception as ex:  # noqa: BLE001
            # The grouped expert GEMM failing at the real sizes (or under torch.compile): the per-expert loop.
            if step > 0 or not moe_layers or model.layers[moe_layers[0]].mlp.gemm != "grouped":
                raise
            print(f"MoE experts: torch._grouped_mm failed in step 0 ({type(ex).__name__}: "
                  f"{str(ex).strip().splitlines()[0] if str(ex).strip() else ''}); "
                  "falling back to the per-expert loop", flush=True)
            opt.zero_grad(set_to_none=True)
            set_moe(model, "loop", torch.bfloat16 if bf16 else torch.float32, gb, gb * S)
            if a.mode == "compile":
                importlib.import_module("torch._dynamo").reset()  # (no `import torch...` here: torch would go local)
                fwd = torch.compile(model, mode=a.compile_mode) if a.compile_mode else torch.compile(model)
            loss_sum, moe_stats = forward_backward(x_all, y_all, n_tokens)
            print("MoE experts: per-expert loop (after the grouped GEMM failed)", flush=True)
        clip = cfg["train.grad_clip"]
        gnorm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        lr = lr_at(step, steps if a.schedule_steps is None else a.schedule_steps, cfg["train.warmup_steps"],
                   cfg["train.lr"], cfg["train.min_lr"])
        for gr in opt.param_groups:
            gr["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        # --sync-every 1 reads the loss back every step, as ndtrain does ("same semantics"); N > 1 keeps the
        # step's numbers on the device and reads the last N back together ("fastest": no per-step sync).
        if not pending:
            t_first = t0
        pending.append((step, lr, n_tokens, loss_sum.detach(), gnorm.detach(), moe_stats))
        if a.sync_every > 1 and (step + 1) % a.sync_every != 0 and step != steps - 1:
            continue
        losses = torch.stack([p[3] for p in pending]).double().cpu().tolist()  # one wait for the device
        gnorms = torch.stack([p[4] for p in pending]).double().cpu().tolist()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        per_step = (t1 - t_first) / len(pending)  # the steps since the last read-back share its wall time
        for i, (st_step, st_lr, st_tokens, _, _, st_moe) in enumerate(pending):
            write_record(out, a, st_step, steps, st_lr, st_tokens, losses[i] / st_tokens, gnorms[i], st_moe,
                         per_step, t_first + per_step * (i + 1) - start, gb * S, dev, moe_layers, cfg,
                         start_unix)
        pending = []
    out.close()


def write_record(out, a, step, steps, lr, n_tokens, loss, gnorm, moe_stats, step_s, elapsed, tokens, dev, moe_layers,
                 cfg, start_unix):
    """One metrics.jsonl record (ndtrain's fields) and, at log steps, the progress line."""
    rec = {"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": gnorm,
           "loss_tokens": n_tokens, "step_seconds": step_s, "elapsed_seconds": elapsed,
           "time": start_unix + elapsed,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0}
    moe_note = ""
    if moe_stats is not None:  # as ndtrain's metrics: values over the global batch, coefficients applied
        E = cfg["model.moe.num_experts"]
        st = moe_stats.double().cpu().tolist()
        ratios = [max(r[:E]) / (sum(r[:E]) / E) for r in st if sum(r[:E]) > 0]
        rec["moe_aux_loss"] = sum(r[E] for r in st)
        rec["moe_z_loss"] = sum(r[E + 1] for r in st)
        rec["expert_load_max_over_mean"] = max(ratios) if ratios else 0.0
        rec["expert_load"] = {str(l): r[:E] for l, r in zip(moe_layers, st)}
        moe_note = (f" | aux {rec['moe_aux_loss']:.4f} z {rec['moe_z_loss']:.4f} | "
                    f"load max/mean {rec['expert_load_max_over_mean']:.2f}")
    out.write(json.dumps(rec) + "\n")
    out.flush()
    if step % a.log_every == 0 or step == steps - 1:
        print(f"step {step:5d}/{steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {gnorm:.3f} | "
              f"{tokens / step_s:,.0f} tok/s | step {1e3 * step_s:.1f} ms | "
              f"mem {rec['peak_mem_gib']:.2f} GiB{moe_note}", flush=True)


def set_moe(model, gemm, compute_dtype, seqs, tokens):
    for m in model.modules():
        if isinstance(m, MoE):
            m.gemm, m.compute_dtype, m.norm_seqs, m.norm_tokens = gemm, compute_dtype, float(seqs), float(tokens)


def peak(a):
    dev = torch.device("cuda")
    x = torch.randn(a.n, a.n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(a.n, a.n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(x, y)
    best = 0.0
    for _ in range(a.trials):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.iters):
            torch.matmul(x, y)
        e1.record()
        torch.cuda.synchronize()
        best = max(best, 2.0 * a.n ** 3 * a.iters / (e0.elapsed_time(e1) * 1e-3) / 1e12)
    print(json.dumps({"peak_tflops": best, "n": a.n, "dtype": "bf16", "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--config", required=True, help="ndtrain YAML (an effective config.yaml of a run is best)")
    t.add_argument("--set", nargs="*", default=[], help="overrides key=value, as ndtrain's --set")
    t.add_argument("--init", default="", help="ndtrain model.safetensors to start from (e.g. a train.steps=0 run)")
    t.add_argument("--data", default="", help="token shard (default: data.path of the config)")
    t.add_argument("--out", required=True)
    t.add_argument("--mode", choices=["eager", "compile"], default="eager")
    t.add_argument("--device", default="cuda")
    t.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    t.add_argument("--attention", choices=["flash", "auto"], default="flash",
                   help="flash: only SDPA's flash backend on CUDA; auto: let PyTorch pick")
    t.add_argument("--steps", type=int, default=None, help="steps to run (default train.steps)")
    t.add_argument("--schedule-steps", type=int, default=None,
                   help="total steps of the lr schedule (default: the steps run, as ndtrain's train.steps)")
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--sync-every", type=int, default=1,
                   help="read the loss back every N steps (1: every step, as ndtrain; N > 1: no per-step sync)")
    t.add_argument("--compile-mode", default="",
                   help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: torch's default)")
    p = sub.add_parser("peak")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    g = sub.add_parser("probe-grouped-mm")
    g.add_argument("--experts", type=int, default=16)
    g.add_argument("--c", type=int, default=1024)
    g.add_argument("--f", type=int, default=1408)
    a = ap.parse_args()
    {"train": train, "peak": peak, "probe-grouped-mm": probe_grouped_mm}[a.cmd](a)


if __name__ == "__main__":
    main()
