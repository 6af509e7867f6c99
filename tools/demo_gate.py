"""The demo model's quality gate (issue 18): pdserve's greedy completions against
transformers' on held-out function signatures.

    python3 tools/demo_gate.py [--checkpoint assets/demo-glm5] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--num-prompts N] [--max-new-tokens M] [--json OUT]

The reference is transformers' ``GlmMoeDsaForCausalLM`` on the trunk (it ignores the MTP
layer), greedy, one prompt at a time. pdserve runs the same prompt token ids, greedy, in
each configuration:

    colocated      one engine, no speculation
    mtp1, mtp3     one engine, MTP speculation with k = 1 and k = 3
    pd_tcp         1P1D in one process over the tcp transport, no speculation
    pd_tcp_mtp3    1P1D over tcp, MTP on both instances (prefill k=1, decode k=3)

Reported per configuration: the share of prompts whose token ids equal transformers'
exactly (and, where not, the first position that differs), the share of completions
that parse as a function (``completion_parses`` from ``train_demo.py``) and, with
speculation, the MTP acceptance rate and acceptance per draft position. With
``--ppl-text`` it also reports transformers' perplexity on that text.

transformers' top-2 logit gap is recorded at every greedy position (summarised:
minimum, median, counts below 1e-4 ... 0.1) and at each first divergence, so a
divergence can be told apart as a near-tie rounded the other way (small gap) or a bug
(large gap).

Exit status: 1 if any completion on CPU float32 differs from transformers' (in bf16 the
accumulation orders differ, so near-ties may flip: reported, not failed), 2 if a
configuration failed to run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

from train_demo import completion_parses  # noqa: E402

from pdserve import SamplingParams  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.engine_core import EngineCore  # noqa: E402
from pdserve.frontend.llm import LLM  # noqa: E402
from pdserve.frontend.processor import InputProcessor  # noqa: E402
from pdserve.frontend.tokenizer import Tokenizer  # noqa: E402

DEFAULT_CKPT = ROOT / "assets" / "demo-glm5"
CONFIGS = ("colocated", "mtp1", "mtp3", "pd_tcp", "pd_tcp_mtp3")
PD_TIMEOUT_S = 600.0
GAP_THRESHOLDS = (1e-4, 1e-3, 1e-2, 0.1)


def mtp(k: int) -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": k}


def engine_kwargs(args: argparse.Namespace, longest: int) -> dict[str, Any]:
    """Engine options; the context is sized to the longest request (on the CPU the torch
    reference attention's cost grows with ``max_model_len``)."""
    ctx = -(-(longest + 16) // 128) * 128
    kw: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": ctx,
        "max_num_seqs": 32,
        "max_num_batched_tokens": max(1024, ctx),
    }
    if args.device == "cuda":  # several engines live in one process: bound each one's KV
        kw["kv_cache_memory_bytes"] = 2 << 30
    return kw


# -------------------------------------------------------------------- reference
def transformers_greedy(
    ckpt: Path, prompts: list[list[int]], max_new: int, device: str, dtype: str
) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens on the trunk, one prompt at a time (no padding), and
    at every generated position the gap between its two largest logits (fp32): how
    close that greedy choice was to a tie."""
    import transformers

    model: Any = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, dtype)
    )
    model = model.to(device).eval()
    out, gaps = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(
                x,
                max_new_tokens=max_new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out.append(y.sequences[0, len(ids) :].tolist())
            logits = torch.stack([lg[0] for lg in y.logits]).float()
            top2 = logits.topk(2, dim=-1).values
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    del model
    _free(device)
    return out, gaps


def gap_summary(gaps: list[list[float]]) -> dict[str, Any]:
    """How many of the reference's greedy choices were near-ties (top-2 logit gap)."""
    flat = sorted(g for row in gaps for g in row)
    return {
        "positions": len(flat),
        "min_top2_gap": flat[0] if flat else None,
        "median_top2_gap": flat[len(flat) // 2] if flat else None,
        **{f"below_{t:g}": sum(g < t for g in flat) for t in GAP_THRESHOLDS},
    }


def perplexity(ckpt: Path, text: str, device: str, dtype: str, seq_len: int = 512) -> float:
    """transformers' perplexity on ``text`` (windows of ``seq_len`` tokens, trunk only)."""
    import transformers

    ids = Tokenizer.from_pretrained(ckpt).encode(text, add_special_tokens=False)
    model: Any = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, dtype)
    )
    model = model.to(device).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, seq_len):
            x = torch.tensor([ids[i : i + seq_len + 1]], device=device)
            logits = model(input_ids=x[:, :-1]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum"))
            count += x.shape[1] - 1
    del model
    _free(device)
    return math.exp(total / max(1, count))


# ---------------------------------------------------------------------- pdserve
def run_colocated(
    ckpt: Path, prompts: list[list[int]], sp: SamplingParams, kw: dict[str, Any], k: int
) -> tuple[list[list[int]], Any]:
    llm = LLM(str(ckpt), speculative_config=mtp(k) if k else None, **kw)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sp)
    stats = llm.engine.stats()
    llm.engine.shutdown()
    del llm
    return [list(o.outputs[0].token_ids) for o in outs], stats


def _pd_engine(
    ckpt: Path, role: str, spec: dict[str, Any] | None, kw: dict[str, Any]
) -> EngineCore:
    kvt = {
        "kv_connector": "PdConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"transport": "tcp"},
    }
    cfg = EngineConfig.from_kwargs(
        model=str(ckpt), speculative_config=spec, kv_transfer_config=kvt, **kw
    )
    return EngineCore(cfg)


def run_pd(
    ckpt: Path, prompts: list[list[int]], sp: SamplingParams, kw: dict[str, Any], k: int
) -> tuple[list[list[int]], Any]:
    """1P1D in one process: the prefill instance computes each prompt (max_tokens=1, as
    the proxy's P leg asks), the decode instance pulls its KV over tcp and generates."""
    os.environ.setdefault("PDSERVE_PD_SECRET", os.urandom(32).hex())
    p = _pd_engine(ckpt, "kv_producer", mtp(1) if k else None, kw)
    d = _pd_engine(ckpt, "kv_consumer", mtp(k) if k else None, kw)
    try:
        tok = Tokenizer.from_pretrained(ckpt)
        pp = InputProcessor(tok, p.max_model_len, p.vocab_size, speculative=bool(k))
        dp = InputProcessor(tok, d.max_model_len, d.vocab_size, speculative=bool(k))
        psp = SamplingParams(temperature=0.0, max_tokens=1)
        remote = {"do_remote_decode": True, "do_remote_prefill": False}
        rids = [f"gate-{i}" for i in range(len(prompts))]
        for rid, ids in zip(rids, prompts, strict=True):
            p.add_request(pp.make_request(rid, ids, psp, remote))
        got: dict[str, list[int]] = {rid: [] for rid in rids}
        done: set[str] = set()
        deadline = time.monotonic() + PD_TIMEOUT_S
        while len(done) < len(rids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"1P1D: {len(rids) - len(done)} requests unfinished")
            for o in p.step():
                if o.finish_reason is not None:
                    if o.kv_transfer_params is None:
                        raise RuntimeError(f"prefill of {o.request_id}: {o.error}")
                    i = rids.index(o.request_id)
                    d.add_request(
                        dp.make_request(o.request_id, prompts[i], sp, o.kv_transfer_params)
                    )
            for o in d.step():
                got[o.request_id].extend(o.new_token_ids)
                if o.finish_reason == "error":
                    raise RuntimeError(f"decode of {o.request_id}: {o.error}")
                if o.finish_reason is not None:
                    done.add(o.request_id)
            if not (p.has_schedulable_work() or d.has_schedulable_work()):
                time.sleep(0.001)
        return [got[rid] for rid in rids], d.stats()
    finally:
        p.shutdown()
        d.shutdown()


RUNNERS: dict[str, tuple[Callable[..., tuple[list[list[int]], Any]], int]] = {
    "colocated": (run_colocated, 0),
    "mtp1": (run_colocated, 1),
    "mtp3": (run_colocated, 3),
    "pd_tcp": (run_pd, 0),
    "pd_tcp_mtp3": (run_pd, 3),
}


# ----------------------------------------------------------------------- report
def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def parse_share(tok: Tokenizer, texts: list[str], outs: list[list[int]], max_new: int) -> float:
    ok = sum(
        completion_parses(p, tok.decode(ids), len(ids) >= max_new)[0]
        for p, ids in zip(texts, outs, strict=True)
    )
    return ok / max(1, len(texts))


def spec_report(stats: Any) -> dict[str, Any]:
    drafted = stats.spec_num_draft_tokens
    if not drafted:
        return {}
    verifies = max(1, stats.spec_num_drafts)
    return {
        "mtp_acceptance_rate": stats.spec_num_accepted_tokens / drafted,
        "mean_acceptance_length": 1 + stats.spec_num_accepted_tokens / verifies,
        "acceptance_per_pos": [n / verifies for n in stats.spec_num_accepted_tokens_per_pos],
        "drafted": drafted,
    }


def run_gate(
    args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    ckpt = Path(args.checkpoint)
    texts = json.loads(Path(args.prompts).read_text())[: args.num_prompts]
    tok = Tokenizer.from_pretrained(ckpt)
    prompts = [tok.encode(t) for t in texts]
    m = args.max_new_tokens
    report: dict[str, Any] = {
        "checkpoint": str(ckpt), "device": args.device, "dtype": args.dtype,
        "num_prompts": len(prompts), "max_new_tokens": m,
        "torch": torch.__version__, "configs": {},
    }  # fmt: skip
    if args.ppl_text:
        t0 = time.monotonic()
        text = Path(args.ppl_text).read_text()
        report["ppl"] = perplexity(ckpt, text, args.device, args.dtype)
        print(f"perplexity on {args.ppl_text}: {report['ppl']:.3f} ({time.monotonic() - t0:.1f} s)")
    t0 = time.monotonic()
    ref, gaps = transformers_greedy(ckpt, prompts, m, args.device, args.dtype)
    report["transformers"] = {
        "parse_share": parse_share(tok, texts, ref, m),
        "mean_tokens": sum(map(len, ref)) / max(1, len(ref)),
        "top2_gaps": gap_summary(gaps),
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(f"transformers: {json.dumps(report['transformers'])}", flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=m)
    kw = engine_kwargs(args, max(map(len, prompts)) + m)
    for name in args.configs:
        fn, k = RUNNERS[name]
        t0 = time.monotonic()
        try:
            outs, stats = fn(ckpt, prompts, sp, kw, k)
        except Exception as e:  # noqa: BLE001 (reported; the exit status says it failed)
            report["configs"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: FAILED {e!r}", flush=True)
            continue
        finally:
            _free(args.device)
        div = [first_divergence(a, b) for a, b in zip(outs, ref, strict=True)]
        r = {
            "exact_share": sum(d is None for d in div) / max(1, len(div)),
            # ref_top2_gap: transformers' top-2 logit gap where pdserve first chose otherwise
            "mismatches": [
                {"prompt": i, "first_divergence": d, "ref_top2_gap": gaps[i][d] if d < len(gaps[i]) else None}
                for i, d in enumerate(div) if d is not None
            ],
            "parse_share": parse_share(tok, texts, outs, m),
            **spec_report(stats),
            "seconds": round(time.monotonic() - t0, 1),
        }  # fmt: skip
        report["configs"][name] = r
        print(f"{name}: {json.dumps(r)}", flush=True)
        if save is not None:
            save(report)
    if args.examples:
        report["examples"] = [
            {"prompt": t, "completion": tok.decode(ids)} for t, ids in zip(texts[: args.examples], ref, strict=False)
        ]  # fmt: skip
    return report


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['checkpoint']} on {report['device']} {report['dtype']}: "
        f"{report['num_prompts']} prompts, {report['max_new_tokens']} new tokens; "
        f"transformers parse share {report['transformers']['parse_share']:.3f}",
        "config        exact   parse   MTP accept  per position         first divergences",
    ]
    g = report["transformers"].get("top2_gaps")
    if g and g["positions"]:
        below = ", ".join(f"{g[f'below_{t:g}']} below {t:g}" for t in GAP_THRESHOLDS)
        lines.insert(
            1,
            f"transformers' top-2 logit gaps over {g['positions']} greedy positions: "
            f"min {g['min_top2_gap']:.3g}, median {g['median_top2_gap']:.3g}; {below}",
        )
    for name, r in report["configs"].items():
        if "error" in r:
            lines.append(f"{name:<12}  FAILED: {r['error']}")
            continue
        acc = f"{r['mtp_acceptance_rate']:.3f}" if "mtp_acceptance_rate" in r else "-"
        pos = ",".join(f"{x:.2f}" for x in r.get("acceptance_per_pos", [])) or "-"
        div = ",".join(
            f"{x['prompt']}@{x['first_divergence']}"
            + (f"(gap {x['ref_top2_gap']:.3g})" if x.get("ref_top2_gap") is not None else "")
            for x in r["mismatches"][:6]
        )
        lines.append(
            f"{name:<12}  {r['exact_share']:5.3f}   {r['parse_share']:5.3f}   {acc:>10}  {pos:<20} {div or '-'}"
        )
    return "\n".join(lines)


def verdict(report: dict[str, Any]) -> int:
    if any("error" in r for r in report["configs"].values()):
        return 2
    strict = report["device"] == "cpu" and report["dtype"] == "float32"
    if strict and any(r["exact_share"] < 1.0 for r in report["configs"].values()):
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CKPT))
    ap.add_argument("--prompts", default=None, help="JSON list of prompts "
                    "(default: the checkpoint's heldout_prompts.json)")  # fmt: skip
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated subset of {','.join(CONFIGS)}")  # fmt: skip
    ap.add_argument("--ppl-text", default=None,
                    help="also report transformers' perplexity on this text file")  # fmt: skip
    ap.add_argument("--examples", type=int, default=2, help="completions kept in the JSON")
    ap.add_argument("--json", default=None, help="write the report here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.prompts is None:
        args.prompts = str(Path(args.checkpoint) / "heldout_prompts.json")
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser().error(f"--configs: unknown {sorted(unknown)} (choose from {', '.join(CONFIGS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def save(report: dict[str, Any]) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    report = run_gate(args, save)
    report["verdict"] = verdict(report)
    save(report)
    print(table(report))
    return int(report["verdict"])


if __name__ == "__main__":
    sys.exit(main())
