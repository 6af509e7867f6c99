"""tools/train_demo.py end to end at micro scale on the CPU: a few stdlib modules, a
600-token BPE, a two-layer GLM-5-family model trained 20 steps. The checkpoint must load
in pdserve with and without MTP speculation (same greedy tokens), its trunk in
transformers (same greedy tokens as pdserve, fp32), and the MTP loss must fall."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

TOOLS = Path(__file__).resolve().parents[2] / "tools"
FILES = "bisect.py,heapq.py,textwrap.py,shlex.py,colorsys.py,fnmatch.py,glob.py,functools.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_demo", TOOLS / "train_demo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tool = _tool()
    root = tmp_path_factory.mktemp("train_demo")
    data, out = root / "data", root / "run"
    tool.main(["prepare", "--out", str(data), "--files", FILES, "--heldout-files", "bisect.py",
               "--vocab", "600", "--allow-other-python"])  # fmt: skip
    torch.manual_seed(0)
    tool.main(["train", "--data", str(data), "--out", str(out), "--preset", "micro",
               "--device", "cpu", "--steps", "20", "--batch", "4", "--seq-len", "40",
               "--lr", "3e-3", "--warmup", "4", "--log-every", "1", "--no-plot"])  # fmt: skip
    return {"data": data, "ckpt": out / "checkpoint", "init": out / "random_init", "out": out}


def _prompts(run: dict[str, Path]) -> list[str]:
    prompts = json.loads((run["data"] / "eval_prompts.json").read_text())
    assert prompts, "the held-out module gives signature + docstring prompts"
    return prompts[:3]


def test_manifest_and_artifacts(run: dict[str, Path]) -> None:
    manifest = json.loads((run["data"] / "manifest.json").read_text())
    assert manifest["python"] == list(sys.version_info[:2])
    assert manifest["heldout"] == ["bisect.py"] and manifest["files"] == 8
    assert manifest["vocab_size"] <= 600 and len(manifest["files_sha256"]) == 64
    ckpt = run["ckpt"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):  # fmt: skip
        assert (ckpt / name).is_file(), name
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["topk_method"] == "noaux_tc"
    summary = json.loads((run["out"] / "train_summary.json").read_text())
    assert summary["steps"] == 20 and summary["error"] is None


def test_mtp_loss_decreases(run: dict[str, Path]) -> None:
    with open(run["out"] / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 20
    mtp = [float(r["ce_mtp"]) for r in rows]
    main = [float(r["ce_main"]) for r in rows]
    assert sum(mtp[-5:]) / 5 < sum(mtp[:5]) / 5 - 0.1
    assert sum(main[-5:]) / 5 < sum(main[:5]) / 5 - 0.1


@pytest.fixture(scope="module")
def engines(run: dict[str, Path]) -> dict[str, Any]:
    from pdserve import LLM

    return {
        "trained": LLM(str(run["ckpt"]), dtype="float32"),
        "init": LLM(str(run["init"]), dtype="float32"),
        "trained_mtp": LLM(str(run["ckpt"]), dtype="float32",
                           speculative_config={"method": "mtp", "num_speculative_tokens": 1}),
    }  # fmt: skip


def test_pdserve_mtp_speculation_matches_plain_greedy(
    run: dict[str, Path], engines: dict[str, Any]
) -> None:
    from pdserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(run)
    want = [o.outputs[0].token_ids for o in engines["trained"].generate(prompts, sp)]
    spec = engines["trained_mtp"]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.engine.stats().spec_num_draft_tokens > 0


@pytest.mark.parametrize("which", ["trained", "init"])
def test_transformers_trunk_matches_pdserve(
    run: dict[str, Path], engines: dict[str, Any], which: str
) -> None:
    """Prompts longer than index_topk (16), so the indexer selects; the random init gives
    varied tokens, the briefly trained model mostly repeats one."""
    from pdserve import SamplingParams

    path = run["ckpt" if which == "trained" else "init"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    for prompt in _prompts(run)[:2]:
        ids = tok(prompt)["input_ids"]
        assert len(ids) > 16
        ours = engines[which].generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False)  # fmt: skip
        assert ours == ref[0, len(ids) :].tolist()


def test_chat_template_renders_glm_format(run: dict[str, Path]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(run["ckpt"])
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
    ids = tok(text)["input_ids"]
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids


def test_completion_trimming_and_parse_check() -> None:
    tool = sys.modules.get("train_demo") or _tool()
    prompt = 'def f(x):\n    """Double."""\n'
    assert tool.completion_parses(prompt, "    return 2 * x\n\ndef g():\n", False) == (True, 1)
    assert tool.completion_parses(prompt, "    return (2 *\n    x + ", True)[0] is False
    assert tool.completion_parses(prompt, "x = 1\n", False) == (False, 0)  # no body added
    method = '    def m(self):\n        """Doc."""\n'
    assert tool.completion_parses(method, "        return 1\n    def n(self):", False)[0]


def test_eval_reports_perplexity_parse_rate_and_acceptance(run: dict[str, Path]) -> None:
    tool = sys.modules.get("train_demo") or _tool()
    out = run["out"] / "eval.json"
    tool.main(["eval", "--data", str(run["data"]), "--checkpoint", str(run["ckpt"]),
               "--out", str(out), "--seq-len", "40", "--max-ppl-tokens", "400",
               "--max-prompts", "1", "--max-new-tokens", "6"])  # fmt: skip
    report = json.loads(out.read_text())["trained"]
    assert report["heldout"]["tokens"] > 0 and report["heldout"]["perplexity"] > 1
    assert report["completions"]["prompts"] == 1
    assert report["completions"]["mtp_drafted"] > 0
