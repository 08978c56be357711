"""Rolling out a new attention kernel under the guard, and rolling it back without a release.

A small causal language model trains on random token batches of varied lengths.  Before training, the
example registers its own candidate backend, "candidate", ahead of every built-in one: it is the
blockwise kernel with a deliberate defect (a wrong tail tile: once the keys cross TILE positions, its
output is nudged by `--defect`), as a miscompiled or mis-tiled kernel would meet production.

`flashport.guard(sample_rate=0.01)` re-checks 1% of the calls on a few query rows against the float64
reference (on a side stream on a GPU).  The first sampled call that crosses the tile boundary exceeds
the contract's tolerance, the candidate is quarantined (one warning), and every later call goes to the
next eligible backend, while training goes on.  At the end the example prints flashport.stats() and a
text histogram of the guard's error ratio (measured error / allowed error) per backend.

    python examples/rollout.py                  # CPU, seconds
    python examples/rollout.py --device cuda    # on a GPU the guard's checks run on a side stream (not yet
                                                # run on the lent H200: the CPU run is the tested one)
"""
from __future__ import annotations

import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashport
from flashport import dispatch
from flashport.backend.blockwise import BlockwiseBackend

TILE = 64


class DefectiveCandidate(BlockwiseBackend):
    """blockwise with a wrong tail tile: exact while Sk <= TILE, off by `defect` beyond it."""

    name = "candidate"
    state_family = "candidate"     # its saved state is its own: the backward pairs with itself
    slow_on_gpu = False            # a candidate for auto on a GPU too (blockwise itself is kept out of it)

    def __init__(self, defect: float):
        self.defect = defect

    def forward(self, spec, inputs):
        out, lse, private = super().forward(spec, inputs)
        if spec.seqlen_k > TILE:
            out = out + self.defect
        return out, lse, private


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        a = flashport.attention(q, k, v, causal=True)          # (B, S, H, D): flashport's layout
        x = x + self.o(a.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2, heads=4, kv_heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def histogram(edges, counts, width=40) -> list[str]:
    top = max(counts) or 1
    lines = []
    for lo, hi, n in zip(edges[:-1], edges[1:], counts):
        bar = "#" * (round(width * n / top) if n else 0)
        lines.append(f"    [{lo:g}, {hi:g})".ljust(20) + f" {n:5d} {bar}")
    return lines


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--defect", type=float, default=0.05)
    ap.add_argument("--sample-rate", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dispatch.register(DefectiveCandidate(args.defect), first=True)
    flashport.reset_stats()
    model = TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    quarantined_at = None
    with flashport.guard(sample_rate=args.sample_rate):
        for step in range(args.steps):
            s = rng.randint(8, args.max_len)
            tokens = torch.randint(0, 256, (args.batch, s + 1), device=device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if quarantined_at is None and "candidate" in flashport.quarantined():
                quarantined_at = step
                print(f"step {step}: candidate quarantined: {flashport.quarantined()['candidate']}")
        stats = flashport.stats()       # collects every pending guard verdict
    dispatch.unregister("candidate")

    print(f"\ntrained {args.steps} steps, final loss {loss.item():.3f}; quarantined at step {quarantined_at}")
    cols = ("calls", "forward", "backward", "errors", "fallbacks", "guard_checks", "guard_failures",
            "flops", "bytes_read", "peak_extra_bytes")
    print("backend".ljust(12) + "".join(c.rjust(17) for c in cols))
    for name, d in stats.items():
        print(name.ljust(12) + "".join(str(d.get(c, 0)).rjust(17) for c in cols))
    for name, d in stats.items():
        h = d.get("guard_error_hist")
        if h and sum(h["counts"]):
            print(f"\nguard error ratio (measured / allowed), {name}: max {d['guard_max_error_ratio']:.3g}")
            print("\n".join(histogram(h["edges"], h["counts"])))
    return {"stats": stats, "quarantined_at": quarantined_at}


if __name__ == "__main__":
    main()
