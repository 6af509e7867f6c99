"""Speculative decoding with the real drafters of ``--speculative-config``: n-gram prompt
lookup (on Llama) and the model's own MTP layer (on tiny GLM-5).

Greedy output must be token-identical to the engine without speculation at k = 1, 2, 3,
in synchronous and async scheduling, through chunked prefill and the prefix cache. The
tiny Llama's greedy continuations fall into loops, so n-gram drafts are often accepted;
a random-weight MTP layer's drafts almost never are, so the MTP drafting itself is
checked against a reference: every draft logit of every step equals the one computed
from scratch by :meth:`mtp_forward` over the final sequence (step 0 over every prompt
position with the token after it, later steps one position at a time recycling the MTP
layer's own hidden state), with GLM-5.2's shared indexer top-k on and off.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _requests import assert_clean, outputs, random_prompts

from _attn_helper import PagedKV
from pdserve import LLM, SamplingParams

LLAMA_MAX = (48, 1, 7, 40, 2, 30, 45)
GLM_MAX = (12, 1, 9, 5)
KW: dict[str, Any] = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)


def _spec(method: str, k: int, **extra: Any) -> dict[str, Any]:
    return {"method": method, "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def llama_case(tiny_llama: Path):  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama), **KW)
    prompts = random_prompts(llm.engine.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in LLAMA_MAX]
    return prompts, params, outputs(llm, prompts, params)


@pytest.fixture(scope="module")
def glm_case(tiny_glm5: Path):  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_glm5), **KW)
    prompts = random_prompts(llm.engine.vocab_size, lens=(3, 21, 40, 9))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in GLM_MAX]
    return prompts, params, outputs(llm, prompts, params)


def _check_counts(llm: LLM, k: int) -> None:
    st = llm.engine.stats()
    assert st.spec_num_drafts > 0
    assert sum(st.spec_num_accepted_tokens_per_pos) == st.spec_num_accepted_tokens
    assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens <= k * st.spec_num_drafts
    per_pos = st.spec_num_accepted_tokens_per_pos
    assert len(per_pos) <= k and all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_ngram_greedy_output_is_identical(
    tiny_llama: Path, llama_case, k: int, async_scheduling: bool
) -> None:
    prompts, params, want = llama_case
    spec = _spec("ngram", k, prompt_lookup_min=2, prompt_lookup_max=3)
    llm = LLM(str(tiny_llama), async_scheduling=async_scheduling, speculative_config=spec, **KW)
    assert outputs(llm, prompts, params) == want
    assert outputs(llm, prompts, params) == want  # through the prefix cache
    _check_counts(llm, k)
    assert llm.engine.stats().spec_num_accepted_tokens > 0  # the loops are found
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_clean(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_output_is_identical(
    tiny_glm5: Path, glm_case, k: int, async_scheduling: bool
) -> None:
    prompts, params, want = glm_case
    llm = LLM(
        str(tiny_glm5),
        async_scheduling=async_scheduling,
        speculative_config=_spec("mtp", k),
        **KW,
    )
    assert outputs(llm, prompts, params) == want
    assert outputs(llm, prompts, params) == want
    _check_counts(llm, k)
    assert_clean(llm)


def _glm_copy(src: Path, dst: Path, share: bool) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["index_share_for_mtp_iteration"] = share
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _reference_draft_logits(model: Any, seq: list[int], q: int, k: int, share: bool) -> list:  # type: ignore[type-arg]
    """Draft logits [V] of steps 0..k-1 when the token at position ``q`` was just
    sampled, computed from scratch over ``seq[:q+1]`` in fresh caches."""
    ids = torch.tensor(seq[: q + 1])
    kv = PagedKV(model, 1, q + k + 4)
    with torch.no_grad():
        with kv.step([0], [q]):
            target_h = model(ids[:q], torch.arange(q))
        with kv.step([0], [q]):
            h, topk = model.mtp_hidden(ids[1:], torch.arange(q), target_h, 0)
        h = h[-1:]
        out = [model.compute_logits(h)[0]]
        shared = topk[-1:] if share and topk is not None else None
        for j in range(1, k):
            draft = out[-1].argmax()[None]
            with kv.step([q - 1 + j], [1]):
                h, _ = model.mtp_hidden(draft, torch.tensor([q - 1 + j]), h, j, shared)
            out.append(model.compute_logits(h)[0])
    return out


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mtp_draft_logits_equal_the_reference(
    tiny_glm5: Path, tmp_path: Path, share: bool, async_scheduling: bool
) -> None:
    path = _glm_copy(tiny_glm5, tmp_path / "glm", share)
    k = 3
    llm = LLM(
        str(path), async_scheduling=async_scheduling, speculative_config=_spec("mtp", k), **KW
    )
    runner = llm.engine.runner
    prop = runner.proposer
    assert prop.share_topk is share  # type: ignore[union-attr]
    steps: list[dict[str, Any]] = []
    real_logits, real_propose = prop.logits, prop.propose  # type: ignore[union-attr]

    def logits(h: torch.Tensor) -> torch.Tensor:
        out = real_logits(h)
        steps[-1]["logits"].append(out[0].clone())
        return out

    def propose(batch: Any) -> torch.Tensor:
        steps.append(
            {"q": int(batch.next_positions[0]), "samples": bool(batch.samples[0]), "logits": []}
        )
        return real_propose(batch)

    prop.logits, prop.propose = logits, propose  # type: ignore[union-attr]
    prompt = random_prompts(runner.vocab_size, lens=(37,), seed=5)[0]  # past index_topk 16
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    seq = prompt + out
    checked = differs = 0
    for st in steps:
        if not st["samples"]:
            continue  # a prompt chunk: its drafts are dropped
        ref = _reference_draft_logits(runner.model, seq, st["q"], k, share)
        for got, want in zip(st["logits"], ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        other = _reference_draft_logits(runner.model, seq, st["q"], k, not share)
        differs += any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(ref, other, strict=True))
        checked += 1
    assert checked == len(out)  # one proposal per sampled token (no draft was accepted)
    assert differs > 0  # sharing the top-k changes the later steps at this length


def test_refused_speculative_configs(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="has none"):
        LLM(str(tiny_llama), speculative_config=_spec("mtp", 2), **KW)
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tiny_llama), speculative_config=_spec("eagle", 2), **KW)
    with pytest.raises(ValueError, match=r"key\(s\) draft_model"):
        LLM(str(tiny_llama), speculative_config={**_spec("ngram", 2), "draft_model": "x"}, **KW)
    with pytest.raises(ValueError, match="1..16"):
        LLM(str(tiny_llama), speculative_config=_spec("ngram", 17), **KW)


def test_stats_line_and_metrics_report_acceptance(tiny_llama: Path, llama_case) -> None:
    from pdserve.core_types.stats import SchedulerStats, stats_line
    from pdserve.metrics.prometheus import PrometheusMetrics

    prompts, params, _ = llama_case
    spec = _spec("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=3)
    llm = LLM(str(tiny_llama), speculative_config=spec, **KW)
    outputs(llm, prompts, params)
    st = llm.engine.stats()
    line = stats_line(SchedulerStats(), st, 2.0)
    verifies, accepted = st.spec_num_drafts, st.spec_num_accepted_tokens
    per_pos = st.spec_num_accepted_tokens_per_pos
    assert accepted > 0 and sum(per_pos) == accepted  # per-position counts add up
    assert len(per_pos) == 3 and all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert per_pos[0] <= verifies
    assert f"mean acceptance length {1 + accepted / verifies:.2f}" in line
    assert f"accepted {accepted} / drafted {st.spec_num_draft_tokens} tokens" in line
    assert f"Avg generation throughput: {sum(p.max_tokens for p in params) / 2:.1f}" in line
    m = PrometheusMetrics("tiny", stats_provider=lambda: st, max_model_len=128)
    text = m.render()[0].decode()
    assert (
        f'pdserve:spec_decode_num_accepted_tokens_total{{engine="0",model_name="tiny"}} {float(accepted)}'
        in text
    )
    for pos, n in enumerate(st.spec_num_accepted_tokens_per_pos):
        series = "pdserve:spec_decode_num_accepted_tokens_per_pos_total"
        assert f'{series}{{engine="0",model_name="tiny",position="{pos}"}} {float(n)}' in text


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mtp_verify_and_draft_steps_replay_graphs_on_cuda(
    tiny_glm5: Path, glm_case, async_scheduling: bool
) -> None:
    """Uniform verify batches replay the target graph and the proposal replays its own
    draft graph; greedy output equals the engine without speculation (fp32)."""
    prompts, params, _ = glm_case
    kw: dict[str, Any] = dict(dtype="float32", block_size=16, device="cuda", max_model_len=256)
    want = outputs(LLM(str(tiny_glm5), enforce_eager=True, **kw), prompts, params)
    llm = LLM(
        str(tiny_glm5),
        async_scheduling=async_scheduling,
        # fixed: every step drafts (adaptive may choose j = 0 for a random tiny model)
        speculative_config=_spec("mtp", 3, draft_policy="fixed"),
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
        **kw,
    )
    assert outputs(llm, prompts, params) == want
    dg = llm.engine.runner.draft_graphs
    assert dg is not None and dg.replays > 0
    assert llm.engine.stats().step_paths.get("graph", 0) >= dg.replays
    assert_clean(llm)
