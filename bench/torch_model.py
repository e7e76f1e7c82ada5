#!/usr/bin/env python3
"""PyTorch twin of ndtrain's two model styles, its optimizer, schedule and data order (for bench/gpu_bench.sh).

Computes what src/model/transformer.cpp computes, parameter for parameter (the same names and shapes as
ndtrain's model.safetensors, so one file initializes both):
  gpt2:  learned positions, LayerNorm with bias, tanh-GELU MLP (fc, proj), biases on every linear except
         the key projection (ndtrain has no key bias: softmax ignores it), tied output head.
  llama: RMSNorm, rotate-half RoPE (pairs (i, i + D/2), angle = pos * theta^(-2i/D), angles in double),
         SwiGLU MLP (w2(silu(w1 x) * w3 x)), GQA (query head h uses kv head h // (H / KV)), untied head.
  both:  pre-norm residual blocks; attention scale 1/sqrt(D); loss = sum of token losses / tokens in the
         global batch (microbatches accumulate); AdamW (PyTorch semantics = ndtrain's: decoupled decay
         lr * wd on matrices only, not norms or biases; bias corrections per step); clipping of the global
         gradient norm; ndtrain's warmup + cosine schedule (lr_at); the batches ndtrain's sample_index picks.
Precision: bf16 autocast over fp32 weights (what a PyTorch user runs), or fp32. Attention:
F.scaled_dot_product_attention(is_causal=True), restricted to the flash backend on CUDA.

  torch_model.py train --config CFG.yaml [--set k=v ...] [--init model.safetensors] --out DIR
                       [--mode eager|compile] [--device cuda] [--precision bf16|fp32] [--steps N]
      writes DIR/metrics.jsonl: one {"type": "train", "step", "loss", "lr", "grad_norm", "step_seconds",
      "elapsed_seconds", "peak_mem_gib"} per step, the fields ndtrain's metrics.jsonl has.
  torch_model.py peak [--n 8192] [--trials 5] [--iters 20]
      prints {"peak_tflops": ...}: the best bf16 torch.matmul n x n x n throughput.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ndt_common import lr_at, read_config, read_shard_header, sample_index  # noqa: E402

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

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.H, self.D)
        k = self.wk(x).view(B, T, self.KV, self.D)
        v = self.wv(x).view(B, T, self.KV, self.D)
        if self.rope:
            q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 1.0 / math.sqrt(self.D),
                             self.gqa_native)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, f = cfg["model.d_model"], cfg.ffn_dim
        self.gpt2 = cfg.gpt2
        if self.gpt2:
            self.fc, self.proj = nn.Linear(c, f), nn.Linear(f, c)
        else:
            self.w1, self.w3, self.w2 = nn.Linear(c, f, bias=False), nn.Linear(c, f, bias=False), nn.Linear(f, c, bias=False)

    def forward(self, x):
        if self.gpt2:
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_norm(cfg):
    c, eps = cfg["model.d_model"], cfg["model.norm_eps"]
    return nn.LayerNorm(c, eps=eps) if cfg.gpt2 else RMSNorm(c, eps)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = make_norm(cfg), Attention(cfg), make_norm(cfg), MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


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
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg["model.n_layers"]))
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
                    s = proj_std if name.endswith(("attn.wo.weight", "mlp.proj.weight", "mlp.w2.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=g) * s)

    def forward(self, idx, targets):
        """idx, targets (B, T) int64. Returns the SUM of token losses (fp32)."""
        B, T = idx.shape
        x = self.embed.tokens(idx)
        if self.cfg.gpt2:
            x = x + self.embed.positions.weight[:T]
        for layer in self.layers:
            if self.recompute and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x = layer(x, self.rope_cos, self.rope_sin)
        x = self.final_norm(x)
        w = self.embed.tokens.weight if self.cfg.tied else self.lm_head.weight
        logits = F.linear(x, w)
        return F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), reduction="sum")


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
    fwd = torch.compile(model) if a.mode == "compile" else model
    bf16 = a.precision == "bf16"
    params = list(model.parameters())
    shuffle = bool(cfg.get("data.shuffle", True))

    os.makedirs(a.out, exist_ok=True)
    out = open(os.path.join(a.out, "metrics.jsonl"), "w")
    n_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed.positions"))
    print(f"torch {torch.__version__} {a.mode}: {cfg['model.style']} model, {n_params} parameters, "
          f"{gb} x {S} tokens/step (micro {mbs}), {a.precision}, device {dev}, "
          f"{'ndtrain init ' + a.init if a.init else 'own init (no ndtrain weights)'}", flush=True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        idx = [(step * gb + j) % data.size if not shuffle else
               sample_index(cfg["data.seed"], step, j, gb, data.size) for j in range(gb)]
        x_all, y_all = data.batch(idx)
        n_tokens = y_all.numel()  # every target of a shard sample bears loss
        loss_sum = torch.zeros((), device=dev)
        for m0 in range(0, gb, mbs):
            x = x_all[m0:m0 + mbs].to(dev, non_blocking=True)
            y = y_all[m0:m0 + mbs].to(dev, non_blocking=True)
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
                ls = fwd(x, y)
            (ls / n_tokens).backward()
            loss_sum += ls.detach()
        clip = cfg["train.grad_clip"]
        gnorm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        lr = lr_at(step, steps if a.schedule_steps is None else a.schedule_steps, cfg["train.warmup_steps"],
                   cfg["train.lr"], cfg["train.min_lr"])
        for gr in opt.param_groups:
            gr["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss_sum.item() / n_tokens  # waits for the step, like ndtrain reading its loss
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        rec = {"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": float(gnorm),
               "loss_tokens": n_tokens, "step_seconds": t1 - t0, "elapsed_seconds": t1 - start,
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0}
        out.write(json.dumps(rec) + "\n")
        out.flush()
        if step % a.log_every == 0 or step == steps - 1:
            print(f"step {step:5d}/{steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {float(gnorm):.3f} | "
                  f"{gb * S / (t1 - t0):,.0f} tok/s | step {1e3 * (t1 - t0):.1f} ms | "
                  f"mem {rec['peak_mem_gib']:.2f} GiB", flush=True)
    out.close()


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
    p = sub.add_parser("peak")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    train(a) if a.cmd == "train" else peak(a)


if __name__ == "__main__":
    main()
