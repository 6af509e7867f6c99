"""Triton kernels, each next to its plain-torch reference (parity tests: tests/kernels).

Modules: ``kv_cache_write`` (paged K/V scatter), ``decode_attention`` (split-K
paged decode for uniform batches), ``prefill_attention`` (varlen paged
flash attention for any batch, plus the SDPA path), ``rmsnorm`` (fused
residual add + RMSNorm), ``rope`` (in-place neox RoPE), ``sampling`` (sort-free
top-k/top-p/min-p sampling); for the GLM-5 family ``sparse_mla`` (absorbed MLA
over the paged latent cache, sparse over DSA top-k or dense), ``dsa_indexer`` (paged
index scores a token at a time and a radix top-k select), ``dsa_indexer_tiled`` (index
scores for query tiles: prefill and verify rows), ``dsa_select`` (top-k of score rows held
in registers), ``moe_router`` (grouped top-k selection) and
``fused_moe`` (expert alignment and grouped SwiGLU GEMMs); ``fp8_gemm`` (block-scaled
FP8 GEMM with activations quantized in the kernel). Nothing is imported here: importing a kernel
module decorates its ``@triton.jit`` functions, which reads ``TRITON_INTERPRET``.
"""
