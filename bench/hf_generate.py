#!/usr/bin/env python3
"""Hugging Face `transformers` generate() on the weights bench/decode_bench.cpp exported (issue 14).

Decodes the same prompts (JSON list of id lists, equal lengths) for exactly --new tokens (min_new_tokens =
max_new_tokens, so EOS never ends a row early), bf16 on one GPU, in up to three modes:
  dynamic  - default DynamicCache, no compilation (what a plain generate() call does);
  static   - cache_implementation="static", disable_compile=True;
  compile  - cache_implementation="static" with generate()'s own torch.compile of the decode step.
Each mode: one warm-up call (compilation happens there), then --repeats timed calls (synchronized host
timer around the whole call); the best is reported. Prints one JSON line per mode and, with --tokens, the
fraction of rows whose first k greedy tokens equal ndtrain's.
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="dynamic,static,compile")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tokens", help="ndtrain's generated ids (JSON) to compare greedy prefixes with")
    ap.add_argument("--json", help="append result lines here")
    a = ap.parse_args()

    prompts = json.load(open(a.prompts))
    ids = torch.tensor(prompts, dtype=torch.long, device="cuda")
    mask = torch.ones_like(ids)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    sample = a.temperature > 0
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=sample, pad_token_id=0)
    if sample:
        kw.update(temperature=a.temperature, top_k=0, top_p=1.0)
    modes = {
        "dynamic": {},
        "static": dict(cache_implementation="static", disable_compile=True),
        "compile": dict(cache_implementation="static"),
    }
    for name in a.modes.split(","):
        extra = modes[name]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, **kw, **extra)  # warm-up / compilation
            torch.cuda.synchronize()
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, **kw, **extra)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        gen = out[:, ids.shape[1]:]
        n = gen.numel()
        res = {"engine": f"hf_{name}", "batch": ids.shape[0], "prompt_len": ids.shape[1], "new_tokens": a.new,
               "generated": n, "seconds": times, "tokens_per_s": n / min(times),
               "ms_per_step": 1e3 * min(times) / a.new,
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
        if a.tokens and not sample:
            ours = json.load(open(a.tokens))
            for k in (1, 8, 32):
                same = sum(1 for r, o in zip(gen.tolist(), ours) if r[:k] == o[:k])
                res[f"same_first_{k}"] = same / len(ours)
        print(json.dumps(res), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
