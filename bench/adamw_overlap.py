#!/usr/bin/env python3
"""How much of an AdamW update could hide under the next step's forward matmuls (the 1B Llama, one GPU):
the forward matmuls of one microbatch (4 x 2048 tokens, 16 layers) alone, torch's fused AdamW over 17
chunks of 65M fp32 parameters alone, both in sequence, and both on two streams with layer l's matmuls
waiting for chunk l's update (the order an optimizer overlapped with the next forward would need).
Usage: adamw_overlap.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ndt_common import cuda_ms  # noqa: E402

T, D, F, KV, LAYERS, CHUNK = 8192, 2048, 8192, 512, 16, 65_000_000


def main():
    bf = torch.bfloat16
    x, h = torch.randn(T, D, device="cuda", dtype=bf), torch.randn(T, F, device="cuda", dtype=bf)
    ws = [{n: torch.randn(*s, device="cuda", dtype=bf)
           for n, s in (("qkv", (D + 2 * KV, D)), ("o", (D, D)), ("gu", (2 * F, D)), ("dn", (D, F)))}
          for _ in range(LAYERS)]
    o1, o2 = torch.empty(T, D + 2 * KV, device="cuda", dtype=bf), torch.empty(T, D, device="cuda", dtype=bf)
    o3 = torch.empty(T, 2 * F, device="cuda", dtype=bf)

    def layer(l):
        w = ws[l]
        torch.matmul(x, w["qkv"].t(), out=o1)
        torch.matmul(x, w["o"].t(), out=o2)
        torch.matmul(x, w["gu"].t(), out=o3)
        torch.matmul(h, w["dn"].t(), out=o2)

    state = [[torch.randn(CHUNK, device="cuda") for _ in range(2)] + [torch.zeros(CHUNK, device="cuda")
                                                                       for _ in range(2)]
             for _ in range(LAYERS + 1)]
    steps = [torch.tensor(1.0, device="cuda") for _ in range(LAYERS + 1)]

    def adam(i):
        p, g, m, v = state[i]
        torch._fused_adamw_([p], [g], [m], [v], [], [steps[i]], lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    side = torch.cuda.Stream()

    def forward():
        for l in range(LAYERS):
            layer(l)

    def update():
        for i in range(LAYERS + 1):
            adam(i)

    def overlapped():
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        done = []
        with torch.cuda.stream(side):
            for i in range(LAYERS + 1):
                adam(i)
                done.append(torch.cuda.Event())
                done[-1].record(side)
        main_stream.wait_event(done[0])  # the embedding table
        for l in range(LAYERS):
            main_stream.wait_event(done[l + 1])
            layer(l)
        main_stream.wait_stream(side)

    def ms(f):
        return cuda_ms(f, calls=10)

    for _ in range(2):
        tf, to, tb = ms(forward), ms(update), ms(overlapped)
        ts = ms(lambda: (update(), forward()))
        print(f"forward matmuls {tf:.2f} ms, AdamW {to:.2f} ms, in sequence {ts:.2f} ms, two streams "
              f"{tb:.2f} ms: {100 * (ts - tb) / to:.0f}% of the update hidden")


if __name__ == "__main__":
    main()
