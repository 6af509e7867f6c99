"""Small helpers shared by the Triton kernels (launch heuristics, device facts).

Nothing here touches device memory or synchronises: every function answers from
host information (shapes, dtypes, device properties), so callers can use the
answers while a CUDA graph is being captured.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

LOG2E = 1.4426950408889634
PDL_ENV = "PDSERVE_PDL"  # "0": no programmatic dependent launch on Hopper (see pdl_args)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., n] as a 2-D [rows, n] view with unit inner stride (copies only if it
    must): what a row-wise kernel indexes with one row stride."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def check_device(t: torch.Tensor, what: str) -> None:
    """Refuse CPU tensors unless the interpreter is on (a compiled kernel would crash)."""
    if t.device.type != "cuda" and not interpret_mode():
        raise RuntimeError(
            f"{what}: Triton kernels need CUDA tensors (got {t.device}); "
            "set TRITON_INTERPRET=1 to run them on the CPU for testing"
        )


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 products for fp32 inputs (no TF32), native otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(dtype: torch.dtype) -> bool:
    """Feed ``tl.dot`` fp32 operands instead of ``dtype`` ones.

    Only in the interpreter with bf16: it stores bf16 as raw uint16 and its
    ``tl.dot`` multiplies those bits. Compiled kernels always use native bf16 MMA.
    """
    return interpret_mode() and dtype == torch.bfloat16


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device``; a small fixed number on the CPU (interpreter) so
    split heuristics still split in tests."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s compute capability (asked once per GPU); None off CUDA."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


_pdl_default = [True]  # where PDSERVE_PDL is unset (use_pdl_by_default)


def use_pdl_by_default(on: bool) -> None:
    """Whether :func:`pdl_args` launches dependently where ``PDSERVE_PDL`` is unset: the
    model runner sets it for each step (``ModelStep.hidden``) from the model family's
    measured preference (``CausalLM.pdl_tokens``)."""
    _pdl_default[0] = on


def env_choice(given: str | None, env: str, default: str, choices: tuple[str, ...],
               what: str) -> str:  # fmt: skip
    """A kernel switch: ``given``, else the ``env`` variable's value, else ``default``;
    a name not in ``choices`` raises ``ValueError`` naming ``what`` and ``env``."""
    name = os.environ.get(env, default) if given is None else given
    if name not in choices:
        raise ValueError(f"{what} {name!r} ({env}): one of {choices}")
    return name


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch arguments for a kernel that starts with :func:`pdl_enter`: programmatic
    dependent launch (``launch_pdl``, and the kernel's ``PDL`` constexpr that makes it wait
    for its predecessor's memory before anything else) on a Hopper GPU with compiled
    kernels where ``PDSERVE_PDL=1``, or where it is unset and the serving model's family
    gains from it (:func:`use_pdl_by_default`); empty otherwise (an ordinary launch). The
    kernel may then be scheduled while the previous kernel on the stream still runs, so
    the launch gap between the small kernels of a decode step (CUDA graphs keep the
    dependency) overlaps the predecessor's tail: on the H200 it took glm5-m12-e64's 1 x 1K
    decode step from 4.64 to 4.40 ms and 1 x 16K from 5.41 to 5.13 ms (RESULTS.md run 47)."""
    mode = os.environ.get(PDL_ENV)
    if mode not in (None, "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1 (got {mode!r})")
    on = _pdl_default[0] if mode is None else mode == "1"
    cap = capability(device)
    if not on or cap is None or cap[0] < 9 or interpret_mode():
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A dependently launched kernel's first statement: wait until the previous kernel's
    writes are visible (it may still have been running at this kernel's launch), then let
    the next kernel launch. Nothing before it may write memory or read what a kernel of
    the step writes (index math and a GEMM's weight loads may come first:
    tests/kernels/test_pdl.py's ``EARLY_READS``)."""
    if PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()


@triton.jit
def grouped_tile(GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program of a 2-D grid: the grid's own indices when
    ``GROUP_M`` is 1, else launch order remapped so that ``GROUP_M`` row tiles sweep the
    column tiles together (the usual L2 swizzle: the programs running at once share their
    row tiles' operands and each column tile's)."""
    if GROUP_M == 1:
        return tl.program_id(0), tl.program_id(1)
    num_m = tl.num_programs(0)
    width = GROUP_M * tl.num_programs(1)
    pid = tl.program_id(1) * num_m + tl.program_id(0)  # launch order
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def round_to_e4m3(x):
    """``x`` (float32, within +-448) rounded to the nearest float8_e4m3fn value, ties to
    even, still in float32. Only for the interpreter: Triton 3.6's interpreter casts to
    fp8 by truncating the carry of a rounding that reaches the next power of two (1.97
    becomes 1.0), so kernels round first and its cast is then exact. Compiled kernels
    cast with the hardware instruction instead."""
    mag = tl.maximum(tl.abs(x), 1e-30)
    e = tl.maximum(tl.floor(tl.log2(mag)), -6.0)  # below 2^-6: the subnormal quantum 2^-9
    quantum = tl.exp2(e - 3.0)
    y = x / quantum
    return ((y + 12582912.0) - 12582912.0) * quantum  # 1.5 * 2^23: fp32 round-to-even


@triton.jit
def quantize_rows_e4m3(a, QMAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """A float32 tile ``a`` [M, G] (one 128-channel group of M rows; masked-out entries
    0) -> (float8_e4m3fn tile, float32 scales [M]) with ``a ≈ q * scale`` row by row and
    ``scale = max(absmax / QMAX, 1e-12)``: per-token group quantization, the values
    :func:`~pdserve.kernels.reference.quantize_fp8_groups` gives. ``ROUND_FIRST``: round
    with :func:`round_to_e4m3` before the cast (the interpreter only)."""
    scale = tl.maximum(tl.max(tl.abs(a), axis=1) / QMAX, 1e-12)
    s = tl.clamp(a / scale[:, None], -QMAX, QMAX)
    if ROUND_FIRST:
        s = round_to_e4m3(s)
    return s.to(tl.float8e4nv), scale


@triton.jit
def group_tile(first, NUM: tl.constexpr, GROUP: tl.constexpr, n_cols):
    """Groups ``first .. first + NUM - 1`` of a row as a [NUM, GROUP] tile: (their
    indices [NUM], the tile's column indices, which columns are within ``n_cols``). A
    quantizing kernel computes in this tile from the start: reshaping a 1-D row into it
    is a layout change through shared memory (H100 runs 77 and 85)."""
    groups = first + tl.arange(0, NUM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    return groups, cols, cols < n_cols


@triton.jit
def store_fp8_groups(q_row, qs_row, y, groups, cols, mask, n_cols, QMAX: tl.constexpr,
                     ROUND_FIRST: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """The float32 tile ``y`` of :func:`group_tile` quantized group by group
    (:func:`quantize_rows_e4m3`): values stored at ``q_row + cols``, scales at
    ``qs_row + groups``."""
    yq, scale = quantize_rows_e4m3(y, QMAX, ROUND_FIRST)
    tl.store(q_row + cols, yq, mask=mask)
    tl.store(qs_row + groups, scale, mask=groups * GROUP < n_cols)


@triton.jit
def dot_fp8(a_q, b, FP8_DOT: tl.constexpr):
    """``a_q @ b`` of two float8_e4m3fn tiles, float32 out: an FP8 MMA, or (``FP8_DOT``
    false: GPUs before sm_89) the same values through bf16."""
    if FP8_DOT:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        out = tl.dot(a_q, b)
    else:
        out = tl.dot(a_q.to(tl.bfloat16), b.to(tl.bfloat16))
    return out


def fp8_mma(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores (sm_89+); the interpreter emulates them."""
    cap = capability(device)
    return cap is None or cap >= (8, 9)


@triton.jit
def e4m3_to_f16(x, ASM: tl.constexpr):
    """fp8 e4m3 ``x`` -> fp16 (exact): the hardware's pairwise conversion, 4 elements an
    asm instance, converted where they are (not pure, so never moved past a layout
    change); ``ASM`` off (the CPU interpreter runs no PTX): Triton's own cast."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [x.to(tl.uint8, bitcast=True)],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    else:
        return x.to(tl.float16)


@triton.jit
def _e4m3_byte(b):
    """The e4m3 value of byte ``b`` (int32, 0-255) by arithmetic: the interpreter's way."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    # normal: (1 + m / 8) * 2^(e - 7) = (8 + m) * 2^(e - 10); subnormal: m * 2^-9
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def fp8x4_to_f32(w, ASM: tl.constexpr):
    """Four e4m3 values packed in each int32 of ``w`` (little-endian: byte ``c`` is the
    value at offset ``c``) -> four float32 tensors of ``w``'s shape, one per byte: from
    one 4-byte load, two pairwise e4m3 -> f16 conversions and four f16 -> f32 ones,
    with no byte shuffles (``ASM``; off: by arithmetic, for the CPU interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, h0, h1, h2, h3; .reg .b32 p, q; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi; "
            "mov.b32 {h0, h1}, p; mov.b32 {h2, h3}, q; "
            "cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3; }",
            "=r,=r,=r,=r,r",
            [w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        return (
            _e4m3_byte(w & 255),
            _e4m3_byte((w >> 8) & 255),
            _e4m3_byte((w >> 16) & 255),
            _e4m3_byte((w >> 24) & 255),
        )
