"""flashport's Triton kernels.

- attn_fwd: FlashAttention forward (dense and varlen), online softmax with exp2, LSE out.
- attn_bwd: FlashAttention-2 backward (Delta preprocess, dK/dV kernel with the GQA group reduction
  inside, dQ kernel); deterministic, no atomics.
- common: shared @triton.jit helpers (score transform, visibility mask, Philox dropout keep-mask)
  and the launch arguments shared by forward and backward.
- tuning: launch configs (interpreter config, tuned table in flashport/configs, autotune).
- decode / splitkv / merge: the KV-cache (split-KV) decode kernels and the state merge.
- attn_fwd_hopper / attn_bwd_hopper: Gluon (sm_90) forward and backward with FlashAttention-3's
  schedules; launch: their direct launches (the JIT once per specialisation class).

Nothing is imported here on purpose: `triton.jit` decides at decoration time whether a kernel is
compiled or interpreted (TRITON_INTERPRET=1), so kernel modules are imported on first use.
"""
