"""After start-up, traffic compiles no Triton kernel: prompts of many lengths (short ones
take the decode kernel as uniform batches), chunked prompts next to decodes, and every
sampling variant all reuse what the warm-up compiled."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def compiled_variants() -> dict[str, set]:
    """Compiled specialisations (their cache keys) of every Triton kernel of pdserve.kernels.

    Triton is imported here, not at module level: importing it while the CPU suite is
    being collected, before tests/kernels/conftest.py sets TRITON_INTERPRET, leaves
    triton.language's own jit helpers uninterpreted for the kernel tests."""
    from triton.runtime.jit import JITFunction

    import pdserve.kernels

    out: dict[str, set] = {}
    for mod in pkgutil.iter_modules(pdserve.kernels.__path__):
        m = importlib.import_module(f"pdserve.kernels.{mod.name}")
        for name, obj in vars(m).items():
            if isinstance(obj, JITFunction):
                keys = {k for c in obj.device_caches.values() for k in c[0]}
                out[f"{mod.name}.{name}"] = keys
    return out


def test_no_kernel_compiles_under_traffic(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=256)
    assert llm.engine.runner.device.type == "cuda"
    before = compiled_variants()
    assert sum(map(len, before.values())) > 0
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.runner.vocab_size
    lens = [*range(1, 12), 16, 17, 31, 64, 100, 300, 700]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    params = [
        SamplingParams(max_tokens=4, temperature=0.0),
        SamplingParams(max_tokens=4, temperature=0.8, top_k=5),
        SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, min_p=0.05),
    ]
    for p in prompts:  # one at a time: every length alone
        llm.generate([{"prompt_token_ids": p}], params[0])
    # all together: chunked prompts next to decodes, mixed sampling variants
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [params[i % 3] for i in range(len(prompts))],
    )
    after = compiled_variants()
    new = {k: sorted(map(str, after[k] - before.get(k, set()))) for k in after}
    assert not any(new.values()), {k: v for k, v in new.items() if v}
