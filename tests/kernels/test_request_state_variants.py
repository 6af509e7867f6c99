"""The request state's kernels compile at start-up only: none of their launch arguments
that a step's sizes set is specialised, and :meth:`RequestState.warm_up` launches every
variant (compile-time flags) that traffic reaches, here traffic of sync and async steps,
with and without n-gram drafts (the H100's warm-start test found ``post_update``
compiling under traffic). On the GPU the fused kernels run as in production; on the CPU
the interpreter runs them, and the output must equal the torch ops'."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import pdserve.kernels.request_state as krs
from pdserve import LLM, SamplingParams

KERNELS = ("_post_update_kernel", "_merge_drafts_kernel", "_place_kernel")
KW: dict[str, Any] = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)


def _outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _options(kernel: Any) -> dict[str, Any]:
    if hasattr(kernel, "kwargs"):  # the interpreter's function
        return kernel.kwargs
    return dict(
        do_not_specialize=kernel.do_not_specialize,
        do_not_specialize_on_alignment=kernel.do_not_specialize_on_alignment,
    )


def _constexprs(kernel: Any) -> set[str]:
    sig = inspect.signature(kernel.fn)
    return {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}


@pytest.mark.parametrize("name", KERNELS)
def test_no_runtime_argument_is_specialised(name: str) -> None:
    kernel = getattr(krs, name)
    runtime = set(inspect.signature(kernel.fn).parameters) - _constexprs(kernel)
    opts = _options(kernel)
    assert runtime and runtime == set(opts["do_not_specialize"])
    assert runtime == set(opts["do_not_specialize_on_alignment"])


class _Recorder:
    """Stands in for a kernel: records the compile-time flags of each launch."""

    def __init__(self, name: str, kernel: Any, seen: set) -> None:
        self.name, self.kernel, self.seen = name, kernel, seen
        self.flags = _constexprs(kernel) - {"PDL"}

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kw: Any) -> Any:
            self.seen.add((self.name, tuple(sorted((k, kw[k]) for k in self.flags))))
            return self.kernel[grid](*args, **kw)

        return launch


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 3}])  # fmt: skip
def test_traffic_launches_only_variants_the_warm_up_compiled(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, spec: dict | None, async_scheduling: bool
) -> None:
    base = LLM(str(tiny_llama), **KW)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, base.engine.vocab_size, (n,), generator=g).tolist()
               for n in (3, 21, 40, 9)]  # fmt: skip
    prompts[1] = prompts[1][:6] * 3 + prompts[1][6:]  # repeats: the n-gram drafter proposes
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 1, 9, 5)]
    want = _outputs(base, prompts, params)
    llm = LLM(str(tiny_llama), async_scheduling=async_scheduling, speculative_config=spec, **KW)
    runner = llm.engine.runner
    runner.state.fused = True  # the kernels, interpreted on the CPU
    warm: set = set()
    for name in KERNELS:
        monkeypatch.setattr(krs, name, _Recorder(name, getattr(krs, name), warm))
    runner.state.warm_up(runner.buffers)
    traffic: set = set()
    for name in KERNELS:
        getattr(krs, name).seen = traffic
    assert _outputs(llm, prompts, params) == want
    assert traffic <= warm, traffic - warm
    launched = {n for n, _ in traffic}  # a synchronous step without drafts launches none
    assert ("_post_update_kernel" in launched) == (spec is not None)  # else one torch op
    assert ("_place_kernel" in launched) == (async_scheduling or spec is not None)
