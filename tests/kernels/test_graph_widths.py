"""Decode graphs captured at several context widths (the DSA indexer asks for one at
``SORT_FREE_MAX_WIDTH`` below ``max_model_len``): a step replays the narrowest graph
its longest context fits, and the tokens equal eager steps'. On a CPU the graphs are
stood in for (a "replay" runs the captured forward, at the graph's padded batch and
width, eagerly; on a GPU too) and the Triton kernels run in the interpreter; the
sort-free limit is lowered so the tiny model's contexts cross it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _stand_in_graphs import stand_in_graphs
from pdserve import LLM, SamplingParams
from pdserve.layers.attention import dsa_triton
from pdserve.testing.checkpoint import make_checkpoint


def test_a_step_replays_the_narrowest_graph_its_context_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    monkeypatch.setattr(dsa_triton, "SORT_FREE_MAX_WIDTH", 32)
    # the interpreter's warm-up forwards take most of a minute and check nothing here
    monkeypatch.setattr("pdserve.runner.model_runner.warm_up", lambda *a, **k: ({}, None))
    ckpt = make_checkpoint(
        "GlmMoeDsaForCausalLM", "tiny", tmp_path, seed=3, dtype="float32",
        config_overrides={"num_hidden_layers": 2},
    )  # fmt: skip
    kw = dict(
        dtype="float32",
        device=device.type,
        block_size=4,
        max_model_len=64,
        max_num_seqs=4,
        attention_backend="triton",
    )
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (28, 9)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(ckpt), **kw)  # type: ignore[arg-type]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    replayed: list[tuple[int, int, int]] = []
    g = stand_in_graphs(llm, replayed)
    assert g.widths == [32, 64]
    assert g.width_for(20) == 32 and g.width_for(32) == 32 and g.width_for(33) == 64
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert graphed == eager
    widths = [w for _, _, w in replayed]
    # the longest context grows from 29 to 36 tokens: the narrow graph, then the wide one
    assert widths[0] == 32 and widths[-1] == 64 and widths == sorted(widths)
