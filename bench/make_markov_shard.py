#!/usr/bin/env python3
"""Writes one ndtrain token shard (NDTSHARD, docs/data.md) drawn from a random first-order Markov chain.

The distribution is learnable but not trivial, so a loss curve falls visibly within 50 steps and two
trainers can be compared on it: ids follow a Zipf law over a random permutation of the vocabulary (like
real token frequencies, so the embedding gradients are as sparse and skewed as on text); each id has 8
successors (drawn from the same Zipf law) and the next token is one of them with probability 0.8
(weights 0.4, 0.2, ... over the 8), else a fresh Zipf draw. Deterministic for a seed (Python's random).

Usage: make_markov_shard.py OUT.bin --vocab 50257 --tokens 2000000 [--seed 1]
"""
import argparse
import array
import bisect
import itertools
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ndt_common import write_shard_header  # noqa: E402

SUCC_W = [0.40, 0.20, 0.12, 0.08, 0.07, 0.06, 0.04, 0.03]


def generate(vocab, n, seed, follow=0.8):
    rng = random.Random(seed)
    order = list(range(vocab))
    rng.shuffle(order)  # rank -> id
    cum = list(itertools.accumulate(1.0 / (r + 10) ** 1.1 for r in range(vocab)))
    total = cum[-1]

    def zipf(k):
        return [order[bisect.bisect_left(cum, rng.random() * total)] for _ in range(k)]

    succ = zipf(vocab * len(SUCC_W))  # successors of id i: succ[8 i : 8 i + 8]
    succ_cum = list(itertools.accumulate(SUCC_W))
    out = array.array("H" if vocab <= 65536 else "I")
    tok = zipf(1)[0]
    for _ in range(n):
        out.append(tok)
        u = rng.random()
        if u < follow:
            k = bisect.bisect_left(succ_cum, u / follow * succ_cum[-1])
            tok = succ[tok * len(SUCC_W) + min(k, len(SUCC_W) - 1)]
        else:
            tok = order[bisect.bisect_left(cum, rng.random() * total)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=50257, help="ids are < vocab (the shard header's vocab_size)")
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    toks = generate(a.vocab, a.tokens, a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "wb") as f:
        write_shard_header(f, len(toks), a.vocab)
        if sys.byteorder != "little":
            toks.byteswap()
        toks.tofile(f)
    print(f"wrote {a.out}: {len(toks)} tokens, vocab {a.vocab}, {len(set(toks))} distinct ids")


if __name__ == "__main__":
    main()
