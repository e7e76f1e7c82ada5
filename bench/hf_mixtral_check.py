#!/usr/bin/env python3
"""Checks an ndtrain Mixture-of-Experts export against Hugging Face transformers' MixtralForCausalLM.

`ndtrain convert --to-hf` writes an MoE run (router softmax, renormalize true, no shared experts, every
layer MoE) as a MixtralForCausalLM directory (docs/checkpoints.md). This script loads that directory with
`MixtralForCausalLM.from_pretrained(dir, torch_dtype=torch.float32)` on the CPU (eager attention) and
either compares its logits with ndtrain's or just writes them out. Needs torch and transformers.

  compare (the usual check):
      ndtrain convert --run RUN --to-hf HF_DIR
      ndtrain score -c RUN/config.yaml --weights RUN/model.safetensors -n 4 -k 16 -o scores.jsonl
      hf_mixtral_check.py HF_DIR --scores scores.jsonl [--tol 1e-4]
    `ndtrain score` (train.device cpu = fp32) writes per sample its tokens, log p(next token) and the k
    largest logits with their ids. For each sample the HF model runs on tokens[:-1]; the script prints
    max |logit_hf - logit_ndtrain| over every (position, top-k id) and max |logprob_hf - logprob_ndtrain|,
    whether HF's own top-k ids agree, and exits 1 when a difference exceeds --tol or the top-k sets
    differ. (`ndtrain score` gives, where a sample's loss mask is 0, the logprob of the pad id rather than
    of the next token; the script recognises and counts such positions apart. data.task=lm masks none.)

  dump (no ndtrain output needed):
      hf_mixtral_check.py HF_DIR --tokens 1,2,3,4 --out hf_logits.json
    writes {"tokens": [...], "logits": [[V floats] per position]} (HF logits of the token list, fp32), to
    compare with anything that computes the same positions.
"""
import argparse
import json
import os
import sys

import torch
from transformers import MixtralForCausalLM


def load(hf_dir):
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        sys.exit(f"{hf_dir}: no config.json (give the directory written by `ndtrain convert --to-hf`)")
    hf_dir = os.path.abspath(hf_dir)  # a relative path could be taken for a hub repo id
    model, info = MixtralForCausalLM.from_pretrained(
        hf_dir, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    # A weight that did not load would be left randomly initialized: refuse rather than compare noise.
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        sys.exit(f"{hf_dir}: weights did not load cleanly: {bad}")
    model.eval()
    return model


@torch.no_grad()
def logits_of(model, tokens):
    ids = torch.tensor([tokens], dtype=torch.long)
    return model(input_ids=ids).logits[0].float()  # (T, V)


def compare(model, scores_path, tol):
    max_logit = max_lp = 0.0
    topk_mismatch = rows_total = 0
    other_target = {}  # token id -> positions whose ndtrain logprob is of that token instead (see below)
    with open(scores_path) as f:
        for line in f:
            if not line.strip():
                continue
            s = json.loads(line)
            tokens = s["tokens"]  # rows + 1 tokens: rows inputs, each predicting the next token
            logits = logits_of(model, tokens[:-1])
            rows = len(s["logprob"])
            assert logits.shape[0] == rows, (logits.shape, rows)
            logp = torch.log_softmax(logits.double(), dim=-1)
            for t in range(rows):
                ids = torch.tensor(s["topk_id"][t], dtype=torch.long)
                ours = torch.tensor(s["topk_logit"][t], dtype=torch.float64)
                max_logit = max(max_logit, (logits[t, ids].double() - ours).abs().max().item())
                d = abs(logp[t, tokens[t + 1]].item() - s["logprob"][t])
                if d > tol:
                    # `ndtrain score` scores its microbatch targets, which are the pad id where the sample's
                    # loss mask is 0 (e.g. the prompt of an addition problem): then its logprob is that of
                    # another token. Such positions are counted apart, not compared.
                    v = int((logp[t] - s["logprob"][t]).abs().argmin())
                    if abs(logp[t, v].item() - s["logprob"][t]) <= tol:
                        other_target[v] = other_target.get(v, 0) + 1
                        d = 0.0
                max_lp = max(max_lp, d)
                k = len(s["topk_id"][t])
                hf_ids = torch.topk(logits[t], k).indices.tolist()
                # Exact ties may order differently; count a mismatch only where the id sets differ.
                topk_mismatch += set(hf_ids) != set(s["topk_id"][t])
                rows_total += 1
    print(f"positions compared: {rows_total}")
    print(f"max |logits_hf - logits_ndtrain| over top-k ids: {max_logit:.3e}")
    print(f"max |logprob_hf - logprob_ndtrain| of the next token: {max_lp:.3e}")
    if other_target:
        print(f"positions where ndtrain scored another token (masked: pad target), by token id: {other_target}")
    print(f"positions whose top-k id set differs: {topk_mismatch}")
    ok = max_logit <= tol and max_lp <= tol and topk_mismatch == 0
    print("OK" if ok else f"FAIL (tolerance {tol})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", help="directory written by `ndtrain convert --to-hf` (config.json + model.safetensors)")
    ap.add_argument("--scores", help="`ndtrain score` JSONL for the same weights (compare mode)")
    ap.add_argument("--tol", type=float, default=1e-4, help="absolute tolerance (compare mode)")
    ap.add_argument("--tokens", help="comma-separated token ids (dump mode)")
    ap.add_argument("--out", help="JSON file for the HF logits (dump mode)")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = load(a.hf_dir)
    if a.scores:
        return compare(model, a.scores, a.tol)
    if not a.tokens or not a.out:
        ap.error("give --scores SCORES.jsonl, or --tokens IDS and --out FILE")
    tokens = [int(x) for x in a.tokens.split(",") if x.strip()]
    logits = logits_of(model, tokens)
    with open(a.out, "w") as f:
        json.dump({"tokens": tokens, "logits": logits.tolist()}, f)
    print(f"wrote HF logits ({logits.shape[0]} x {logits.shape[1]}) to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
