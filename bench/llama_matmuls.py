#!/usr/bin/env python3
"""The 1B Llama step's matmuls alone (configs/llama-1b.yaml on one GPU: 2 microbatches of 4 x 2048 tokens,
16 layers + the output head), forward, input-gradient and weight-gradient shapes, back to back on one stream
through torch.mm / addmm in bf16: the matmul time a step would take if nothing else ran. Compare with the
matmul kernels' sum in an `ndtrain train --kernel-trace` of the same model (docs/performance.md, session 45),
and sample the clocks beside both (nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active
--format=csv -lms 200). Usage: llama_matmuls.py [SECONDS]"""
import sys
import time

import torch

T, D, F, V, LAYERS, MICRO = 8192, 2048, 8192, 32000, 16, 2
LINEARS = [(D, D + 2 * 512), (D, D), (D, 2 * F), (F, D)]  # (in, out): q/k/v (GQA), o, gate+up, down


def main():
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    bf = torch.bfloat16

    def r(*shape):
        return torch.randn(*shape, device="cuda", dtype=bf)

    x = {i: r(T, i) for i, _ in LINEARS}
    y = {o: r(T, o) for _, o in LINEARS}
    w = {k: r(k[1], k[0]) for k in LINEARS}
    dw = {k: r(k[1], k[0]) for k in LINEARS}
    xh, wh, yh, dwh = r(T, D), r(V, D), r(T, V), r(V, D)

    def step():
        for _ in range(MICRO):
            for _ in range(LAYERS):
                for i, o in LINEARS:
                    torch.mm(x[i], w[(i, o)].t(), out=y[o])
            torch.mm(xh, wh.t(), out=yh)
            torch.mm(yh, wh, out=xh)
            torch.addmm(dwh, yh.t(), xh, out=dwh)
            for _ in range(LAYERS):
                for i, o in LINEARS:
                    torch.mm(y[o], w[(i, o)], out=x[i])
                    torch.addmm(dw[(i, o)], y[o].t(), x[i], out=dw[(i, o)])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, t0 = [], time.time()
    while time.time() - t0 < secs:
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    flop = 2 * 3 * MICRO * T * (LAYERS * sum(i * o for i, o in LINEARS) + V * D)
    med = times[len(times) // 2]
    print(f"{torch.cuda.get_device_name()}: the matmuls of a step, median {med:.1f} ms (best {times[0]:.1f}) "
          f"over {len(times)} steps; {flop / 1e12:.1f} TFLOP, {flop / med / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
