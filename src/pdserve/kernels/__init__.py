"""Triton kernels, each next to its plain-torch reference (parity tests: tests/kernels).

Modules: ``kv_cache_write`` (paged K/V scatter), ``decode_attention`` (split-K
paged decode for uniform batches), ``prefill_attention`` (varlen paged
flash attention for any batch, plus the SDPA path), ``rmsnorm`` (fused
residual add + RMSNorm), ``rope`` (in-place neox RoPE), ``sampling`` (sort-free
top-k/top-p/min-p sampling). Nothing is imported here: importing a kernel
module decorates its ``@triton.jit`` functions, which reads ``TRITON_INTERPRET``.
"""
