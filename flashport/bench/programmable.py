"""The `programmable` suite (issue [15]): masks and biases written as mods, flashport against FlexAttention and the
built-in paths, on one card in one process.

Cases (B=2, H=16, S=16384, D=128, bf16 unless noted; --quick: S=1024, H=4): packed documents (causal, 8 docs),
prefix-LM (S/4 bidirectional, then causal), a causal sliding window of 2048 with 4 sink tokens, ALiBi through
score_mod (causal), a learnable relative-position table (256 buckets, causal, its gradient included), a dense
additive bias [1, H, S, S] with its gradient (S=4096), and a plain causal mask_mod (against causal=True); then the
table (S/2) and the bias again at D = 64 and 256 (H = 2048 / D).

Implementations (each cell says why one cannot run it):
    flashport       flashport.attention(score_mod=, block_mask=) with backend=None
    flashport-flex  the same, backend="flex"
    flashport-triton the same, backend="triton" (the Triton kernels with the mods compiled in)
    flex            torch.compile(flex_attention) with torch's create_block_mask (Triton kernels)
    flex-flash      the same with kernel_options={"BACKEND": "FLASH"} (FlashAttention-4 underneath, where installed)
    builtin         flashport's built-in path for the same mask where one exists (varlen for documents, alibi_slopes
                    for ALiBi, causal=True), backend=None
    fa4             FlashAttention-4's built-in path where one exists (varlen, causal, a window without sinks)
    builtin-fa4     flashport's built-in path through its `fa4` backend (what backend=None runs where the table picks
                    FA4): its cost over `fa4` is the backend's own (PERFLOG row 80)
    sdpa-mask       F.scaled_dot_product_attention with the mask or bias materialised (S x S), where it fits

TFLOP/s over the visible pairs (FlashAttention's convention: 4 * visible * D forward, 2.5x that backward).  The
backward is timed as forward + backward minus forward (compiled Flex donates its backward's buffers, so no
retain_graph), every implementation alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

IMPLS = ("flashport", "flashport-flex", "flashport-triton", "flex", "flex-flash", "builtin", "fa4", "builtin-fa4",
         "sdpa-mask")
DEFAULT_IMPLS = IMPLS


class NotServed(Exception):
    """This implementation has no path for the case (the reason is the message)."""


@dataclass
class Case:
    name: str
    b: int
    h: int
    s: int
    d: int
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    bias: Optional[torch.Tensor] = None           # attn_bias [1, H, S, S] (requires grad)
    table: Optional[torch.Tensor] = None          # the captured tensor whose gradient is timed
    builtin: dict = field(default_factory=dict)   # flashport.attention keywords of the built-in equivalent
    docs: Optional[torch.Tensor] = None           # document ids [S] (varlen built-ins)
    window: Optional[tuple] = None                # (left, right) of a built-in window that equals the mask

    def label(self) -> str:
        return f"{self.name} b{self.b} s{self.s} h{self.h} d{self.d}"

    def shape(self) -> dict:
        return dict(kind="programmable", b=self.b, sq=self.s, sk=self.s, hq=self.h, hkv=self.h, d=self.d,
                    causal=self.mask_mod is not None, modes=["fwd", "bwd"])


def cases(device, quick: bool = False) -> list[Case]:
    from .. import mods
    h, s = (4, 1024) if quick else (16, 16384)
    b, d = 2, 128
    docs = torch.repeat_interleave(torch.arange(8, device=device), s // 8)
    slopes = torch.exp2(-torch.arange(1, h + 1, device=device, dtype=torch.float32) * 8 / h)
    table = torch.zeros(h, 256, device=device, requires_grad=True)
    sb = 1024 if quick else 4096
    bias = (0.1 * torch.randn(1, h, sb, sb, device=device)).requires_grad_()
    win = 2048 if not quick else 128
    return [
        Case("document-causal", b, h, s, d, mask_mod=mods.document(docs), docs=docs),
        Case("prefix-lm", b, h, s, d, mask_mod=mods.prefix_lm(s // 4)),
        Case(f"window{win}+4sinks", b, h, s, d, mask_mod=mods.sliding_window(win, sinks=4), window=(win, 0)),
        Case("alibi-score-causal", b, h, s, d, score_mod=mods.alibi(slopes), mask_mod=mods.causal,
             builtin=dict(causal=True, alibi_slopes=slopes)),
        Case("rel-table-causal", b, h, s, d, score_mod=mods.relative_position(table), mask_mod=mods.causal,
             table=table),
        Case("dense-bias", b, h, sb, d, bias=bias),
        Case("plain-causal-mask_mod", b, h, s, d, mask_mod=mods.causal, builtin=dict(causal=True)),
    ] + [c for dd in (64, 256) for c in _learnable(2048 // dd if not quick else h, s // 2, sb, dd, device)]


def _learnable(h, s, sb, d, device) -> list:
    """The learnable table and the dense bias at another head dim (H * D = 2048, S / 2)."""
    from .. import mods
    table = torch.zeros(h, 256, device=device, requires_grad=True)
    bias = (0.1 * torch.randn(1, h, sb, sb, device=device)).requires_grad_()
    return [Case("rel-table-causal", 2, h, s, d, score_mod=mods.relative_position(table), mask_mod=mods.causal,
                 table=table),
            Case("dense-bias", 2, h, sb, d, bias=bias)]


def visible_pairs(case: Case, device) -> int:
    """Visible (q, k) pairs of one batch entry and head, counted in row blocks (never S x S at once)."""
    if case.mask_mod is None:
        return case.s * case.s
    i = torch.arange(case.s, device=device)
    total = 0
    for r in range(0, case.s, 1024):
        total += int(case.mask_mod(0, 0, i[r:r + 1024, None], i[None, :]).sum().item())
    return total


def _dense_mask(case: Case, device, dtype):
    """The case's mask and bias as one additive [1 | B, H | 1, S, S] tensor (materialised: sdpa-mask only)."""
    i = torch.arange(case.s, device=device)
    add = torch.zeros(1, 1, case.s, case.s, device=device, dtype=dtype)
    if case.mask_mod is not None:
        add = add.masked_fill(~case.mask_mod(0, 0, i[:, None], i[None, :]), float("-inf"))
    if case.score_mod is not None:
        if case.table is not None:
            raise NotServed("a captured table's gradient through a materialised bias is not this suite's peer")
        h = torch.arange(case.h, device=device)[:, None, None]
        add = add + case.score_mod(torch.zeros((), device=device), 0, h, i[:, None], i[None, :]).to(dtype)[None]
    if case.bias is not None:
        add = add + case.bias.to(dtype)
    return add


def implementation(impl: str, case: Case, q, k, v):
    """-> fn(q, k, v) -> out [B, S, H, Dv], or raises NotServed / NotInstalled with the reason."""
    import torch.nn.functional as F

    import flashport
    from .peers import NotInstalled, _fa4
    bhsd = (lambda t: t.transpose(1, 2))   # noqa: E731
    if impl in ("flashport", "flashport-flex", "flashport-triton"):
        backend = {"flashport": None, "flashport-flex": "flex", "flashport-triton": "triton"}[impl]
        bm = (None if case.mask_mod is None
              else flashport.create_block_mask(case.mask_mod, None, None, case.s, case.s, device=q.device))
        return lambda q, k, v: flashport.attention(q, k, v, score_mod=case.score_mod, block_mask=bm,
                                                   attn_bias=case.bias, backend=backend)
    if impl in ("flex", "flex-flash"):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        fx = torch.compile(flex_attention, dynamic=True)
        bm = None if case.mask_mod is None else create_block_mask(case.mask_mod, None, None, case.s, case.s,
                                                                  device=q.device)
        score_mod = case.score_mod
        if case.bias is not None:
            bias = case.bias
            score_mod = lambda s, b, h, i, j: s + bias[0, h, i, j].to(s.dtype)  # noqa: E731
        opts = {"kernel_options": {"BACKEND": "FLASH"}} if impl == "flex-flash" else {}
        if impl == "flex-flash":
            _fa4()   # FLASH runs FlashAttention-4's CuTe kernels: NotInstalled where they are absent
        return lambda q, k, v: bhsd(fx(bhsd(q), bhsd(k), bhsd(v), score_mod=score_mod, block_mask=bm, **opts))
    if impl == "builtin":
        if case.builtin:
            return lambda q, k, v: flashport.attention(q, k, v, **case.builtin)
        if case.docs is not None:
            return _varlen(case, lambda *a, **kw: flashport.attention_varlen(*a, causal=True, **kw))
        if case.window is not None:
            raise NotServed("the built-in window has no sink tokens")
        raise NotServed("no built-in equivalent")
    if impl == "builtin-fa4":
        _fa4()
        if case.score_mod is not None or case.bias is not None:
            raise NotServed("FA4's built-ins have no score_mod or bias equal to this case")
        if case.docs is not None:
            return _varlen(case, lambda *a, **kw: flashport.attention_varlen(*a, causal=True, backend="fa4", **kw))
        if case.builtin.get("causal"):
            return lambda q, k, v: flashport.attention(q, k, v, causal=True, backend="fa4")
        raise NotServed("no FA4 built-in equal to this mask")
    if impl == "fa4":
        fa4 = _fa4()
        if case.score_mod is not None or case.bias is not None:
            raise NotServed("FA4's built-ins have no score_mod or bias equal to this case")
        if case.docs is not None:
            return _varlen(case, lambda q, k, v, cu, cu2, mq, mk: fa4.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu2, max_seqlen_q=mq, max_seqlen_k=mk, causal=True)[0])
        if case.builtin.get("causal"):
            return lambda q, k, v: fa4.flash_attn_func(q, k, v, causal=True)[0]
        raise NotServed("no FA4 built-in equal to this mask")
    if impl == "sdpa-mask":
        need = 2 * case.s * case.s * (case.h if case.bias is not None or case.score_mod is not None else 1)
        if need > 8 * 2**30:
            raise NotServed(f"the materialised mask would take {need / 2**30:.0f} GiB")
        add = _dense_mask(case, q.device, q.dtype)
        return lambda q, k, v: bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), attn_mask=add))
    raise NotInstalled(f"unknown implementation {impl!r}")


def _varlen(case: Case, fn):
    """Packed documents as a varlen call: the batch's documents concatenated, one sequence each."""
    lens = torch.bincount(case.docs).tolist()
    per = torch.tensor([0] + lens, device=case.docs.device).cumsum(0)
    cu = torch.cat([per[:-1] + b * case.s for b in range(case.b)] + [per[-1:] + (case.b - 1) * case.s])
    cu = cu.to(torch.int32)
    mx = max(lens)

    def run(q, k, v):
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        return fn(*flat, cu, cu, mx, mx).view(q.shape[0], q.shape[1], *q.shape[2:3], -1)
    return run


def run_suite(device, quick: bool, impls, tick=lambda: None, match: Optional[str] = None,
              checkpoint=None) -> list[dict]:
    """match: a regular expression; only the cases whose label it finds run (--match).  checkpoint(entries) is
    called after every case, so a run cut at a time limit keeps what it measured."""
    import re

    import flashport

    from .gpu import _err, _status
    from .timing import gpu_ms, wall_s
    entries = []
    for case in cases(device, quick):
        if match and not re.search(match, case.label()):
            continue
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(case.b, case.s, case.h, case.d, device=device, dtype=torch.bfloat16, generator=g)
                   .requires_grad_() for _ in range(3))
        do = torch.randn(case.b, case.s, case.h, case.d, device=device, dtype=torch.bfloat16, generator=g)
        vis = visible_pairs(case, device) * case.b * case.h
        fl = 4.0 * vis * case.d
        grads = (q, k, v) + tuple(t for t in (case.table, case.bias) if t is not None)
        ref = None
        for impl in impls:
            base = dict(suite="programmable", label=case.label(), shape=case.shape(), impl=impl,
                        visible_fraction=vis / (case.b * case.h * case.s * case.s))
            try:
                fn = implementation(impl, case, q, k, v)
                first, out = wall_s(lambda: fn(q, k, v), device)
                fwd = gpu_ms(lambda: fn(q, k, v))
                served = None
                if impl.startswith("flashport"):   # which backends served one training step (the rewrites' calls too)
                    flashport.reset_stats()
                    torch.autograd.grad(fn(q, k, v), grads, do, allow_unused=True)
                    served = {n: {"forward": c["forward"], "backward": c["backward"]}
                              for n, c in flashport.stats().items() if c["forward"] or c["backward"]}
                step = gpu_ms(lambda: torch.autograd.grad(fn(q, k, v), grads, do, allow_unused=True))
                diff = None if ref is None else (out.detach().float() - ref).abs().max().item()
                ref = out.detach().float() if ref is None else ref
                entries.append({**base, "mode": "fwd", "status": "ok", "ms": fwd, "tflops": fl / fwd / 1e9,
                                "first_call_s": first, "max_abs_diff": diff, "served_by": served})
                bwd = max(step - fwd, 1e-6)
                entries.append({**base, "mode": "bwd", "status": "ok", "ms": bwd, "tflops": 2.5 * fl / bwd / 1e9})
            except NotServed as e:
                entries += [{**base, "mode": m, "status": "n/a", "error": str(e)} for m in ("fwd", "bwd")]
            except Exception as e:  # noqa: BLE001  (a peer that fails is a row with its reason, not a crash)
                entries += [{**base, "mode": m, "status": _status(e), "error": _err(e)} for m in ("fwd", "bwd")]
            tick()
        if checkpoint is not None:
            _ratios(entries)
            checkpoint(entries)
    _ratios(entries)
    return entries


def _ratios(entries: list[dict]) -> None:
    """flashport's ratio to each Flex variant per cell (their ms / ours: > 1 is faster), the issue's bars."""
    by = {(e["label"], e["mode"], e["impl"]): e for e in entries if e["status"] == "ok"}
    for (label, mode, impl), e in by.items():
        if impl.startswith("flashport"):
            e["vs"] = {p: by[(label, mode, p)]["ms"] / e["ms"] for p in ("flex", "flex-flash", "builtin", "fa4")
                       if (label, mode, p) in by}


def plot(doc: dict, path: str) -> None:
    """Bars of TFLOP/s over the visible pairs, per case, one panel per mode."""
    from .report import _plt
    plt = _plt()
    ok = [e for e in doc["results"] if e["status"] == "ok"]
    labels = list(dict.fromkeys(e["label"] for e in doc["results"]))
    impls = list(dict.fromkeys(e["impl"] for e in ok))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(labels)), 8), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for r, mode in enumerate(("fwd", "bwd")):
        ax = axes[r][0]
        for n, impl in enumerate(impls):
            vals = [next((e["tflops"] for e in ok if e["label"] == lb and e["mode"] == mode and e["impl"] == impl), 0)
                    for lb in labels]
            ax.bar([x + n * width for x in range(len(labels))], vals, width, label=impl)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels([lb.split(" ")[0] for lb in labels], rotation=20, fontsize=8)
        ax.set_ylabel(f"{mode} TFLOP/s (visible pairs)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=4)
    fig.suptitle(f"flashport bench --suite programmable on {doc['environment']['card']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(entries: list[dict]) -> str:
    rows = [("case", "mode", "impl", "status", "ms", "TFLOP/s", "vs flex", "vs flex-flash", "note")]
    for e in entries:
        vs = e.get("vs") or {}
        f = (lambda x, fmt=".3f": "-" if x is None else format(x, fmt))  # noqa: E731
        rows.append((e["label"], e["mode"], e["impl"], e["status"], f(e.get("ms")), f(e.get("tflops"), ".0f"),
                     f(vs.get("flex"), ".2f"), f(vs.get("flex-flash"), ".2f"), (e.get("error") or "")[:60]))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)
