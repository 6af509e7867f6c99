"""The quality gate on the shipped demo model (assets/demo-glm5, issue 18), CPU float32:
on three held-out function signatures every pdserve configuration (colocated without
speculation, with MTP k=1 and k=3; 1P1D over tcp without speculation and with MTP,
prefill k=1 and decode k=3) gives transformers' greedy tokens exactly, the completions
parse, and the held-out perplexity is low.

Thresholds, measured on the shipped checkpoint (1000 steps): parse share 0.67 on these
three prompts at 16 tokens, perplexity 17.3 on heldout_sample.txt (the earlier 3769-step
run: 35.0); a random init's perplexity is in the thousands (vocabulary 8192). The bounds
leave room for a retrained checkpoint of the same config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import demo_gate  # noqa: E402

CKPT = demo_gate.DEFAULT_CKPT
CONFIGS = demo_gate.CONFIGS
NUM_PROMPTS = 3
MAX_NEW_TOKENS = 16
MIN_PARSE_SHARE = 1 / 3  # at least one of the three completed functions parses
MAX_PERPLEXITY = 100.0  # on heldout_sample.txt (1016 tokens of a held-out module)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    args = demo_gate.parse_args(
        ["--checkpoint", str(CKPT), "--device", "cpu", "--dtype", "float32",
         "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW_TOKENS),
         "--ppl-text", str(CKPT / "heldout_sample.txt"), "--examples", "0",
         "--configs", ",".join(CONFIGS)]
    )  # fmt: skip
    return demo_gate.run_gate(args)


def test_shipped_checkpoint_is_small_and_complete() -> None:
    names = {p.name for p in CKPT.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "heldout_prompts.json"} <= names
    assert sum(p.stat().st_size for p in CKPT.iterdir()) < 20 << 20


def test_every_configuration_gives_transformers_greedy_tokens(report: dict[str, Any]) -> None:
    assert set(report["configs"]) == set(CONFIGS)
    for name, r in report["configs"].items():
        assert "error" not in r, (name, r)
        assert r["exact_share"] == 1.0, (name, r["mismatches"])
    assert demo_gate.verdict(report) == 0
    # the reference's top-2 logit gap is recorded at every greedy position
    gaps = report["transformers"]["top2_gaps"]
    assert gaps["positions"] == NUM_PROMPTS * MAX_NEW_TOKENS
    assert 0.0 <= gaps["min_top2_gap"] <= gaps["median_top2_gap"]
    assert "min" in demo_gate.table(report).splitlines()[1]
    # speculation ran: drafts were verified, some accepted, per position for k = 3
    for name in ("mtp1", "mtp3", "pd_tcp_mtp3"):
        r = report["configs"][name]
        assert r["drafted"] > 0 and 0.0 < r["mtp_acceptance_rate"] <= 1.0, (name, r)
    assert len(report["configs"]["mtp3"]["acceptance_per_pos"]) == 3


def test_completions_parse_and_heldout_perplexity_is_low(report: dict[str, Any]) -> None:
    assert report["transformers"]["parse_share"] >= MIN_PARSE_SHARE, report["transformers"]
    assert report["configs"]["colocated"]["parse_share"] >= MIN_PARSE_SHARE
    assert report["ppl"] < MAX_PERPLEXITY, report["ppl"]


def test_first_divergence() -> None:
    assert demo_gate.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert demo_gate.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert demo_gate.first_divergence([1, 2], [1, 2, 3]) == 2
