"""What pdserve's Triton (and Gluon) kernels compile to on Hopper (sm_90a), on any machine:
no GPU needed, only the ``ptxas`` that Triton's wheel carries.

    .venv/bin/python tools/sm90_report.py [--only mla_wide,moe_prefill] [--json OUT]
                                          [--drop-alignment]

Each variant is one kernel with the launch shape the engine gives it on an H200 at GLM-5 /
DeepSeek-V3.2 dims (the configs are imported from the kernel modules, so a changed
default is what gets checked). Arguments are specialised as a real launch specialises
them: pointers 16-byte aligned, the integer arguments a variant lists as multiples of 16
(strides of contiguous rows). Per variant: registers per thread and spill bytes (from
``ptxas -v``), shared memory, how many warpgroup MMAs (``wgmma``), warp MMAs
(``mma.sync``) and asynchronous copies (``cp.async``) the PTX holds, and the SASS
instructions of its largest loop (``cuobjdump -sass``, also from Triton's wheel).

What it answers before any device time is spent: whether a tile config fits a Hopper
multiprocessor (``MAX_SHARED`` bytes a block, 255 registers a thread), whether it spills,
whether its dots became wgmma and whether its tile loads are pipelined as cp.async (a
load that Triton cannot prove 16-byte aligned stays a synchronous register load). It
does not time anything: speed needs the GPU. ``--drop-alignment`` compiles the variants
without the integer alignment a launch proves (to see what it buys). Run it in a process
of its own: with ``TRITON_INTERPRET=1`` (set by the CPU kernel tests) the kernels are
interpreted functions and cannot be compiled, so it refuses to start then.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MAX_SHARED = 232448  # bytes of shared memory a block may use on sm_90 (227 KiB)
MAX_REGS = 255


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: Callable[[], Any]  # returns the @triton.jit function (imported late)
    constexprs: Callable[[], dict[str, Any]]  # evaluated late too (configs live in modules)
    pointers: dict[str, str]  # argument -> Triton pointer type ("*bf16")
    aligned_ints: frozenset[str] = frozenset()  # those of them the kernel has
    floats: frozenset[str] = frozenset()
    warps: int = 4
    stages: int = 3
    expect_wgmma: bool = False  # the variant must use warpgroup MMAs
    expect_cp_async: bool = False  # its tile loads must be pipelined
    expect_no_spills: bool = False
    fp_fusion: bool = True  # False: launched with enable_fp_fusion=False (no FMA contraction)
    expect_pdl: bool = False  # compiled with PDL on: it must wait on its predecessor grid
    expect_tma: bool = False  # its tiles must be copied by the Tensor Memory Accelerator
    maxnreg: int | None = None  # the launch's register budget a thread (warp-specialized)
    # at most this much shared memory: a row-wise kernel needs only its reductions' scratch
    # (a 1-D -> 2-D reshape through shared memory made the quantizing norm ~5x slower)
    max_shared_bytes: int | None = None
    # at most this many SASS instructions in the kernel's largest loop (one iteration):
    # where an fp8 tile halves the bytes an iteration moves, the loop's instruction count
    # is what bounds a bandwidth-bound kernel
    max_loop_instructions: int | None = None
    notes: str = field(default="", compare=False)


def _mla_kernel() -> Any:
    from pdserve.kernels.sparse_mla import _mla_kernel

    return _mla_kernel


def _mla_consts(cfg_name: str, split: bool) -> Callable[[], dict[str, Any]]:
    def consts() -> dict[str, Any]:
        from pdserve.kernels import sparse_mla

        cfg = getattr(sparse_mla, cfg_name)
        return dict(NUM_HEADS=64, LAT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, PAGE=64,
                    BLOCK_HH=cfg.block_h, BLOCK_N=cfg.block_n, HAS_TOPK=True, SPLIT=split,
                    EVEN=True, DOT_PREC="tf32", UPCAST=False)  # fmt: skip

    return consts


def _mla_launch(cfg_name: str) -> tuple[int, int]:
    from pdserve.kernels import sparse_mla

    cfg = getattr(sparse_mla, cfg_name)
    return cfg.warps, cfg.stages


_MLA_PTRS = {
    "qlat_ptr": "*bf16", "qpe_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32",
    "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "req_ptr": "*i64", "qidx_ptr": "*i64",
    "topk_ptr": "*i64", "out_ptr": "*bf16", "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32",
}  # fmt: skip
_MLA_INTS = frozenset({"stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_cb",
                       "stride_cs", "stride_tk", "stride_ot", "stride_oh", "num_cand_k"})  # fmt: skip


def _moe_consts(tokens: int, down: bool) -> Callable[[], dict[str, Any]]:
    def consts() -> dict[str, Any]:
        from pdserve.kernels.fused_moe import _config

        cfg = _config(tokens * 8, 64)
        c = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 DOT_PREC="tf32", UPCAST=False, GROUP_M=cfg.group_m)  # fmt: skip
        if not down:
            c["TOPK"] = 8
        return c

    return consts


def _moe_launch(tokens: int) -> tuple[int, int]:
    from pdserve.kernels.fused_moe import _config

    cfg = _config(tokens * 8, 64)
    return cfg.warps, cfg.stages


def _moe_kernel(down: bool) -> Callable[[], Any]:
    def get() -> Any:
        from pdserve.kernels import fused_moe

        return fused_moe._down_kernel if down else fused_moe._gate_up_kernel

    return get


_GATE_UP_PTRS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "pairs_ptr": "*i32",
                 "block_expert_ptr": "*i32"}  # fmt: skip
_DOWN_PTRS = {**{k: v for k, v in _GATE_UP_PTRS.items() if k != "x_ptr"}, "a_ptr": "*bf16",
              "weights_ptr": "*fp32"}  # fmt: skip
_MOE_INTS = frozenset({"H", "INTER", "stride_xt", "stride_at", "stride_we", "stride_wn",
                       "stride_ot"})  # fmt: skip


def _indexer_kernel() -> Any:
    from pdserve.kernels.dsa_indexer_tiled import _tiled_logits_kernel

    return _tiled_logits_kernel


def _indexer_tile(which: str) -> Any:
    from pdserve.kernels import dsa_indexer_tiled as m

    if which == "prefill":
        return m.PREFILL_TILE
    cfg = m.verify_config(4, 32)  # 1 + 3 rows
    if which.startswith("verify_keys"):  # the transposed tile, on 4 or 8 warps (_w8)
        return replace(cfg, variant="keys", num_warps=8 if which.endswith("_w8") else 4)
    return cfg


def _indexer_consts(which: str, fp8: bool = False) -> Callable[[], dict[str, Any]]:
    def consts() -> dict[str, Any]:
        from pdserve.kernels._utils import next_pow2

        cfg = _indexer_tile(which)
        bt = cfg.bt if which == "prefill" else min(cfg.bt, next_pow2(4))
        return dict(NH=32, D=128, BLOCK_H=32, BLOCK_D=128, PAGE=64, BT=bt, BN=cfg.bn,
                    SPAN=cfg.span, HEAD_LOOP=cfg.variant == "heads",
                    KEYS_M=cfg.variant == "keys", DOT_PREC="tf32",
                    UPCAST=False, FILL=False, KEY_SCALE=fp8)  # fmt: skip

    return consts


_INDEXER_PTRS = {"q_ptr": "*bf16", "w_ptr": "*fp32", "cache_ptr": "*bf16", "ks_ptr": "*bf16",
                 "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
                 "out_ptr": "*fp32"}  # fmt: skip
# --kv-cache-dtype fp8: fp8 keys, a float32 scale a key (kernels/index_cache.py)
_INDEXER_FP8_PTRS = {**_INDEXER_PTRS, "cache_ptr": "*fp8e4nv", "ks_ptr": "*fp32"}
_INDEXER_INTS = frozenset({"stride_qt", "stride_qh", "stride_wt", "stride_cb", "stride_cs",
                           "stride_kb", "stride_ot", "width", "topk_k"})  # fmt: skip


def _select_kernel() -> Any:
    from pdserve.kernels.dsa_select import _reg_select_kernel

    return _reg_select_kernel


def _select_consts(width: int, hist: bool = False, tail: int = 0) -> Callable[[], dict[str, Any]]:
    def consts() -> dict[str, Any]:
        from pdserve.kernels import dsa_select as m

        block = width
        return dict(BLOCK=block, BLOCK_K=1024, SPLITS=min(m.REG_SELECT_SPLITS,
                    block.bit_length() - 5), CHUNK=min(block, m.REG_SELECT_CHUNK),
                    HIST=hist, TAIL=tail)  # fmt: skip

    return consts


def split_select_variants() -> list[Variant]:
    """The split top-k select (``kernels/dsa_select_split.py``) at a decode graph's 32K
    width with its default shapes: the scan and the pick."""
    from pdserve.kernels import dsa_select_split as m

    p = m.split_chunks(32768)
    place = {"logits_ptr": "*fp32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
             "req_ptr": "*i64", "qidx_ptr": "*i64", "counts_ptr": "*i32", "above_ptr": "*i32",
             "cand_ptr": "*i32", "bounds_ptr": "*i32"}  # fmt: skip
    return [
        Variant("select_split_scan", _kernel("dsa_select_split", "_scan_kernel"),
                _fixed(P=p, BLOCK_C=32768 // p, SAMPLE=m.SPLIT_SAMPLE, CAP=m.SPLIT_CAP),
                place, frozenset({"stride_lt", "K"}), frozenset({"margin"}),
                # its sample's search step: 150 SASS instructions as two 1-D reductions,
                # 883 as one [SAMPLE, 2] compare (the broadcast's layout shuffles)
                m.SPLIT_WARPS[0], 1, expect_no_spills=True, max_loop_instructions=300),
        Variant("select_split_pick", _kernel("dsa_select_split", "_pick_kernel"),
                _fixed(P=p, CAP=m.SPLIT_CAP, BLOCK_K=1024, RADIX_BLOCK=m.RADIX_BLOCK),
                place | {"out_ptr": "*i64"}, frozenset({"stride_lt", "stride_ot", "K"}),
                frozenset(), m.SPLIT_WARPS[1], 1, expect_no_spills=True),
    ]  # fmt: skip


def _select_warps(width: int) -> int:
    from pdserve.kernels.dsa_select import reg_select_warps

    return reg_select_warps(width)


_SELECT_PTRS = {"logits_ptr": "*fp32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
                "req_ptr": "*i64", "qidx_ptr": "*i64", "out_ptr": "*i64"}  # fmt: skip


def _kernel(module: str, name: str) -> Callable[[], Any]:
    def get() -> Any:
        import importlib

        return getattr(importlib.import_module(f"pdserve.kernels.{module}"), name)

    return get


def _fixed(**consts: Any) -> Callable[[], dict[str, Any]]:
    return lambda: dict(consts)


_SKINNY_PTRS = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "r_ptr", "nw_ptr",
                                      "ro_ptr")} | {"ws_ptr": "*fp32", "part_ptr": "*fp32",
                                                    "cnt_ptr": "*i32"}  # fmt: skip
_SKINNY_INTS = frozenset({"N", "K", "K_SLICE", "stride_x", "stride_w", "stride_y", "stride_r",
                          "stride_ro"})  # fmt: skip


def skinny_variants() -> list[Variant]:
    """The decode-size GEMM (issue 30) at Llama-8B dims as the model launches it: at
    ``default_config``'s tiles for one row (the register path, loads without cp.async;
    plain, dependently launched with its early weight loads, and with the SiLU-and-mul
    prologue) and for 16 rows (a 16-row MMA tile, whose weight tiles must be pipelined;
    plain, as ``prologue_pays`` folds nothing there); none may spill. The report's loop
    column shows what a prologue costs a K step."""
    from pdserve.kernels.skinny_gemm import (
        PROLOGUES,
        block_rows,
        default_config,
        fit_stages,
        prologue_pays,
        wide_fp8_steps,
    )

    out = []
    for rows in (1, 16):
        cfg = default_config(rows)
        bm = block_rows(cfg, rows)
        for name, prologue, res, one_pass, pdl in (("", "none", False, False, False),
                                                   ("_pdl", "none", False, False, True),
                                                   ("_silu", "silu_mul", False, False, False)):  # fmt: skip
            if (pdl and bm > 1) or (prologue != "none" and not prologue_pays(rows, prologue)):
                continue  # only what the model launches (early weight steps: one row)
            consts = _fixed(PROLOGUE=PROLOGUES.index(prologue), HAS_RES=res, HAS_BIAS=False,
                            FP8_W=False, SCALE_ROWS=128, BLOCK_M=bm, BLOCK_N=cfg.block_n,
                            BLOCK_K=cfg.block_k, ONE_PASS=one_pass, PDL=pdl,
                            EARLY_W=cfg.early_w if bm == 1 else 0)  # fmt: skip
            stages = fit_stages(cfg, bm, 2, 2, prologue, res)
            out.append(Variant(f"skinny{rows}{name}", _kernel("skinny_gemm", "_skinny_gemm_kernel"),
                               consts, _SKINNY_PTRS, _SKINNY_INTS, frozenset({"eps"}),
                               cfg.num_warps, stages, expect_cp_async=bm > 1,
                               expect_no_spills=True, expect_pdl=pdl))  # fmt: skip
        # FP8 weights (weight-only, PDSERVE_SKINNY_ROWS) at their default tiles (o_proj's
        # 4096 columns): one row wide K steps read as int32 words, more rows 128-wide
        # steps with split-K
        f8 = default_config(rows, fp8=True, n=4096)
        assert wide_fp8_steps(f8, 128) == (bm == 1)
        consts = _fixed(PROLOGUE=0, HAS_RES=False, HAS_BIAS=False, FP8_W=True, SCALE_ROWS=128,
                        BLOCK_M=bm, BLOCK_N=f8.block_n, BLOCK_K=f8.block_k, ONE_PASS=False,
                        SPLIT_K=f8.split_k, PDL=bm == 1, EARLY_W=f8.early_w if bm == 1 else 0,
                        F8ASM=True, WORDS=bm == 1)  # fmt: skip
        out.append(Variant(f"skinny{rows}_fp8", _kernel("skinny_gemm", "_skinny_gemm_kernel"),
                           consts, _SKINNY_PTRS | {"w_ptr": "*fp8e4nv"}, _SKINNY_INTS,
                           frozenset({"eps"}), f8.num_warps, fit_stages(f8, bm, 2, 1),
                           expect_cp_async=bm > 1, expect_no_spills=True,
                           expect_pdl=bm == 1))  # fmt: skip
    return out


def decode_prep_variants() -> list[Variant]:
    """The small fused kernels of the decode path (issue 30) at GLM-5 / Llama-8B dims: each
    replaces a chain of torch launches, so it must stay cheap (few registers, no spills)."""
    out = [
        Variant("rope_kv_write", _kernel("kv_cache_write", "_rope_kv_write_kernel"),
                _fixed(HEAD_D=128, HALF=64, BLOCK_HALF=64, BLOCK_D=128, BLOCK_H=32, PAGE=16,
                       ROUND=True, FP8_MAX=0.0, ROUND_FIRST=False),
                {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16",
                 "vc_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                 "slot_ptr": "*i64"},
                frozenset({"stride_qt", "stride_kt", "stride_vt", "stride_vh", "stride_kcb",
                           "stride_kcs", "stride_kch", "stride_vcb", "stride_vcs",
                           "stride_vch", "stride_cos", "stride_sin"}),
                frozenset({"k_scale", "v_scale"}), 4, 1, expect_no_spills=True,
                fp_fusion=False),
    ]  # fmt: skip
    for cache in ("bf16", "fp8e4nv"):
        out.append(
            Variant(f"mla_prep_{cache[:4]}", _kernel("mla_prep", "_mla_prep_kernel"),
                    _fixed(LAT=512, BLOCK_L=512, HALF=32, BLOCK_HALF=32, BLOCK_H=64, PAGE=64,
                           INTERLEAVED=True, ROUND=True,
                           FP8_MAX=448.0 if cache != "bf16" else 0.0, ROUND_FIRST=False),
                    {"q_ptr": "*bf16", "kv_ptr": "*bf16", "w_ptr": "*bf16", "pos_ptr": "*i64",
                     "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64",
                     "cache_ptr": f"*{cache}", "out_ptr": "*bf16"},
                    frozenset({"stride_qt", "stride_qh", "stride_kvt", "stride_cos",
                               "stride_sin", "stride_cb", "stride_cs", "stride_ot",
                               "stride_oh"}),
                    frozenset({"eps", "kv_scale"}), 4, 1, expect_no_spills=True,
                    fp_fusion=False)
        )  # fmt: skip
    for fp8 in (False, True):
        out.append(
            Variant(f"indexer_prep{'_fp8' if fp8 else ''}",
                    _kernel("mla_prep", "_indexer_prep_kernel"),
                    _fixed(D=128, BLOCK_D=128, HALF=32, BLOCK_HALF=32, BLOCK_NH=32, PAGE=64,
                           INTERLEAVED=True, ROUND=True, KEY_FP8=fp8, FP8_MAX=448.0,
                           ROUND_FIRST=False),
                    {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*bf16", "lnw_ptr": "*bf16",
                     "lnb_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*bf16",
                     "sin_ptr": "*bf16", "slot_ptr": "*i64",
                     "cache_ptr": "*fp8e4nv" if fp8 else "*bf16",
                     "ks_ptr": "*fp32" if fp8 else "*bf16", "q_out_ptr": "*bf16",
                     "w_out_ptr": "*fp32"},
                    frozenset({"stride_qt", "stride_cos", "stride_sin", "stride_cb",
                               "stride_cs", "stride_qot"}),
                    frozenset({"eps", "w_scale"}), 4, 1, expect_no_spills=True,
                    fp_fusion=False)
        )  # fmt: skip
    for name, n in (("moe_align_b1", 8), ("moe_align_b128", 1024)):
        out.append(
            Variant(name, _kernel("moe_align", "_align_kernel"),
                    _fixed(BM=16, BLOCK_N=max(16, n), BLOCK_E=512, CHUNK=16, BLOCK_B=64,
                           BLOCK_S=1024),
                    {"ids_ptr": "*i64", "pairs_ptr": "*i32", "block_expert_ptr": "*i32"},
                    frozenset(), frozenset(), 4, 1, expect_no_spills=True)
        )  # fmt: skip
    out.append(
        Variant("post_update", _kernel("request_state", "_post_update_kernel"),
                _fixed(HAS_NUM=True, HAS_ROWS=True, HAS_DRAFTS=True, BLOCK_W=4,
                       BLOCK_K=4),
                {n: "*i1" if n == "samples_ptr" else "*i64" for n in (
                    "rows_ptr", "nsched_ptr", "num_rows_ptr", "samples_ptr", "tokens_ptr",
                    "num_ptr", "drafts_ptr", "last_ptr", "sampled_ptr", "num_sampled_ptr",
                    "state_drafts_ptr", "computed_ptr")},
                frozenset(), frozenset(), 1, 1, expect_no_spills=True)
    )  # fmt: skip
    out.append(
        Variant("place", _kernel("request_state", "_place_kernel"),
                _fixed(DRAFTING=True, BLOCK=128),
                {n: "*i32" if n in ("seq_ptr", "bt_ptr") else "*i64" for n in (
                    "ids_ptr", "pos_ptr", "seq_ptr", "slots_ptr", "req_idx_ptr", "q_idx_ptr",
                    "bt_ptr", "rows_ptr", "nsched_ptr", "last_at_ptr", "last_req_ptr",
                    "drafts_ptr", "draft_at_ptr", "draft_flat_ptr", "last_tok_ptr",
                    "computed_ptr")},
                frozenset(), frozenset(), 4, 1, expect_no_spills=True)
    )  # fmt: skip
    for hidden, quant in ((4096, False), (4096, True), (6144, True)):  # the (fp8-out) norm
        block = 1 << (hidden - 1).bit_length()
        out.append(
            Variant(f"rmsnorm_add_{hidden}{'_fp8' if quant else ''}",
                    _kernel("rmsnorm", "_rmsnorm_kernel"),
                    _fixed(HAS_RES=True, BLOCK=block, QUANT=quant, KEEP_HP=False, QMAX=448.0,
                           ROUND_FIRST=False, GROUP=128),
                    {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                     "r_out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32"},
                    frozenset({"stride_x", "stride_r", "stride_o", "stride_ro", "stride_q"}),
                    frozenset({"eps"}), min(16, max(1, block // 512)), 1,
                    expect_no_spills=True, max_shared_bytes=512)
        )  # fmt: skip
    for name, kernel, pointers in (
        ("silu_mul_fp8", "_silu_and_mul_kernel",
         {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "qs_ptr": "*fp32"}),
        ("quantize_fp8", "_quantize_kernel",
         {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32"}),
    ):  # the other quantizing producers: [8, 128] tiles, no shared memory
        quant = {"QUANT": True} if kernel == "_silu_and_mul_kernel" else {}
        out.append(
            Variant(name, _kernel("activation", kernel),
                    _fixed(BLOCK=1024, QMAX=448.0, ROUND_FIRST=False, GROUP=128, **quant),
                    pointers, frozenset(), frozenset(), 4, 1, expect_no_spills=True,
                    max_shared_bytes=512)
        )  # fmt: skip
    for pdl in (False, True):  # on Hopper, where PDL is on, decode kernels compile as the 2nd
        out.append(
            Variant(f"moe_combine{'_pdl' if pdl else ''}", _kernel("moe_align", "_combine_kernel"),
                    _fixed(K=8, BLOCK=1024, HAS_ADD=True, PDL=pdl),
                    {"rows_ptr": "*bf16", "add_ptr": "*bf16", "out_ptr": "*bf16"},
                    frozenset({"H", "stride_r", "stride_a", "stride_o"}), frozenset(), 4, 1,
                    expect_no_spills=True, expect_pdl=pdl)
        )  # fmt: skip
    return out


def decode_attention_variants() -> list[Variant]:
    """The paged decode kernel at Llama-8B dims (32 query / 8 KV heads, head dim 128, one
    token a request, 16-token pages, split-K) over a bf16 and an fp8 cache, with the
    engine's tile config and pipelining depth; the fp8 cache once more with its MMAs in
    bf16 (``FP8_HALF`` off) beside the default fp16."""

    from pdserve.kernels import decode_attention as da

    def consts(half: bool | None) -> Callable[[], dict[str, Any]]:
        def get() -> dict[str, Any]:
            block_m, dot, block_n, _ = da._config(4, 128)
            on = da.FP8_HALF if half is None else half
            return dict(G=4, NUM_HEADS=32, HEAD_D=128, BLOCK_D=128, PAGE=16, BLOCK_M=block_m,
                        BLOCK_N=block_n, USE_DOT=dot, SPLIT=True, DOT_PREC="tf32",
                        UPCAST=False, HALF=on, ASM=on)  # fmt: skip

        return get

    ints = frozenset({"stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh",
                      "stride_vb", "stride_vs", "stride_vh", "stride_bt", "stride_ot",
                      "stride_oh"})  # fmt: skip
    out = []
    for name, cache, half, stages, limit in (
        ("decode_bf16", "bf16", False, da.NUM_STAGES, None),
        ("decode_fp8", "fp8e4nv", None, da.NUM_STAGES_FP8, 520),  # 855 with bf16 MMAs
        ("decode_fp8_bf16mma", "fp8e4nv", False, da.NUM_STAGES_FP8, None),
    ):
        ptrs = {"q_ptr": "*bf16", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "bt_ptr": "*i32",
                "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "ws_o_ptr": "*fp32",
                "ws_lse_ptr": "*fp32"}  # fmt: skip
        out.append(Variant(name, _kernel("decode_attention", "_decode_kernel"), consts(half),
                           ptrs, ints, frozenset({"qk_scale"}), 4, stages,
                           expect_no_spills=True, max_loop_instructions=limit))  # fmt: skip
    return out


def _prefill_kernel() -> Any:
    from pdserve.kernels.sparse_mla_prefill import _prefill_kernel

    return _prefill_kernel


def _prefill_consts(name: str) -> Callable[[], dict[str, Any]]:
    def consts() -> dict[str, Any]:
        import torch

        from pdserve.kernels import sparse_mla_prefill as m

        c = m.launch_constexprs(64, 512, 64, m.VARIANTS[name], torch.bfloat16)
        return {**c, "DOT_PREC": "tf32", "UPCAST": False}

    return consts


def mla_prefill_variants() -> list[Variant]:
    """The prefill variants of the sparse MLA kernel (kernels/sparse_mla_prefill.py), as
    ``mla_pf_<name>``: all must compile to wgmma, pipelined, without spills."""
    from pdserve.kernels.sparse_mla_prefill import VARIANTS

    ptrs = {"qlat_ptr": "*bf16", "qpe_ptr": "*bf16", "cache_ptr": "*bf16", "rows_ptr": "*i32",
            "ncand_ptr": "*i32", "out_ptr": "*bf16"}  # fmt: skip
    ints = frozenset({"stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_cs",
                      "stride_rt", "stride_ot", "stride_oh"})  # fmt: skip
    return [Variant(f"mla_pf_{name}", _prefill_kernel, _prefill_consts(name), ptrs, ints,
                    frozenset({"qk_scale"}), v.warps, v.stages, expect_wgmma=True,
                    expect_cp_async=True, expect_no_spills=True)
            for name, v in VARIANTS.items()]  # fmt: skip


def _gluon_kernel() -> Any:
    from pdserve.kernels.sparse_mla_gluon import _gluon_prefill_kernel

    return _gluon_prefill_kernel


def mla_gluon_variants() -> list[Variant]:
    """The Gluon sparse MLA prefill kernel (kernels/sparse_mla_gluon.py), as ``mla_<name>``:
    wgmma, cp.async gathers, no spills, and its buffers within a multiprocessor."""
    from pdserve.kernels import sparse_mla_gluon as m

    ptrs = {"qlat_ptr": "*bf16", "qpe_ptr": "*bf16", "cache_ptr": "*bf16", "rows_ptr": "*i32",
            "ncand_ptr": "*i32", "out_ptr": "*bf16"}  # fmt: skip
    ints = frozenset({"stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_cs",
                      "stride_rt", "stride_ot", "stride_oh"})  # fmt: skip
    from pdserve.kernels import sparse_mla_gluon_ws as ws

    plain = [Variant(f"mla_{name}", _gluon_kernel,
                     lambda name=name: m.launch_constexprs(512, 64, name), ptrs, ints,
                     frozenset({"qk_scale"}), m.WARPS, 1, expect_wgmma=True,
                     expect_cp_async=True, expect_no_spills=True)
             for name in m.VARIANTS if name != "gluon_ws"]  # fmt: skip
    return plain + [Variant("mla_gluon_ws", _gluon_ws_kernel, lambda: ws.launch_constexprs(512, 64),
                            ptrs, ints, frozenset({"qk_scale"}), ws.WARPS, 1, expect_wgmma=True,
                            expect_cp_async=True, maxnreg=ws.MAXNREG,
                            notes="ptxas spills ~270 bytes in one math partition at 240 "
                                  "registers (the other none)")]  # fmt: skip


def _gluon_ws_kernel() -> Any:
    from pdserve.kernels.sparse_mla_gluon_ws import _gluon_ws_kernel

    return _gluon_ws_kernel


def _fp8_gluon_kernel() -> Any:
    from pdserve.kernels.fp8_gemm_gluon import _fp8_gemm_kernel

    return _fp8_gemm_kernel


def _fp8_swap_kernel() -> Any:
    from pdserve.kernels.fp8_gemm_gluon import _fp8_gemm_swap_kernel

    return _fp8_gemm_swap_kernel


def _fp8_tma_kernel() -> Any:
    from pdserve.kernels.fp8_gemm_gluon import _fp8_gemm_tma_kernel

    return _fp8_gemm_tma_kernel


def _fp8_ws_kernel() -> Any:
    from pdserve.kernels.fp8_gemm_gluon_ws import _fp8_gemm_ws_kernel

    return _fp8_gemm_ws_kernel


def _tile_desc_type() -> str:
    """The argument type of a 128 x 128 fp8 tile descriptor (as a launch would mangle it)."""
    import torch
    from triton.runtime.jit import mangle_type

    from pdserve.kernels.fp8_gemm_gluon_tiles import tile_descs

    t = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    return str(mangle_type(tile_descs(t, t)[0]))


def fp8_gluon_variants() -> list[Variant]:
    """The Gluon FP8 GEMM (kernels/fp8_gemm_gluon.py) at DeepSeek-V3's 128 x 128 weight
    blocks: wgmma, cp.async (TMA for the TMA tile kernel), no spills."""
    from pdserve.kernels import fp8_gemm_gluon as m

    ptrs = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
            "out_ptr": "*bf16"}  # fmt: skip
    ints = frozenset({"K", "stride_xm", "stride_xsm", "stride_wn", "stride_om"})
    out = [Variant("fp8_gluon_prefill", _fp8_gluon_kernel, lambda: m.launch_constexprs(128),
                   ptrs, ints, frozenset(), m.WARPS, 1, expect_wgmma=True,
                   expect_cp_async=True, expect_no_spills=True)]  # fmt: skip
    tile = _tile_desc_type()  # both operands' descriptors
    descs = {"xs_ptr": "*fp32", "ws_ptr": "*fp32", "out_ptr": "*bf16"}
    out.append(Variant("fp8_gluon_prefill_tma", _fp8_tma_kernel, lambda: m.tma_constexprs(128),
                       {**descs, "a_desc": tile, "b_desc": tile},
                       frozenset({"K", "stride_xsm", "stride_om"}), frozenset(), m.WARPS, 1,
                       expect_wgmma=True, expect_no_spills=True, expect_tma=True))  # fmt: skip
    from pdserve.kernels import fp8_gemm_gluon_ws as ws

    out.append(Variant("fp8_gluon_prefill_ws", _fp8_ws_kernel, lambda: ws.ws_constexprs(128),
                       {**descs, "a_desc": tile, "b_desc": tile},
                       frozenset({"K", "stride_xsm", "stride_om"}), frozenset(), ws.WARPS, 1,
                       expect_wgmma=True, expect_no_spills=True, expect_tma=True,
                       maxnreg=ws.MAXNREG))  # fmt: skip
    for rows in (16, 64):  # decode batches of 1-16 and 33-64 rows: the swapped kernel
        consts = dict(SCALE_N=128, BLOCK_N=m.DECODE_BLOCK_N, BLOCK_M=rows, BLOCK_K=m.BLOCK_K,
                      STAGES=m.DECODE_STAGES)  # fmt: skip
        out.append(Variant(f"fp8_gluon_decode_m{rows}", _fp8_swap_kernel,
                           lambda c=consts: dict(c), ptrs, ints | {"stride_os"}, frozenset(),
                           m.DECODE_WARPS, 1, expect_wgmma=True, expect_cp_async=True,
                           expect_no_spills=True))  # fmt: skip
    return out


def variants() -> list[Variant]:
    """The checked launch shapes (launch options resolved from the kernel modules)."""
    out = []
    # (name, config, split-K, wgmma and cp.async expected, no spills expected)
    for name, cfg, split, strict, no_spills in (
        # prefill chunks of 1K+ rows: it spills ~230 bytes and was still the fastest
        # general-kernel shape at 2K-16K on the H200 (run 41)
        ("mla_prefill", "CONFIG_PREFILL", False, True, False),
        ("mla_wide", "CONFIG_WIDE", False, True, True),  # verify / decode of 64+ rows
        ("mla_many", "CONFIG_MANY_TOKENS", True, False, False),
        ("mla_few", "CONFIG_FEW_TOKENS", True, False, False),  # decode of a few rows, split-K
    ):
        warps, stages = _mla_launch(cfg)
        out.append(Variant(name, _mla_kernel, _mla_consts(cfg, split), _MLA_PTRS, _MLA_INTS,
                           frozenset({"qk_scale"}), warps, stages, expect_wgmma=strict,
                           expect_cp_async=strict, expect_no_spills=no_spills))  # fmt: skip
    for name, tokens in (("moe_prefill", 4096), ("moe_verify", 512)):
        warps, stages = _moe_launch(tokens)
        for down in (False, True):
            out.append(Variant(f"{name}_{'down' if down else 'gate_up'}", _moe_kernel(down),
                               _moe_consts(tokens, down), _DOWN_PTRS if down else _GATE_UP_PTRS,
                               _MOE_INTS, frozenset(), warps, stages, expect_wgmma=True,
                               expect_cp_async=True, expect_no_spills=True))  # fmt: skip
    for which, fp8 in (("prefill", False), ("verify", False), ("verify_keys", False),
                       ("verify_keys_w8", False), ("prefill", True)):  # fmt: skip
        cfg = _indexer_tile(which)
        out.append(Variant(f"indexer_{which}{'_fp8' if fp8 else ''}", _indexer_kernel,
                           _indexer_consts(which, fp8), _INDEXER_FP8_PTRS if fp8 else
                           _INDEXER_PTRS, _INDEXER_INTS, frozenset({"scale"}), cfg.num_warps,
                           cfg.num_stages, expect_wgmma=True, expect_cp_async=True,
                           expect_no_spills=True))  # fmt: skip
    out.append(Variant("router_logits", _kernel("moe_router", "_router_logits_kernel"),
                       _fixed(BLOCK_T=64, BLOCK_E=64, BLOCK_K=64, UPCAST=False),
                       {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"},
                       frozenset({"H", "stride_xt", "stride_we", "stride_ot"}), frozenset(), 4, 3,
                       expect_wgmma=True, expect_no_spills=True))  # fmt: skip
    # rows in registers; the byte-histogram variant spills (off by default, RESULTS.md run 58)
    # (and rows just past half the block as two tiles: PDSERVE_SELECT_TAIL)
    for width, hist, tail in ((16384, False, 0), (32768, False, 0), (16384, True, 0),
                              (32768, False, 16)):  # fmt: skip
        name = f"select_{width // 1024}k{'_hist' if hist else ''}{f'_tail{tail}' if tail else ''}"
        out.append(Variant(name, _select_kernel, _select_consts(width, hist, tail), _SELECT_PTRS,
                           frozenset({"stride_lt", "stride_ot", "K"}), frozenset(),
                           _select_warps(width), 1, expect_no_spills=not hist))  # fmt: skip
    return (out + mla_prefill_variants() + mla_gluon_variants() + fp8_gluon_variants()
            + decode_prep_variants() + decode_attention_variants() + skinny_variants()
            + split_select_variants())


def _ptxas() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_variant(v: Variant) -> Any:
    """The Triton ``CompiledKernel`` of ``v`` for sm_90a (no device involved)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = v.kernel()
    consts = v.constexprs()
    names = list(fn.arg_names)
    for prm in fn.params:  # constexprs the variant leaves out take their defaults (PDL: off)
        if prm.is_constexpr and prm.name not in consts and prm.default is not inspect._empty:
            consts[prm.name] = prm.default
    unknown = (set(consts) | set(v.pointers) | v.floats) - set(names)
    if unknown:
        raise ValueError(f"{v.name}: {fn.__name__} has no argument(s) {sorted(unknown)}")
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in v.pointers:
            sig[n] = v.pointers[n]
        else:
            sig[n] = "fp32" if n in v.floats else "i32"
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in names if (n in v.pointers and not v.pointers[n].startswith("tensordesc"))
             or n in v.aligned_ints}  # fmt: skip
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a @gluon.jit kernel
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource
    src = source(fn, sig, constexprs={(names.index(k),): c for k, c in consts.items()},
                 attrs=attrs)  # fmt: skip
    opts = {"num_warps": v.warps, "num_stages": v.stages, "enable_fp_fusion": v.fp_fusion}
    if v.maxnreg is not None:
        opts["maxnreg"] = v.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loop_instructions(sass: str) -> int:
    """SASS instructions in the largest loop of ``sass`` (``cuobjdump -sass``): the span
    from a backward branch's target to the branch, in 16-byte instructions; 0 without
    a loop. One iteration's instruction count where the loop has no inner branches."""
    best = 0
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if not m or not m.group(3).startswith("BRA"):
            continue
        here = int(m.group(1), 16)
        target = re.search(r"0x([0-9a-f]+)", m.group(4))
        if target and int(target.group(1), 16) < here:
            best = max(best, (here - int(target.group(1), 16)) // 16 + 1)
    return best


def report(v: Variant) -> dict[str, Any]:
    """Resources and instruction counts of ``v`` compiled for sm_90a, with ``problems``:
    the expectations of the variant it misses (empty: all met)."""
    k = compile_variant(v)
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.ptx"
        path.write_text(ptx)
        cubin = Path(d) / "k.cubin"
        res = subprocess.run([str(_ptxas()), "-arch=sm_90a", "-v", str(path), "-o", str(cubin)],
                             capture_output=True, text=True, check=True)  # fmt: skip
        sass = subprocess.run([str(_ptxas().with_name("cuobjdump")), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    info = res.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    out: dict[str, Any] = {
        "variant": v.name,
        "warps": v.warps,
        "stages": v.stages,
        "constexprs": {k_: c for k_, c in v.constexprs().items() if k_.startswith("BLOCK")},
        "registers": int(regs.group(1)) if regs else None,
        "spill_stores": int(spills.group(1)) if spills else 0,
        "spill_loads": int(spills.group(2)) if spills else 0,
        "shared_bytes": int(k.metadata.shared),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "griddepcontrol": ptx.count("griddepcontrol."),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "loop_instructions": loop_instructions(sass),
    }
    problems = []
    if out["shared_bytes"] > MAX_SHARED:
        problems.append(f"shared memory {out['shared_bytes']} > {MAX_SHARED}")
    if v.max_shared_bytes is not None and out["shared_bytes"] > v.max_shared_bytes:
        problems.append(f"shared memory {out['shared_bytes']} > {v.max_shared_bytes}")
    if v.expect_no_spills and (out["spill_stores"] or out["spill_loads"]):
        problems.append(f"spills {out['spill_stores']}/{out['spill_loads']} bytes")
    if v.expect_wgmma and not out["wgmma"]:
        problems.append("no wgmma")
    if v.expect_cp_async and not out["cp_async"]:
        problems.append("no cp.async: tile loads are synchronous")
    if v.expect_tma and not out["tma"]:
        problems.append("no cp.async.bulk.tensor: the tiles are not copied by TMA")
    if v.max_loop_instructions is not None and out["loop_instructions"] > v.max_loop_instructions:
        problems.append(f"{out['loop_instructions']} instructions a loop iteration > "
                        f"{v.max_loop_instructions}")  # fmt: skip
    if v.expect_pdl and "griddepcontrol.wait" not in ptx:
        problems.append("PDL on but no griddepcontrol.wait")
    if not v.expect_pdl and out["griddepcontrol"]:
        problems.append("griddepcontrol without PDL")
    out["problems"] = problems
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--json", default=None, help="write the reports here")
    ap.add_argument("--drop-alignment", action="store_true",
                    help="compile without the 16-byte alignment of the integer arguments")  # fmt: skip
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sm90_report: TRITON_INTERPRET=1 makes the kernels interpreted functions; "
              "run it without", file=sys.stderr)  # fmt: skip
        return 2
    chosen = variants()
    if args.drop_alignment:
        chosen = [replace(v, aligned_ints=frozenset()) for v in chosen]
    if args.only:
        names = args.only.split(",")
        missing = set(names) - {v.name for v in chosen}
        if missing:
            print(f"unknown variant(s) {sorted(missing)}; have {[v.name for v in chosen]}",
                  file=sys.stderr)  # fmt: skip
            return 2
        chosen = [v for v in chosen if v.name in names]
    rows = [report(v) for v in chosen]
    print(f"{'variant':<18} {'warps':>5} {'stages':>6} {'regs':>5} {'spill st/ld':>12} "
          f"{'smem KB':>8} {'wgmma':>6} {'mma':>5} {'cp.async':>8} {'loop':>5}  problems")  # fmt: skip
    for r in rows:
        print(f"{r['variant']:<18} {r['warps']:5d} {r['stages']:6d} {r['registers']:5d} "
              f"{r['spill_stores']:5d}/{r['spill_loads']:<6d} {r['shared_bytes'] / 1024:8.1f} "
              f"{r['wgmma']:6d} {r['mma_sync']:5d} {r['cp_async']:8d} "
              f"{r['loop_instructions']:5d}  "
              f"{'; '.join(r['problems']) or '-'}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
