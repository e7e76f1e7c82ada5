#!/usr/bin/env python3
"""The 1B Llama's attention (configs/llama-1b.yaml: 4 x 2048 tokens a microbatch, 32 query heads of 64, 8 KV
heads, causal, bf16), forward + backward through each of PyTorch's SDPA backends and FlashAttention-3 where it
is installed, N calls back to back on one stream (CUDA events): what the best attention this machine offers
costs, against ndtrain's cuDNN call in the step (an `ndtrain train --kernel-trace` of the same model;
docs/performance.md, session 47). FLOPs: causal forward 2 * B * H * S^2 * D, the backward 2.5 times that.
Usage: attention_backends.py [CALLS]"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ndt_common import cuda_ms  # noqa: E402

B, H, HKV, S, D, CALLS_A_STEP = 4, 32, 8, 2048, 64, 32  # 16 layers x 2 microbatches


def report(name, ms):
    flops = 2 * B * H * S * S * D * 3.5
    print(f"{name:>28}: {ms:.3f} ms a call (forward + backward), {flops / ms / 1e9:.0f} TFLOP/s, "
          f"{CALLS_A_STEP * ms:.1f} ms a step")


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    bf = torch.bfloat16
    q = torch.randn(B, H, S, D, device="cuda", dtype=bf, requires_grad=True)
    dout = torch.randn(B, H, S, D, device="cuda", dtype=bf)
    for kv_heads in (HKV, H):  # GQA as the model has it, and with K/V repeated to every head
        k, v = (torch.randn(B, kv_heads, S, D, device="cuda", dtype=bf, requires_grad=True) for _ in range(2))
        for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
            label = f"SDPA {name}, {kv_heads} KV heads"
            try:
                with sdpa_kernel(backend):
                    ms = cuda_ms(lambda: F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=kv_heads != H).backward(dout), calls, warmup=5)
                report(label, ms)
            except RuntimeError as err:
                print(f"{label:>28}: not available ({str(err).splitlines()[0][:100]})")
    try:
        import flash_attn_interface  # FlashAttention-3 (Hopper)
        qf, kf, vf = (torch.randn(B, S, n, D, device="cuda", dtype=bf, requires_grad=True) for n in (H, HKV, HKV))
        dof = torch.randn(B, S, H, D, device="cuda", dtype=bf)

        def fa3():
            out = flash_attn_interface.flash_attn_func(qf, kf, vf, causal=True)
            (out[0] if isinstance(out, tuple) else out).backward(dof)

        report("FlashAttention-3, 8 KV heads", cuda_ms(fa3, calls, warmup=5))
    except ImportError:
        print(f"{'FlashAttention-3':>28}: not installed")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
