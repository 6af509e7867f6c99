"""Programmatic dependent launch (kernels/_utils.pdl_args): on where it can work (a
compiled Hopper launch) unless ``PDSERVE_PDL=0``; every kernel that
:func:`pdl_args` can launch dependently starts with :func:`pdl_enter`, so it waits for its
predecessor before touching memory. The CPU suite also compiles one with PDL on for sm_90a
(tools/sm90_report.py: ``griddepcontrol.wait`` in its PTX); on a Hopper GPU, a graph of
dependent launches gives the same result as ordinary ones."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import pdserve.kernels
from pdserve.kernels import _utils

KERNELS = Path(pdserve.kernels.__file__).parent


@pytest.mark.parametrize("default", [True, False])
def test_pdl_is_on_where_possible_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch, default: bool
) -> None:
    """``PDSERVE_PDL`` decides where it is set; else the serving model's default."""
    monkeypatch.setattr(_utils, "_pdl_default", [default])
    monkeypatch.setenv(_utils.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        _utils.pdl_args(torch.device("cpu"))
    for mode in (None, "1", "0"):
        if mode is None:
            monkeypatch.delenv(_utils.PDL_ENV, raising=False)
        else:
            monkeypatch.setenv(_utils.PDL_ENV, mode)
        assert _utils.pdl_args(torch.device("cpu")) == {}  # no CUDA, or the interpreter
        if torch.cuda.is_available() and not _utils.interpret_mode():
            on = default if mode is None else mode == "1"
            want = torch.cuda.get_device_capability()[0] >= 9 and on
            got = _utils.pdl_args(torch.device("cuda"))
            assert got == ({"PDL": True, "launch_pdl": True} if want else {})


def test_the_runner_takes_the_model_familys_default(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, tiny_glm5: Path
) -> None:
    """Where ``PDSERVE_PDL`` does not say: Llama launches dependently in the steps of at
    most ``pdl_tokens`` (16) tokens, its decode batches on the decode-size GEMM, and not
    in larger ones (cuBLAS GEMMs do not launch their successors early); GLM-5 in every
    step."""
    from pdserve import LLM, SamplingParams
    from pdserve.runner import model_step

    monkeypatch.delenv(_utils.PDL_ENV, raising=False)
    monkeypatch.delenv("PDSERVE_SKINNY_ROWS", raising=False)
    monkeypatch.setenv("PDSERVE_FUSED_KERNELS", "1")  # the decode-size GEMM's rows (CPU: interpreted)
    seen: list[tuple[int, bool]] = []
    hidden = model_step.ModelStep.hidden

    def spy(self, common, kv_caches=None):  # type: ignore[no-untyped-def]
        out = hidden(self, common, kv_caches)
        seen.append((common.num_actual_tokens, _utils._pdl_default[0]))
        return out

    monkeypatch.setattr(model_step.ModelStep, "hidden", spy)
    prompt = list(range(3, 40))  # 37 tokens: a prefill step past Llama's 16
    for ckpt, limit in ((tiny_llama, 16), (tiny_glm5, None)):
        llm = LLM(str(ckpt), dtype="float32", max_model_len=64)
        seen.clear()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3))
        assert {t for t, _ in seen} >= {37, 1}, seen
        assert all(on == (limit is None or t <= limit) for t, on in seen), (ckpt, seen)
        llm.engine.shutdown()


def _launches_with_pdl(tree: ast.AST) -> set[str]:
    """Names of the kernels launched as ``name[grid](..., **pdl_args(...))``."""
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and any(isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") == "pdl_args"
                        for k in node.keywords if k.arg is None)):  # fmt: skip
            out.add(node.func.value.id)
    return out


# helpers a kernel may call before pdl_enter: they read only tensors no kernel of a step
# writes (a GEMM's weights), so the previous kernel may still be running
EARLY_READS = {"_w_tile"}


def test_every_dependently_launched_kernel_waits_first() -> None:
    """A kernel launched with pdl_args has a ``PDL`` constexpr (default off) and calls
    ``pdl_enter(PDL)`` before it touches memory (its docstring aside): one that read what
    its predecessor writes, or wrote, before waiting could race it. Before the call only
    index math and the weight loads of ``EARLY_READS``."""
    launched: dict[str, Path] = {}
    for path in sorted(KERNELS.glob("*.py")):
        for name in _launches_with_pdl(ast.parse(path.read_text())):
            launched[name] = path
    assert len(launched) >= 20  # the decode path's kernels
    import importlib

    for name, path in launched.items():
        kernel = getattr(importlib.import_module(f"pdserve.kernels.{path.stem}"), name)
        fn = kernel.fn  # the Python function (compiled or interpreted launcher alike)
        pdl = inspect.signature(fn).parameters.get("PDL")
        assert pdl is not None and pdl.default is False and "constexpr" in str(pdl.annotation), name
        body = ast.parse(inspect.getsource(fn)).body[0].body
        stmts = [s for s in body if not (isinstance(s, ast.Expr)
                                         and isinstance(s.value, ast.Constant))]  # fmt: skip
        enter = [i for i, st in enumerate(stmts) if isinstance(st, ast.Expr)
                 and isinstance(st.value, ast.Call)
                 and getattr(st.value.func, "id", "") == "pdl_enter"]  # fmt: skip
        assert enter, (name, path)
        for st in stmts[: enter[0]]:  # index math, and weight loads through EARLY_READS only
            for call in (n for n in ast.walk(st) if isinstance(n, ast.Call)):
                f = call.func
                if isinstance(f, ast.Attribute):
                    assert not f.attr.startswith(("load", "store", "atomic")), (name, f.attr)
                else:
                    assert getattr(f, "id", "") in EARLY_READS, (name, ast.unparse(call))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs Hopper",
)
def test_dependent_launches_in_a_graph_give_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chain of dependent kernels (each reading the previous one's output), captured in a
    CUDA graph and replayed, equals the same chain launched ordinarily."""
    from pdserve.kernels.rmsnorm import rmsnorm

    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain() -> torch.Tensor:
        y = x
        for _ in range(8):
            y = rmsnorm(y, w, 1e-6) * 1.5
        return y

    monkeypatch.delenv(_utils.PDL_ENV, raising=False)
    want = chain()
    monkeypatch.setenv(_utils.PDL_ENV, "1")
    chain()  # compile the dependent variant outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    torch.testing.assert_close(out, want, atol=0, rtol=0)
