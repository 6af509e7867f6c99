"""Train a small GLM-5-family model (MLA, DSA indexer, MoE, one MTP layer) on the Python
standard library's own source, save it in the published HF layout, and evaluate it.

    prepare  (here, on the pinned Python)  corpus manifest, held-out split, byte-level BPE
             tokenizer with a chat template, token ids (tokens.npz), eval prompts
    train    (the H200, or a CPU at micro scale)  transformers' trunk + an MTP layer from
             transformers' parts; CE_main + mtp_weight * CE_mtp; AdamW, cosine schedule
             with warm-up, bf16 autocast on CUDA; stops inside --max-minutes and saves
    eval     held-out perplexity (transformers) and the share of greedy completions of
             held-out function signatures that parse (pdserve), trained vs random init,
             plus MTP k=1 acceptance in pdserve

The prepared directory is self-contained (no stdlib is read after ``prepare``), so it is
built once on the pinned interpreter and travels to the GPU machine. See tools/README.md.
Model pieces live in ``train_demo_model.py`` beside this file.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import math
import random
import sys
import sysconfig
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
PROCESS_START = time.monotonic()  # --max-minutes counts from here (imports and set-up too)

PINNED_PYTHON = (3, 11)
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 200_000
EOT = "<|endoftext|>"
# GLM-5's special tokens and chat format ([gMASK]<sop>, then role tags)
SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
           "<|user|>", "<|assistant|>", "<|observation|>"]  # fmt: skip
GENERATION_EOS = ["<|endoftext|>", "<|user|>", "<|observation|>"]
# GLM's chat format: tools in a system block, earlier calls in the glm47 format
# (--tool-call-parser glm47), results as observations, the thinking switch
# (enable_thinking=false closes an empty <think></think>); plain chats render as
# "<|role|>\ncontent" turns
CHAT_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>
{%- endif -%}
{%- for m in messages -%}
    {%- if m['role'] not in ['system', 'user', 'assistant', 'tool'] -%}
        {{- raise_exception('unsupported role: ' + m['role']) -}}
    {%- endif -%}
    {%- if m['role'] == 'tool' -%}
        {{- '<|observation|>\n<tool_response>' + m['content'] + '</tool_response>' -}}
    {%- elif m['role'] == 'assistant' -%}
        {{- '<|assistant|>\n' -}}
        {%- if m['reasoning_content'] is defined and m['reasoning_content'] -%}
            {{- '<think>' + m['reasoning_content'] + '</think>' -}}
        {%- endif -%}
        {{- m['content'] if m['content'] else '' -}}
        {%- if m['tool_calls'] is defined and m['tool_calls'] -%}
            {%- for tc in m['tool_calls'] -%}
                {%- set f = tc['function'] if tc['function'] is defined else tc -%}
                {{- '<tool_call>' + f['name'] -}}
                {%- for k, v in (f['arguments'] or {}).items() -%}
                    {{- '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else v | tojson) + '</arg_value>' -}}
                {%- endfor -%}
                {{- '</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
    {%- else -%}
        {{- '<|' + m['role'] + '|>\n' + m['content'] -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think></think>' -}}
    {%- endif -%}
{%- endif -%}"""
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


# ------------------------------------------------------------------------ corpus
def stdlib_files(root: Path) -> list[str]:
    """Sorted relative paths of the stdlib's .py files, test suites and big files left out."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel: str, pct: float) -> bool:
    """A fixed ~pct% of modules, chosen by the SHA-256 of the path (no randomness)."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h % 10_000 < pct * 100


def functions_with_docstrings(source: str) -> list[tuple[str, str]]:
    """(signature + docstring, the whole function) of each function and method (top level
    and one class deep) with a docstring and a body after it."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    out = []
    nodes = [*tree.body]
    nodes += [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
    for node in nodes:
        if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
            continue
        doc = node.body[0]
        if len(node.body) < 2 or doc.end_lineno is None or node.end_lineno is None:
            continue
        prompt = "".join(lines[node.lineno - 1 : doc.end_lineno])
        out.append((prompt, "".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


def chat_sample(prompt: str, body: str) -> str:
    """A chat-format training sample: asked for a function by signature and docstring."""
    return (f"[gMASK]<sop><|user|>\nWrite this Python function.\n{prompt}<|assistant|>\n"
            f"{body.rstrip()}\n{EOT}")  # fmt: skip


def build_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(tok: Any, out: Path, max_len: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    named = {"eos_token": EOT, "pad_token": EOT}
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", **named, "add_bos_token": False,
            "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": max_len, "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": named,
        "generation_config.json": {
            "eos_token_id": [tok.token_to_id(t) for t in GENERATION_EOS],
            "pad_token_id": tok.token_to_id(EOT),
        },
    }  # fmt: skip
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")


def cmd_prepare(args: argparse.Namespace) -> None:
    import numpy as np

    if sys.version_info[:2] != PINNED_PYTHON and not args.allow_other_python:
        sys.exit(f"prepare: the corpus is pinned to Python {PINNED_PYTHON[0]}."
                 f"{PINNED_PYTHON[1]}'s standard library, this is "
                 f"{sys.version_info[0]}.{sys.version_info[1]}; rerun on the pinned "
                 "interpreter or pass --allow-other-python")  # fmt: skip
    root = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if args.max_files:
        step = max(1, len(files) // args.max_files)
        files = files[::step][: args.max_files]
    if args.files:
        files = sorted(args.files.split(","))
    heldout = [f for f in files if is_heldout(f, args.heldout_pct)]
    if args.heldout_files:
        heldout = sorted(args.heldout_files.split(","))
    if not heldout or not set(heldout) <= set(files):
        sys.exit(f"prepare: the held-out modules {heldout} must be a non-empty part of the corpus")
    train = [f for f in files if f not in set(heldout)]
    text = {f: (root / f).read_text(encoding="utf-8", errors="replace") for f in files}
    chats = [chat_sample(p, b) for f in train for p, b in functions_with_docstrings(text[f])]
    rng = random.Random(0)
    rng.shuffle(chats)
    chats = chats[: int(len(chats) * args.chat_fraction)]
    tok = build_tokenizer([text[f] for f in train] + chats, args.vocab)
    out = Path(args.out)
    write_tokenizer(tok, out / "tokenizer", args.max_len)
    eot = tok.token_to_id(EOT)

    def ids(docs: list[str]) -> Any:
        enc = tok.encode_batch(docs)
        flat = [i for e in enc for i in [*e.ids, eot]]
        return np.asarray(flat, dtype=np.uint16 if tok.get_vocab_size() < 65536 else np.int32)

    train_ids = ids([text[f] for f in train] + chats)
    held_ids = ids([text[f] for f in heldout])
    np.savez_compressed(out / "tokens.npz", train=train_ids, heldout=held_ids)
    prompts = [p for f in heldout for p, _ in functions_with_docstrings(text[f])]
    (out / "eval_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    manifest = {
        "python": list(sys.version_info[:2]),
        "stdlib": str(root),
        "files": len(files),
        "files_sha256": hashlib.sha256("\n".join(files).encode()).hexdigest(),
        "heldout_pct": args.heldout_pct,
        "heldout": heldout,
        "heldout_bytes": sum(len(text[f].encode()) for f in heldout),
        "train_bytes": sum(len(text[f].encode()) for f in train),
        "chat_samples": len(chats),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "eval_prompts": len(prompts),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({k: v for k, v in manifest.items() if k != "heldout"}))


# ------------------------------------------------------------------------- train
def cosine_lr(step: int, frac: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``peak`` to ``floor * peak``
    as ``frac`` (the share of the schedule after warm-up that is done) goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, max(0.0, frac))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def cmd_train(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import train_demo_model as dm

    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((data / "manifest.json").read_text())
    tok_dir = data / "tokenizer"
    gen = json.loads((tok_dir / "generation_config.json").read_text())
    config = dm.build_config(args.preset, manifest["vocab_size"], gen["eos_token_id"],
                             gen["pad_token_id"])  # fmt: skip
    config["max_position_embeddings"] = max(config["max_position_embeddings"], args.seq_len + 1)
    torch.manual_seed(args.seed)
    np_rng = np.random.default_rng(args.seed)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    trunk = dm.hf_model(config)
    mtp = dm.MTPHead(trunk)
    dm.save_checkpoint(out / "random_init", config, trunk, mtp, tok_dir)  # the baseline
    trunk.to(dev).train()
    mtp.to(dev).train()
    modules = [*trunk.modules(), *mtp.modules()]
    distill = dm.IndexerDistill(modules)
    balancer = dm.RouterBalancer(modules, args.bias_update)
    params = [p for p in [*trunk.parameters(), *mtp.parameters()] if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=dev.type == "cuda",
    )  # fmt: skip
    tokens = torch.from_numpy(np.load(data / "tokens.npz")["train"].astype(np.int64))
    n_win = tokens.numel() - args.seq_len - 2

    def batch() -> torch.Tensor:
        starts = torch.from_numpy(np_rng.integers(0, n_win, args.batch))
        idx = starts[:, None] + torch.arange(args.seq_len + 1)[None]
        return tokens[idx].to(dev, non_blocking=True)

    held = np.load(data / "tokens.npz")["heldout"].astype(np.int64)
    n_held = max(1, min(16, (held.size - 1) // (args.seq_len + 1)))
    held_ids = torch.from_numpy(held[: n_held * (args.seq_len + 1)].reshape(n_held, -1)).to(dev)
    use_amp = args.autocast == "bf16" or (args.autocast == "auto" and dev.type == "cuda")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if use_amp else None

    def heldout_ce() -> float:
        trunk.eval()
        mtp.eval()
        with torch.no_grad(), amp or contextlib.nullcontext():
            ce_h, _, _ = dm.lm_losses(trunk, mtp, held_ids)
        trunk.train()
        mtp.train()
        return ce_h.item()

    t0 = time.monotonic()
    budget = args.max_minutes * 60 - (t0 - PROCESS_START)  # what is left for the loop
    total = args.steps or 10**9
    rows: list[dict[str, Any]] = []
    step, t_warm = 0, t0
    error = None
    try:  # a failure mid-run still saves what was trained
        while step < total:
            now = time.monotonic()
            if now - t0 > budget:
                print(f"time budget reached at step {step}", flush=True)
                break
            if step == args.warmup:
                t_warm = now
            # the cosine runs over --steps, or else over the wall-clock time left after warm-up
            if args.steps:
                frac = (step - args.warmup) / max(1, total - args.warmup)
            else:
                frac = (now - t_warm) / max(1e-9, t0 + 0.98 * budget - t_warm)
            lr = cosine_lr(step, frac, args.lr, args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            distill.active, balancer.active = args.indexer_weight > 0, True
            ids = batch()
            with amp or contextlib.nullcontext():
                ce, ce_mtp, acc = dm.lm_losses(trunk, mtp, ids)
            kl = distill.take()
            distill.active = balancer.active = False
            loss = ce + args.mtp_weight * ce_mtp
            if kl is not None:
                loss = loss + args.indexer_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            imbalance = balancer.update()
            if step % args.log_every == 0 or step == total - 1:
                row = {"step": step, "time_s": round(time.monotonic() - t0, 2), "lr": lr,
                       "loss": loss.item(), "ce_main": ce.item(), "ce_mtp": ce_mtp.item(),
                       "mtp_acc": acc.item(), "indexer_kl": kl.item() if kl is not None else 0.0,
                       "max_load_ratio": float(imbalance),
                       "heldout_ce": heldout_ce() if step % args.eval_every == 0 else ""}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            step += 1
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        error = f"stopped at step {step}: {e!r}"
    distill.active = balancer.active = False
    final_heldout = heldout_ce() if error is None else None
    trunk.eval()
    mtp.eval()
    dm.save_checkpoint(out / "checkpoint", config, trunk, mtp, tok_dir)
    _write_curve(out, rows, args.plot)
    summary = {
        "steps": step, "error": error, "final_heldout_ce": final_heldout,
        "seconds": round(time.monotonic() - t0, 1), "device": str(dev), "preset": args.preset,
        "seed": args.seed, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
        "warmup": args.warmup, "mtp_weight": args.mtp_weight,
        "indexer_weight": args.indexer_weight, "bias_update": args.bias_update,
        "tokens_seen": step * args.batch * args.seq_len,
        "epochs": round(step * args.batch * args.seq_len / tokens.numel(), 2),
        "torch": torch.__version__, "python": list(sys.version_info[:3]),
    }  # fmt: skip
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)


def _write_curve(out: Path, rows: list[dict[str, Any]], plot: bool) -> None:
    import csv

    if not rows:
        return
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: loss.png skipped (loss.csv has the curve)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    for key in ("ce_main", "ce_mtp", "indexer_kl"):
        ax.plot(steps, [r[key] for r in rows], label=key)
    held = [(r["step"], r["heldout_ce"]) for r in rows if r["heldout_ce"] != ""]
    ax.plot([h[0] for h in held], [h[1] for h in held], "o-", label="heldout ce_main")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------- eval
def trim_completion(prompt: str, completion: str, hit_limit: bool) -> str:
    """The completion up to the first line indented no deeper than the ``def`` (the
    function ended); without a dedent and cut by the token limit, up to its last newline."""
    indent = len(prompt) - len(prompt.lstrip())
    kept: list[str] = []
    lines = completion.split("\n")
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            return "\n".join(kept) + "\n"
        kept.append(line)
    if hit_limit:
        return "\n".join(kept[:-1]) + "\n"
    return completion


def completion_parses(prompt: str, completion: str, hit_limit: bool) -> tuple[bool, int]:
    """(signature + docstring + trimmed completion parses and adds a statement, body lines)."""
    body = trim_completion(prompt, completion, hit_limit)
    n_lines = sum(1 for line in body.split("\n") if line.strip())
    try:
        ast.parse(textwrap.dedent(prompt + body))
    except SyntaxError:
        return False, n_lines
    return n_lines > 0, n_lines


def heldout_perplexity(ckpt: Path, data: Path, seq_len: int, max_tokens: int) -> dict[str, float]:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model: Any = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = model.to(dev).eval()
    ids = np.load(data / "tokens.npz")["heldout"].astype(np.int64)[:max_tokens]
    n = (ids.size - 1) // seq_len
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, 16):
            rows = [ids[j * seq_len : (j + 1) * seq_len + 1] for j in range(i, min(n, i + 16))]
            x = torch.tensor(np.stack(rows), device=dev)
            logits = model(input_ids=x[:, :-1]).logits.float()
            ce = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            total += float(ce)
            count += x[:, 1:].numel()
    manifest = json.loads((data / "manifest.json").read_text())
    nll = total / max(1, count)
    byte_share = count / max(1, manifest["heldout_tokens"])
    bits_per_byte = total / math.log(2) / max(1.0, manifest["heldout_bytes"] * byte_share)
    return {"tokens": count, "nll": nll, "perplexity": math.exp(nll),
            "bits_per_byte": bits_per_byte}  # fmt: skip


def completion_eval(
    ckpt: Path, prompts: list[str], max_new: int, device: str, check_plain: bool
) -> dict[str, Any]:
    """Greedy completions through pdserve with MTP k=1 speculation (greedy verification
    gives the plain greedy tokens; ``check_plain`` runs a plain engine to confirm)."""
    from pdserve import SamplingParams
    from pdserve.frontend.llm import LLM

    sp = SamplingParams(temperature=0, max_tokens=max_new)
    spec = LLM(str(ckpt), dtype="float32", device=device,
               speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip
    outs = spec.generate(prompts, sp)
    st = spec.engine.stats()
    ok, lines = 0, 0
    examples: list[dict[str, Any]] = []
    for p, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        parsed, n = completion_parses(p, c.text, len(c.token_ids) >= max_new)
        ok += parsed
        lines += n
        if len(examples) < 3:
            examples.append({"prompt": p, "completion": c.text, "parses": parsed})
    drafted = st.spec_num_draft_tokens
    report = {
        "prompts": len(prompts), "parse_rate": ok / max(1, len(prompts)),
        "mean_body_lines": lines / max(1, len(prompts)),
        "mtp_acceptance_rate": st.spec_num_accepted_tokens / drafted if drafted else None,
        "mtp_drafted": drafted, "examples": examples,
    }  # fmt: skip
    if check_plain:
        plain = LLM(str(ckpt), dtype="float32", device=device).generate(prompts, sp)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                   for a, b in zip(plain, outs, strict=True))  # fmt: skip
        report["mtp_same_tokens_share"] = same / max(1, len(prompts))
    return report


def cmd_eval(args: argparse.Namespace) -> None:
    data = Path(args.data)
    prompts = json.loads((data / "eval_prompts.json").read_text())[: args.max_prompts]
    report: dict[str, Any] = {}
    for name, path in (("trained", args.checkpoint), ("random_init", args.baseline)):
        if not path:
            continue
        t = time.monotonic()
        ppl = heldout_perplexity(Path(path), data, args.seq_len, args.max_ppl_tokens)
        report[name] = {"heldout": ppl}
        print(json.dumps({name: ppl}), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")  # partial results
        report[name]["completions"] = completion_eval(
            Path(path), prompts, args.max_new_tokens, args.device, args.check_plain
        )
        report[name]["seconds"] = round(time.monotonic() - t, 1)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: {"ppl": v["heldout"]["perplexity"],
                          "parse_rate": v["completions"]["parse_rate"],
                          "mtp_acceptance": v["completions"]["mtp_acceptance_rate"]}
                      for k, v in report.items()}))  # fmt: skip


# --------------------------------------------------------------------------- cli
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="corpus, tokenizer, token ids (run on the pinned Python)")
    pp.add_argument("--out", required=True)
    pp.add_argument("--stdlib", help="stdlib directory (default: this interpreter's)")
    pp.add_argument("--vocab", type=int, default=8192)
    pp.add_argument("--heldout-pct", type=float, default=3.0)
    pp.add_argument("--chat-fraction", type=float, default=1.0,
                    help="share of training functions also given as chat samples")  # fmt: skip
    pp.add_argument("--max-files", type=int, default=0, help="a spread subset (smoke tests)")
    pp.add_argument("--files", help="comma-separated relative paths instead (smoke tests)")
    pp.add_argument("--heldout-files", help="comma-separated held-out paths instead of the hash")
    pp.add_argument("--max-len", type=int, default=2048)
    pp.add_argument("--allow-other-python", action="store_true")
    tp = sub.add_parser("train", help="train and save checkpoint/ and random_init/")
    tp.add_argument("--data", required=True)
    tp.add_argument("--out", required=True)
    tp.add_argument("--preset", default="demo", choices=["demo", "micro"])
    tp.add_argument("--device", default=None)
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--autocast", default="auto", choices=["auto", "bf16", "off"],
                    help="bf16 autocast (auto: on CUDA only)")  # fmt: skip
    tp.add_argument("--max-minutes", type=float, default=8.0)
    tp.add_argument("--steps", type=int, default=0, help="step count (0: fill --max-minutes)")
    tp.add_argument("--batch", type=int, default=64)
    tp.add_argument("--seq-len", type=int, default=512)
    tp.add_argument("--lr", type=float, default=2e-3)
    tp.add_argument("--warmup", type=int, default=100)
    tp.add_argument("--weight-decay", type=float, default=0.1)
    tp.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of CE_mtp")
    tp.add_argument("--indexer-weight", type=float, default=1.0, help="0 disables the KL")
    tp.add_argument("--bias-update", type=float, default=1e-3, help="router bias step")
    tp.add_argument("--log-every", type=int, default=25)
    tp.add_argument("--eval-every", type=int, default=250, help="held-out CE (a log step)")
    tp.add_argument("--no-plot", dest="plot", action="store_false", help="skip loss.png")
    ep = sub.add_parser("eval", help="perplexity, parse rate, MTP acceptance -> JSON")
    ep.add_argument("--data", required=True)
    ep.add_argument("--checkpoint", required=True)
    ep.add_argument("--baseline", default=None, help="e.g. the run's random_init/")
    ep.add_argument("--out", required=True)
    ep.add_argument("--device", default="cpu", help="pdserve's device for completions")
    ep.add_argument("--seq-len", type=int, default=512)
    ep.add_argument("--max-ppl-tokens", type=int, default=200_000)
    ep.add_argument("--max-prompts", type=int, default=200)
    ep.add_argument("--max-new-tokens", type=int, default=96)
    ep.add_argument("--check-plain", action="store_true", help="also run without MTP")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    {"prepare": cmd_prepare, "train": cmd_train, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
