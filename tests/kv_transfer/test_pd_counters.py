"""A decode instance's prefix-cache counters (in-process engines, tcp on loopback): each
prompt is looked up once (not again when its pulled KV lands), and only blocks the
decode instance already held count as hits (KV received from prefill does not)."""

from __future__ import annotations

from pathlib import Path

from _pd_engines import PROMPTS, engine, prefill, proc, run, settle
from pdserve import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_decode_counts_its_own_lookups_once(tiny_llama: Path) -> None:
    p, d = engine(tiny_llama, "kv_producer"), engine(tiny_llama, "kv_consumer")
    pp, dp = proc(p, tiny_llama), proc(d, tiny_llama)

    def one(rid: str, ids: list[int]) -> None:
        params = prefill(p, pp, rid, ids)
        d.add_request(dp.make_request(rid, ids, SP, params))
        run(d, {rid})

    try:
        for i, ids in enumerate(PROMPTS):  # distinct first tokens: no shared block
            one(f"r{i}", ids)
        st = d.stats()
        assert st.prefix_cache_queries == sum(len(x) for x in PROMPTS)
        assert st.prefix_cache_hits == 0
        assert st.prompt_tokens_by_source["external_kv_transfer"] == sum(
            len(x) - 1 for x in PROMPTS
        )
        # the decode instance now holds PROMPTS[3]'s blocks itself: a local hit
        again = PROMPTS[3]
        one("again", again)
        st2 = d.stats()
        assert st2.prefix_cache_queries == st.prefix_cache_queries + len(again)
        assert st2.prefix_cache_hits == (len(again) - 1) // 4 * 4
        settle(p, d)
    finally:
        p.shutdown()
        d.shutdown()
