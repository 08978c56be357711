"""A tiny LLM serving loop on flashport: paged KV cache, batched varlen prefill, greedy decode.

A Llama-shaped decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) with random weights serves a
queue of requests with mixed prompt lengths under continuous batching:

* a block allocator hands out fixed-size KV pages from one pool (free list, per-request block
  tables); a finished request returns its pages and later requests reuse them;
* newly admitted prompts are prefilled together with flashport.attention_varlen (packed, causal),
  and their K/V are written into the pages;
* every step decodes one token for each running request with
  flashport.attention_with_kvcache(block_table=...), which appends the new K/V in place.

The same loop then runs with PyTorch SDPA over dense per-request caches, and the generated tokens
must be equal (a divergence is accepted only at a near-tie of the top-2 logits, and reported).

    python examples/serve.py --tiny                                  # CPU, seconds
    python examples/serve.py --device cuda --layers 8 --requests 64  # GPU (Triton kernels)
"""
from __future__ import annotations

import argparse
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import flashport


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 8192
    dim: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    ffn: int = 2816
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


TINY = ModelConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=160)


# ----------------------------------------------------------------------------- the model
def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Llama:
    """Random-weight decoder.  forward(tokens [T], positions [T], attend) -> logits [T_out, vocab]
    where attend(layer, q [T, H, hd], k [T, Hkv, hd], v [T, Hkv, hd]) -> [T, H, hd] is the KV-cache
    strategy (paged flashport or dense SDPA); everything else is shared."""

    def __init__(self, cfg: ModelConfig, device, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.cfg, self.device, self.dtype = cfg, device, dtype

        def w(*shape, std=None):
            std = std if std is not None else shape[0] ** -0.5
            return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

        hd, qd, kvd = cfg.head_dim, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = w(cfg.vocab, cfg.dim, std=1.0)
        self.layers = [dict(attn_norm=1 + w(cfg.dim, std=0.1), wq=w(cfg.dim, qd), wk=w(cfg.dim, kvd),
                            wv=w(cfg.dim, kvd), wo=w(qd, cfg.dim), mlp_norm=1 + w(cfg.dim, std=0.1),
                            w1=w(cfg.dim, cfg.ffn), w3=w(cfg.dim, cfg.ffn), w2=w(cfg.ffn, cfg.dim))
                       for _ in range(cfg.layers)]
        self.norm = 1 + w(cfg.dim, std=0.1)
        self.lm_head = w(cfg.dim, cfg.vocab)
        self.inv_freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)

    def rope(self, x, positions):
        """Rotate-half RoPE on x [T, H, hd] at integer positions [T]."""
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]       # [T, hd/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    def forward(self, tokens, positions, attend, logit_rows):
        c = self.cfg
        x = self.embed[tokens]
        t = tokens.shape[0]
        for n, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], c.norm_eps)
            q = self.rope((h @ L["wq"]).view(t, c.heads, c.head_dim), positions)
            k = self.rope((h @ L["wk"]).view(t, c.kv_heads, c.head_dim), positions)
            v = (h @ L["wv"]).view(t, c.kv_heads, c.head_dim)
            x = x + attend(n, q, k, v).reshape(t, -1) @ L["wo"]
            h = rms_norm(x, L["mlp_norm"], c.norm_eps)
            x = x + (F.silu(h @ L["w1"]) * (h @ L["w3"])) @ L["w2"]
        return (rms_norm(x[logit_rows], self.norm, c.norm_eps) @ self.lm_head).float()


# ----------------------------------------------------------------------------- KV caches
@dataclass
class Request:
    rid: int
    prompt: list
    max_new: int
    out: list = field(default_factory=list)
    gaps: list = field(default_factory=list)     # top-1 minus top-2 logit at each generated token
    length: int = 0                              # tokens in the KV cache
    blocks: list = field(default_factory=list)   # paged: block ids in position order
    ttft: float = 0.0

    @property
    def total(self) -> int:
        return len(self.prompt) + self.max_new


class BlockAllocator:
    """Fixed pool of KV pages with a free list; counts pages handed out again after a release."""

    def __init__(self, num_blocks: int):
        self.free = deque(range(num_blocks))
        self.released: set = set()
        self.reused = 0
        self.peak_used = 0
        self.num_blocks = num_blocks

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("KV pool exhausted (admission control should prevent this)")
        b = self.free.popleft()
        self.reused += b in self.released
        self.peak_used = max(self.peak_used, self.num_blocks - len(self.free))
        return b

    def release(self, blocks) -> None:
        self.free.extend(blocks)
        self.released.update(blocks)


class PagedFlashportKV:
    """One page pool per layer, [num_blocks, page, Hkv, hd]; flashport attention over it."""

    def __init__(self, cfg: ModelConfig, num_blocks, page, device, dtype, backend=None):
        shape = (num_blocks, page, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.alloc, self.page, self.device, self.backend = BlockAllocator(num_blocks), page, device, backend
        self.bytes = 2 * cfg.layers * math.prod(shape) * self.k[0].element_size()

    def _need(self, r: Request) -> int:
        return -(-r.total // self.page)

    def can_admit(self, r: Request, running) -> bool:
        reserved = sum(self._need(x) - len(x.blocks) for x in running)
        return len(self.alloc.free) - reserved >= self._need(r)

    def _grow(self, r: Request, length: int) -> None:
        while len(r.blocks) * self.page < length:
            r.blocks.append(self.alloc.alloc())

    def release(self, r: Request) -> None:
        self.alloc.release(r.blocks)
        r.blocks = []

    def prefill(self, reqs):
        """Packed causal attention over the prompts, then K/V written into each request's pages."""
        lens = [len(r.prompt) for r in reqs]
        for r, n in zip(reqs, lens):
            self._grow(r, n)
        cu = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        slots = [(r.blocks[p // self.page], p % self.page) for r in reqs for p in range(len(r.prompt))]
        blk, off = torch.tensor(slots, device=self.device).unbind(1)

        def attend(n, q, k, v):
            self.k[n][blk, off] = k
            self.v[n][blk, off] = v
            return flashport.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                              backend=self.backend)
        return attend

    def decode(self, reqs):
        """One new token per request: append at its length and attend through the block table."""
        for r in reqs:
            self._grow(r, r.length + 1)
        width = max(len(r.blocks) for r in reqs)
        table = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs], dtype=torch.int32,
                             device=self.device)
        seqlens = torch.tensor([r.length for r in reqs], dtype=torch.int32, device=self.device)

        def attend(n, q, k, v):
            out = flashport.attention_with_kvcache(q[:, None], self.k[n], self.v[n], k[:, None], v[:, None],
                                                   cache_seqlens=seqlens, block_table=table, causal=True,
                                                   backend=self.backend)
            return out[:, 0]
        return attend


class DenseSdpaKV:
    """Baseline: a dense [total, Hkv, hd] cache per request and layer, PyTorch SDPA per request.

    It exists to check the tokens; it loops over requests in Python, so its tok/s is no peer
    measurement of batched decoding."""

    def __init__(self, cfg: ModelConfig, device, dtype):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.caches: dict = {}
        self.bytes = self.peak_bytes = 0

    def can_admit(self, r, running) -> bool:
        return True

    def release(self, r) -> None:
        for k, v in self.caches.pop(r.rid):
            self.bytes -= 2 * k.numel() * k.element_size()

    def _cache(self, r):
        if r.rid not in self.caches:
            shape = (r.total, self.cfg.kv_heads, self.cfg.head_dim)
            self.caches[r.rid] = [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                                   torch.zeros(shape, device=self.device, dtype=self.dtype))
                                  for _ in range(self.cfg.layers)]
            self.bytes += 2 * self.cfg.layers * math.prod(shape) * self.caches[r.rid][0][0].element_size()
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        return self.caches[r.rid]

    @staticmethod
    def _sdpa(q, k, v, causal):  # [T, H, hd] layouts -> SDPA's [1, H, T, hd]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=causal, enable_gqa=True)
        return o[0].transpose(0, 1)

    def prefill(self, reqs):
        spans = []
        for r in reqs:
            start = spans[-1][1] if spans else 0
            spans.append((start, start + len(r.prompt)))

        def attend(n, q, k, v):
            outs = []
            for r, (a, b) in zip(reqs, spans):
                kc, vc = self._cache(r)[n]
                kc[: b - a], vc[: b - a] = k[a:b], v[a:b]
                outs.append(self._sdpa(q[a:b], k[a:b], v[a:b], causal=True))
            return torch.cat(outs)
        return attend

    def decode(self, reqs):
        def attend(n, q, k, v):
            outs = []
            for i, r in enumerate(reqs):
                kc, vc = self._cache(r)[n]
                kc[r.length], vc[r.length] = k[i], v[i]
                outs.append(self._sdpa(q[i:i + 1], kc[: r.length + 1], vc[: r.length + 1], causal=False))
            return torch.cat(outs)
        return attend


# ----------------------------------------------------------------------------- the serving loop
def _sample(reqs, logits, now):
    top = logits.topk(2, dim=-1)
    for r, tok, vals in zip(reqs, top.indices[:, 0].tolist(), top.values.tolist()):
        r.out.append(tok)
        r.gaps.append(vals[0] - vals[1])
        if len(r.out) == 1:
            r.ttft = now()


def serve(model: Llama, kv, requests, max_batch: int):
    """Continuous batching: admit while there is room, prefill the newcomers together, decode all."""
    waiting, running = deque(requests), []
    t0 = time.perf_counter()
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def now():
        sync()
        return time.perf_counter() - t0

    while waiting or running:
        admitted = []
        while waiting and len(running) + len(admitted) < max_batch and kv.can_admit(waiting[0], running + admitted):
            admitted.append(waiting.popleft())
        if waiting and not running and not admitted:
            raise ValueError(f"request {waiting[0].rid} needs more KV pages than the pool holds (--kv-blocks)")
        if admitted:
            tokens = torch.tensor([t for r in admitted for t in r.prompt], device=model.device)
            positions = torch.cat([torch.arange(len(r.prompt), device=model.device) for r in admitted])
            last = torch.tensor([len(r.prompt) for r in admitted], device=model.device).cumsum(0) - 1
            _sample(admitted, model.forward(tokens, positions, kv.prefill(admitted), last), now)
            for r in admitted:
                r.length = len(r.prompt)
            running += admitted
        elif running:
            tokens = torch.tensor([r.out[-1] for r in running], device=model.device)
            positions = torch.tensor([r.length for r in running], device=model.device)
            rows = torch.arange(len(running), device=model.device)
            logits = model.forward(tokens, positions, kv.decode(running), rows)
            for r in running:
                r.length += 1
            _sample(running, logits, now)
        for r in [r for r in running if len(r.out) >= r.max_new]:
            running.remove(r)
            kv.release(r)
    return now()


def make_requests(n, prompt_range, new_tokens, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        length = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=g))
        max_new = int(torch.randint(max(1, new_tokens // 2), new_tokens + 1, (1,), generator=g))
        reqs.append(Request(i, torch.randint(0, vocab, (length,), generator=g).tolist(), max_new))
    return reqs


def compare(paged, dense, tol: float):
    """Tokens must be equal; a divergence is tolerated only where the top-2 logits were within tol."""
    equal, ties = 0, []
    for a, b in zip(paged, dense):
        if a.out == b.out:
            equal += 1
            continue
        step = next(i for i, (x, y) in enumerate(zip(a.out, b.out)) if x != y)
        gap = min(a.gaps[step], b.gaps[step])
        if gap > tol:
            raise AssertionError(f"request {a.rid} diverges at token {step}: {a.out[step]} vs {b.out[step]} "
                                 f"with a top-2 logit gap of {gap:.3g} > {tol}")
        ties.append((a.rid, step, gap))
    return equal, ties


def _stats(name, reqs, wall, kv_line):
    ttft = sorted(r.ttft * 1e3 for r in reqs)
    toks = sum(len(r.out) for r in reqs)
    print(f"{name:<16} TTFT mean {sum(ttft) / len(ttft):7.1f} ms  p50 {ttft[len(ttft) // 2]:7.1f} ms  "
          f"max {ttft[-1]:7.1f} ms | {toks / wall:8.1f} tok/s ({toks} tokens in {wall:.2f} s) | {kv_line}")
    return dict(ttft_ms=ttft, tokens=toks, wall_s=wall, tok_per_s=toks / wall)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--page", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-blocks", type=int, default=None, help="pages in the pool (default: max-batch worst case)")
    p.add_argument("--backend", default=None, help="force a flashport backend (default: auto)")
    p.add_argument("--tiny", action="store_true", help="tiny model and workload for CPU")
    args = p.parse_args(argv)
    for name in ("requests", "new_tokens", "max_batch", "page"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        p.error("--prompt-len needs 1 <= MIN <= MAX")

    cfg = ModelConfig()
    if args.tiny:
        cfg = TINY
        args.requests, args.new_tokens = min(args.requests, 6), min(args.new_tokens, 8)
        args.prompt_len, args.max_batch = (3, 40), min(args.max_batch, 3)
    if args.layers is not None:
        cfg = ModelConfig(**{**cfg.__dict__, "layers": args.layers})
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = Llama(cfg, device, dtype)
    blocks = args.kv_blocks or args.max_batch * -(-(args.prompt_len[1] + args.new_tokens) // args.page)
    print(f"flashport serve: {device} {args.dtype}, {cfg.layers} layers, dim {cfg.dim}, heads {cfg.heads}/"
          f"{cfg.kv_heads} (hd {cfg.head_dim}), {args.requests} requests, prompts {args.prompt_len[0]}.."
          f"{args.prompt_len[1]}, <= {args.new_tokens} new tokens, max batch {args.max_batch}")

    # Warm up outside the timed loops (Triton compilation on GPU, lazy initialisation everywhere).
    warm_blocks = 2 * -(-23 // args.page)
    for kv in (PagedFlashportKV(cfg, warm_blocks, args.page, device, dtype, args.backend),
               DenseSdpaKV(cfg, device, dtype)):
        serve(model, kv, make_requests(2, (5, 20), 3, cfg.vocab, seed=7), 2)

    def fresh():
        return make_requests(args.requests, args.prompt_len, args.new_tokens, cfg.vocab)

    paged_kv = PagedFlashportKV(cfg, blocks, args.page, device, dtype, args.backend)
    paged = fresh()
    wall = serve(model, paged_kv, paged, args.max_batch)
    a = paged_kv.alloc
    mib = 2 ** -20
    res = {"paged": _stats("paged/flashport", paged, wall,
                           f"KV pool {paged_kv.bytes * mib:.2f} MiB ({blocks} x {args.page}), peak in use "
                           f"{paged_kv.bytes * a.peak_used / blocks * mib:.2f} MiB, {a.reused} pages reused")}
    dense_kv = DenseSdpaKV(cfg, device, dtype)
    dense = fresh()
    wall = serve(model, dense_kv, dense, args.max_batch)
    res["dense"] = _stats("dense/SDPA", dense, wall, f"KV peak {dense_kv.peak_bytes * mib:.2f} MiB")

    tol = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1e-1}[dtype]
    equal, ties = compare(paged, dense, tol)
    print(f"tokens: {equal}/{len(paged)} requests identical to the SDPA run"
          + (f"; {len(ties)} diverged at near-ties (request, token, gap): {ties}" if ties else ""))
    res.update(equal=equal, ties=ties, pages_reused=a.reused, requests=len(paged),
               tokens_paged=[r.out for r in paged], tokens_dense=[r.out for r in dense])
    return res


if __name__ == "__main__":
    main()
