"""After start-up, traffic compiles no Triton kernel: prompts of many lengths (short ones
take the decode kernel as uniform batches), chunked prompts next to decodes, and every
sampling variant all reuse what the warm-up compiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.profiling.kernel_compiles import compiled_variants, new_variants

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "glm5"])
def test_no_kernel_compiles_under_traffic(
    tiny_llama: Path, tiny_glm5: Path, arch: str
) -> None:
    """GLM-5 too: its indexer's select, the MoE alignment and the split reduces size
    tiles by powers of two of token counts and widths (run 139: six variants missed)."""
    ckpt = tiny_llama if arch == "llama" else tiny_glm5
    llm = LLM(str(ckpt), dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=256)
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
    new = new_variants(before, compiled_variants())
    assert not new, new
