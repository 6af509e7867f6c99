"""End-to-end engine tests on tiny random checkpoints, against transformers."""

from __future__ import annotations

import gc

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.request import Request

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
PROMPT_LENS = (3, 17, 40, 9, 64)
MAX_TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    m = AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager"
    )
    m.eval()
    m.generation_config.eos_token_id = None  # like ignore_eos: generate exactly max_tokens
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            cfg = GenerationConfig(
                max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            g = m.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            outs.append(g[0, len(p) :].tolist())
    return outs


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def references(tiny_ckpts):
    refs = {}
    for arch in ARCHS:
        path = tiny_ckpts[arch]
        llm = LLM(str(path), dtype="float32", block_size=4)
        prompts = _prompts(llm.engine.vocab_size)
        refs[arch] = (prompts, _hf_greedy(path, prompts, MAX_TOKENS))
    return refs


def _gen(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    llm.engine.step()  # lets the runner drop rows of the last finished requests
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_usable_blocks
    assert not llm.engine.kv.req_blocks
    assert len(llm.engine.runner.batch) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_ckpts, references, arch):
    prompts, ref = references[arch]
    llm = LLM(str(tiny_ckpts[arch]), dtype="float32", block_size=4)
    assert _gen(llm, prompts) == ref
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_prefix_cache_and_preemption_keep_outputs(tiny_ckpts, references, arch):
    prompts, ref = references[arch]
    # budget smaller than the longest prompt: prompts are chunked
    llm = LLM(str(tiny_ckpts[arch]), dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert _gen(llm, prompts) == ref
    # the same prompts again: every prompt's full blocks hit the prefix cache
    before = llm.engine.stats().prefix_cache_hits
    assert _gen(llm, prompts) == ref
    hits = llm.engine.stats().prefix_cache_hits - before
    assert hits == sum((n - 1) // 4 * 4 for n in PROMPT_LENS)
    _assert_all_blocks_free(llm)
    # too few blocks for all requests at once: the scheduler must preempt and recompute
    small = LLM(
        str(tiny_ckpts[arch]),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=30,
        enable_prefix_caching=False,
    )
    assert _gen(small, prompts) == ref
    assert small.engine.stats().num_preemptions > 0
    _assert_all_blocks_free(small)


def test_sampling_is_seeded_and_respects_limits(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    sp = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.01,
        seed=7,
        max_tokens=12,
        min_tokens=12,
        logprobs=0,
    )
    a = llm.generate("hello world", sp)[0].outputs[0]
    b = llm.generate(["other prompt", "hello world"], sp)[1].outputs[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.finish_reason == "length"
    assert a.logprobs is not None and len(a.logprobs) == 12 and all(lp <= 0 for lp in a.logprobs)


def test_stop_token_ids_and_stop_strings(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    free = llm.generate("the quick brown fox", _greedy(16))[0].outputs[0]
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(
        "the quick brown fox",
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_tok]),
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    text = free.text
    if len(text) >= 6:
        stop = text[3:6]
        out = llm.generate(
            "the quick brown fox",
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
        )[0].outputs[0]
        assert out.text == text[: text.index(stop)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1] * 5000}, SamplingParams(), "maximum context length"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(temperature=-1.0), "temperature"),
        ({"prompt_token_ids": [1, 10**9]}, SamplingParams(), "vocabulary"),
        ({"prompt_token_ids": [1, -1]}, SamplingParams(), "vocabulary"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(tiny_llama, prompt, params, match):
    llm = _shared_llm(tiny_llama)
    with pytest.raises(ValueError, match=match):
        llm.generate(["a good prompt", prompt], params)
    out = llm.generate("still serving", _greedy(3))[0]
    assert len(out.outputs[0].token_ids) == 3
    _assert_all_blocks_free(llm)


_LLM_CACHE: dict = {}


def _shared_llm(path) -> LLM:
    key = str(path)
    if key not in _LLM_CACHE:
        _LLM_CACHE[key] = LLM(key, dtype="float32", max_model_len=1024)
    return _LLM_CACHE[key]


def _live_requests() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, Request))


def test_many_short_requests_leave_nothing_behind(tiny_llama):
    """10,000 requests: every per-step and per-request collection stays bounded.

    A list that is appended to every step and never drained (the reference deployment's
    host-memory leak) fails here: sizes are compared after 5,000 and after 10,000."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=256, block_size=4)
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    vocab = eng.vocab_size

    def sizes() -> dict[str, int]:
        eng.step()
        s = eng.scheduler
        kv = eng.kv
        return {
            "requests": len(s.requests),
            "waiting": len(s.waiting),
            "running": len(s.running),
            "finished_ids": len(s._finished_ids),
            "req_blocks": len(kv.req_blocks),
            "committed": len(kv.num_committed),
            "runner_rows": len(eng.runner.batch),
            "generators": len(eng.runner.batch.generators),
            "out_states": len(llm.output_processor.states),
            "request_objects": _live_requests(),
        }

    def batch(k: int) -> None:
        prompts = [{"prompt_token_ids": [(k * 7 + i) % (vocab - 3) + 3, 5, 6]} for i in range(1000)]
        for o in llm.generate(prompts, sp):
            assert len(o.outputs[0].token_ids) == 2

    for k in range(5):
        batch(k)
    gc.collect()
    mid = sizes()
    for k in range(5, 10):
        batch(k)
    gc.collect()
    end = sizes()
    assert end == mid
    assert end["requests"] == end["req_blocks"] == end["runner_rows"] == end["out_states"] == 0
    assert end["request_objects"] == 0
    assert len(eng.kv.pool.cached) <= eng.kv.pool.num_blocks
    assert eng.kv.num_free_blocks == eng.kv.pool.num_usable_blocks
