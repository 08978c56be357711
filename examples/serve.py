"""A tiny LLM serving loop on flashport: paged KV cache, batched varlen prefill, greedy decode.

A Llama-shaped decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) with random weights serves a
queue of requests with mixed prompt lengths under continuous batching:

* a block allocator hands out fixed-size KV pages from one pool (free list, per-request block
  tables); a finished request returns its pages and later requests reuse them;
* newly admitted prompts are prefilled together with flashport.attention_varlen (packed, causal),
  and their K/V are written into the pages;
* every step decodes one token for each running request with
  flashport.attention_with_kvcache(block_table=...), which appends the new K/V in place.

The same loop then runs with PyTorch SDPA over a dense fixed-capacity cache slot per request, and
the generated tokens must be equal (a divergence is accepted only at a near-tie of the top-2 logits, and reported).

With --cuda-graph (CUDA only, opt-in) the decode step of both loops is captured in a CUDA graph per
batch size, as serving engines do: a step then reads only fixed buffers (token ids, positions,
a fixed-width block table and lengths for flashport; for SDPA a fixed-capacity dense cache per slot
and a length mask), which are updated in place before each replay.  --static-decode runs that same
fixed-shape step without capturing it, so its logic is checked on CPU too.  (The first GPU run,
results/serve_graph_h200_failed.log, freed tensors its graphs still read: see StaticDecode.)

    python examples/serve.py --tiny                                  # CPU, seconds
    python examples/serve.py --tiny --static-decode                  # CPU, the step a graph captures
    python examples/serve.py --device cuda --layers 8 --requests 64  # GPU (Triton kernels), eager steps
    python examples/serve.py --device cuda --cuda-graph              # GPU, decode steps replayed from graphs
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
    """One page pool per layer, [num_blocks, page, Hkv, hd]; flashport attention over it.

    For the static decode step (StaticDecode) a fixed-width block table [max_batch, max_blocks]
    and lengths [max_batch] live on the device; batch row i is the i-th request of the step."""

    def __init__(self, cfg: ModelConfig, num_blocks, page, max_batch, max_len, device, dtype, backend=None):
        shape = (num_blocks, page, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.alloc, self.page, self.device, self.backend = BlockAllocator(num_blocks), page, device, backend
        self.bytes = 2 * cfg.layers * math.prod(shape) * self.k[0].element_size()
        self.table = torch.zeros(max_batch, -(-max_len // page), dtype=torch.int32, device=device)
        self.seqlens = torch.zeros(max_batch, dtype=torch.int32, device=device)

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

    def _attend(self, table, seqlens):
        """One new token per request: append at its length and attend through the block table."""
        def attend(n, q, k, v):
            out = flashport.attention_with_kvcache(q[:, None], self.k[n], self.v[n], k[:, None], v[:, None],
                                                   cache_seqlens=seqlens, block_table=table, causal=True,
                                                   backend=self.backend)
            return out[:, 0]
        return attend

    def _tables(self, reqs, width=None):
        """Grow each request by one slot -> (block table [B, width] int32, lengths [B] int32) on the host."""
        for r in reqs:
            self._grow(r, r.length + 1)
        width = width or max(len(r.blocks) for r in reqs)
        return (torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs], dtype=torch.int32),
                torch.tensor([r.length for r in reqs], dtype=torch.int32))

    def decode(self, reqs):
        """Eager step: block table as wide as this batch's longest request, built anew."""
        table, seqlens = self._tables(reqs)
        return self._attend(table.to(self.device), seqlens.to(self.device))

    def load(self, reqs) -> list:
        """Static step: write the batch into the fixed buffers in place; request i is batch row i."""
        table, seqlens = self._tables(reqs, self.table.shape[1])
        self.table[: len(reqs)].copy_(table)
        self.seqlens[: len(reqs)].copy_(seqlens)
        return list(range(len(reqs)))

    def static_attend(self, b: int):
        return self._attend(self.table[:b], self.seqlens[:b])


class DenseSdpaKV:
    """Baseline: a fixed-capacity dense cache [max_batch, max_len, Hkv, hd] per layer, one slot (row)
    per running request, and PyTorch SDPA.  Slots stay compact (0..n-1: a finished request's slot
    takes the last slot's cache), so a batch of b requests lives in rows [:b].

    Eager decode slices each request's cache to its length and calls SDPA per request (a Python
    loop: it checks the tokens, its tok/s is no peer measurement).  The static step (StaticDecode)
    attends over the whole capacity of rows [:b] at once under a length mask: batched, with shapes
    that never change, so it can be captured; it must give the same tokens."""

    def __init__(self, cfg: ModelConfig, max_batch, max_len, device, dtype):
        self.cfg, self.device = cfg, device
        shape = (max_batch, max_len, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.bytes = 2 * cfg.layers * math.prod(shape) * self.k[0].element_size()
        self.slot: dict = {}                                     # rid -> row of the caches
        self.lengths = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.key_pos = torch.arange(max_len, device=device)

    def can_admit(self, r, running) -> bool:
        return len(self.slot) < self.k[0].shape[0]

    def _cache(self, r, n):
        s = self.slot.setdefault(r.rid, len(self.slot))
        return self.k[n][s], self.v[n][s]

    def release(self, r) -> None:
        s = self.slot.pop(r.rid)
        last = len(self.slot)                                    # the highest slot still in use
        if s != last:
            mover = next(rid for rid, x in self.slot.items() if x == last)
            for c in (*self.k, *self.v):
                c[s].copy_(c[last])
            self.slot[mover] = s

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
                kc, vc = self._cache(r, n)
                kc[: b - a], vc[: b - a] = k[a:b], v[a:b]
                outs.append(self._sdpa(q[a:b], k[a:b], v[a:b], causal=True))
            return torch.cat(outs)
        return attend

    def decode(self, reqs):
        def attend(n, q, k, v):
            outs = []
            for i, r in enumerate(reqs):
                kc, vc = self._cache(r, n)
                kc[r.length], vc[r.length] = k[i], v[i]
                outs.append(self._sdpa(q[i:i + 1], kc[: r.length + 1], vc[: r.length + 1], causal=False))
            return torch.cat(outs)
        return attend

    def load(self, reqs) -> list:
        """Static step: write the lengths into the fixed buffer; request i is batch row slot[i]."""
        rows = [self.slot[r.rid] for r in reqs]
        lengths = torch.empty(len(reqs), dtype=torch.int64)
        lengths[rows] = torch.tensor([r.length for r in reqs])
        self.lengths[: len(reqs)].copy_(lengths)
        return rows

    def static_attend(self, b: int):
        rows, lengths = torch.arange(b, device=self.device), self.lengths[:b]
        hkv, hd = self.cfg.kv_heads, self.cfg.head_dim

        def attend(n, q, k, v):
            kc, vc = self.k[n][:b], self.v[n][:b]
            kc[rows, lengths], vc[rows, lengths] = k, v          # append in place, positions on the device
            visible = (self.key_pos <= lengths[:, None])[:, None, None]          # [b, 1, 1, max_len]
            # One query token per request: fold the G query heads of each KV head into SDPA's query
            # axis ([b, Hkv, G, hd]), so GQA needs no enable_gqa and any SDPA kernel with a mask fits.
            o = F.scaled_dot_product_attention(q.reshape(b, hkv, -1, hd), kc.transpose(1, 2),
                                               vc.transpose(1, 2), attn_mask=visible)
            return o.reshape(b, -1, hd)
        return attend


# ----------------------------------------------------------------------------- the serving loop
def capture_step(step, pool):
    """Capture step() -> logits in a CUDA graph (memory from `pool`) -> replay() returning the static logits.

    The graph holds raw device addresses, not references: the caller keeps `step` (so every tensor it
    closes over) alive for as long as replay() is used."""
    # Warm up on a side stream first (Triton compilation, cuBLAS workspaces, allocator).  Rerunning
    # the step is harmless: it rewrites the same K/V at the same positions.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = step()

    def replay():
        graph.replay()
        return logits
    return replay


class StaticDecode:
    """The decode step with static shapes for every batch size 1..max_batch, each captured in a CUDA
    graph if capture (up front, largest first, sharing one memory pool), else run eagerly (CPU).

    A step reads only fixed buffers: token ids and positions [max_batch] here, and what kv.load()
    writes for kv.static_attend(b) (block table + lengths, or slot lengths), all updated in place
    before a replay.  Nothing in it reads a device value on the host.  The logits are the graph's
    static output, rewritten by every replay, so they are consumed before the next step."""

    def __init__(self, model: Llama, kv, max_batch: int, capture: bool):
        self.model, self.kv = model, kv
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=model.device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=model.device)
        # The uncaptured steps stay referenced here for as long as the graphs live: a graph reads the
        # tensors a step closes over by raw address (its logit rows, the block-table and length views,
        # DenseSdpaKV's slot rows).  When only a local closure held them, they were freed right after
        # capture, the allocator handed their memory to later eager tensors, and replays gathered
        # x[rows] with whatever those held as rows: the "vectorized gather kernel index out of bounds"
        # asserts of results/serve_graph_h200_failed.log.
        self.eager = {b: self._step(b) for b in range(max_batch, 0, -1)}
        self.graphs = {}
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for b, step in self.eager.items():                  # largest first
                try:
                    self.graphs[b] = capture_step(step, pool)
                except RuntimeError as e:
                    raise RuntimeError(f"capturing the decode step (batch {b}) failed; --no-cuda-graph "
                                       f"decodes eagerly") from e

    def _step(self, b: int):
        attend, rows = self.kv.static_attend(b), torch.arange(b, device=self.model.device)

        def step():
            return self.model.forward(self.tokens[:b], self.positions[:b], attend, rows)
        return step

    def __call__(self, reqs):
        b, rows = len(reqs), self.kv.load(reqs)           # rows[i]: the batch row of request i
        ids = torch.empty(2, b, dtype=torch.int64)
        ids[:, rows] = torch.tensor([[r.out[-1] for r in reqs], [r.length for r in reqs]])
        self.tokens[:b].copy_(ids[0])
        self.positions[:b].copy_(ids[1])
        logits = (self.graphs or self.eager)[b]()
        return logits if rows == list(range(b)) else logits[rows]


def _sample(reqs, logits, now):
    top = logits.topk(2, dim=-1)
    for r, tok, vals in zip(reqs, top.indices[:, 0].tolist(), top.values.tolist()):
        r.out.append(tok)
        r.gaps.append(vals[0] - vals[1])
        if len(r.out) == 1:
            r.ttft = now()


def serve(model: Llama, kv, requests, max_batch: int, decoder: StaticDecode | None = None):
    """Continuous batching: admit while there is room, prefill the newcomers together, decode all
    (eagerly through kv.decode, or with the static / captured step of decoder)."""
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
            if decoder is not None:
                logits = decoder(running)
            else:
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
    print(f"{name:<28} TTFT mean {sum(ttft) / len(ttft):7.1f} ms  p50 {ttft[len(ttft) // 2]:7.1f} ms  "
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
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                   help="capture the decode step of both loops in a CUDA graph per batch size (CUDA only; "
                        "the fixed-shape step is checked on CPU with --static-decode)")
    p.add_argument("--static-decode", action="store_true",
                   help="decode with the fixed-shape step that --cuda-graph captures, uncaptured (checks it on CPU)")
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
    graph = args.cuda_graph
    if graph and device.type != "cuda":
        print(f"note: --cuda-graph ignored on {device.type} (CUDA graphs need a CUDA device)")
        graph = False
    mode = "cuda-graph" if graph else "static" if args.static_decode else "eager"
    model = Llama(cfg, device, dtype)
    max_len = args.prompt_len[1] + args.new_tokens
    blocks = args.kv_blocks or args.max_batch * -(-max_len // args.page)
    print(f"flashport serve: {device} {args.dtype}, {cfg.layers} layers, dim {cfg.dim}, heads {cfg.heads}/"
          f"{cfg.kv_heads} (hd {cfg.head_dim}), {args.requests} requests, prompts {args.prompt_len[0]}.."
          f"{args.prompt_len[1]}, <= {args.new_tokens} new tokens, max batch {args.max_batch}, decode {mode}")

    # Warm up outside the timed loops (Triton compilation on GPU, lazy initialisation everywhere).
    warm_blocks = 2 * -(-23 // args.page)
    for kv in (PagedFlashportKV(cfg, warm_blocks, args.page, 2, 23, device, dtype, args.backend),
               DenseSdpaKV(cfg, 2, 23, device, dtype)):
        serve(model, kv, make_requests(2, (5, 20), 3, cfg.vocab, seed=7), 2)

    def run(name, kv):
        """Serve a fresh copy of the workload on kv -> (requests, wall seconds)."""
        decoder, t = None, time.perf_counter()
        if mode != "eager":
            decoder = StaticDecode(model, kv, args.max_batch, capture=graph)
            if graph:
                torch.cuda.synchronize()
                print(f"{name}: captured {args.max_batch} decode graphs (batch 1..{args.max_batch}) in "
                      f"{time.perf_counter() - t:.2f} s")
        reqs = make_requests(args.requests, args.prompt_len, args.new_tokens, cfg.vocab)
        return reqs, serve(model, kv, reqs, args.max_batch, decoder)

    mib = 2 ** -20
    paged_kv = PagedFlashportKV(cfg, blocks, args.page, args.max_batch, max_len, device, dtype, args.backend)
    paged, wall = run("paged/flashport", paged_kv)
    a = paged_kv.alloc
    res = {"mode": mode, "paged": _stats(f"paged/flashport [{mode}]", paged, wall,
                                         f"KV pool {paged_kv.bytes * mib:.2f} MiB ({blocks} x {args.page}), peak "
                                         f"in use {paged_kv.bytes * a.peak_used / blocks * mib:.2f} MiB, "
                                         f"{a.reused} pages reused")}
    dense_kv = DenseSdpaKV(cfg, args.max_batch, max_len, device, dtype)
    dense, wall = run("dense/SDPA", dense_kv)
    res["dense"] = _stats(f"dense/SDPA [{mode}]", dense, wall,
                          f"KV {dense_kv.bytes * mib:.2f} MiB ({args.max_batch} slots x {max_len})")

    tol = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1e-1}[dtype]
    equal, ties = compare(paged, dense, tol)
    print(f"tokens: {equal}/{len(paged)} requests identical to the SDPA run"
          + (f"; {len(ties)} diverged at near-ties (request, token, gap): {ties}" if ties else ""))
    res.update(equal=equal, ties=ties, pages_reused=a.reused, requests=len(paged),
               tokens_paged=[r.out for r in paged], tokens_dense=[r.out for r in dense])
    return res


if __name__ == "__main__":
    main()
