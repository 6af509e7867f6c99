"""``--dry-run`` on the shipped examples, and the CLI's exit codes for bad files."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.serving.launch import cli as launcher
from pdserve.serving.launch.topology import Topology

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_main(*argv: str) -> int:
    p = argparse.ArgumentParser()
    launcher.add_cli_args(p)
    return launcher.main(p.parse_args(list(argv)))


def commands(out: str) -> dict[str, list[str]]:
    """name -> argv (env stripped) of every process in a dry-run printout."""
    lines = out.splitlines()
    res = {}
    for i, ln in enumerate(lines):
        if ln.startswith("# ") and ": role=" in ln:
            argv = shlex.split(lines[i + 1])
            assert argv[0] == "env"
            j = next(k for k, a in enumerate(argv[1:], 1) if "=" not in a)
            res[ln[2:].split(":")[0]] = argv[j:]
    return res


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("1p1d-cpu.yaml", ["prefill-0", "decode-0", "proxy"]),
        ("2p1d-cpu.yaml", ["prefill-0", "prefill-1", "decode-0", "proxy"]),
        (
            "4p1d-glm5.yaml",
            ["prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0", "proxy"],
        ),
    ],
)
def test_examples_dry_run(
    name: str, expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    Topology.load(EXAMPLES / name)
    assert run_main(str(EXAMPLES / name), "--dry-run") == 0
    out = capsys.readouterr().out
    cmds = commands(out)
    assert list(cmds) == expected
    for n, argv in cmds.items():
        assert argv[:4] == [sys.executable, "-m", "pdserve", "proxy" if n == "proxy" else "serve"]
    proxy = cmds["proxy"]
    n_pre = sum(1 for n in cmds if n.startswith("prefill"))
    assert proxy[proxy.index("--prefill") + 1 : proxy.index("--decode")] == [
        f"http://127.0.0.1:{8100 + i}" for i in range(n_pre)
    ]
    assert proxy[proxy.index("--decode") + 1] == "http://127.0.0.1:8200"
    assert proxy[-2:] == ["--port", "8000"]


def test_colocated_example_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(str(EXAMPLES / "2x-colocated-cpu.yaml"), "--dry-run") == 0
    cmds = commands(capsys.readouterr().out)
    assert list(cmds) == ["colocated-0", "colocated-1", "proxy"]
    for name in ("colocated-0", "colocated-1"):
        assert "--kv-transfer-config" not in cmds[name]
    assert cmds["proxy"][4:] == [
        "--colocated", "http://127.0.0.1:8100", "http://127.0.0.1:8101",
        "--host", "127.0.0.1", "--port", "8000",
    ]  # fmt: skip


def test_cpu_example_details(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(str(EXAMPLES / "1p1d-cpu.yaml"), "--dry-run", "--log-dir", "/x") == 0
    out = capsys.readouterr().out
    cmds = commands(out)
    pre = cmds["prefill-0"]
    assert pre[4] == "checkpoints/tiny-llama"
    assert pre[pre.index("--dtype") + 1] == "float32"
    assert pre[pre.index("--device") + 1] == "cpu"
    kv = json.loads(pre[pre.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "PdConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"transport": "tcp"},
    }
    assert "log=/x/prefill-0.log" in out
    assert "CUDA_VISIBLE_DEVICES=''" in out


def test_glm5_example_matches_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(str(EXAMPLES / "4p1d-glm5.yaml"), "--dry-run") == 0
    out = capsys.readouterr().out
    cmds = commands(out)

    def val(argv: list[str], f: str) -> str:
        return argv[argv.index(f) + 1]

    gpus = []
    for i in range(4):
        pre = cmds[f"prefill-{i}"]
        assert (val(pre, "--tensor-parallel-size"), val(pre, "--data-parallel-size")) == ("1", "4")
        assert "--enable-expert-parallel" in pre
        assert json.loads(val(pre, "--speculative-config"))["num_speculative_tokens"] == 1
        assert json.loads(val(pre, "--kv-transfer-config"))["kv_role"] == "kv_producer"
        assert val(pre, "--device") == "cuda"
        gpus.append(f"CUDA_VISIBLE_DEVICES={','.join(str(4 * i + k) for k in range(4))} ")
    dec = cmds["decode-0"]
    assert val(dec, "--data-parallel-size") == "8" and "--enable-expert-parallel" in dec
    assert json.loads(val(dec, "--speculative-config")) == {
        "method": "mtp",
        "num_speculative_tokens": 3,
    }
    assert json.loads(val(dec, "--compilation-config")) == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert val(dec, "--max-num-batched-tokens") == "1024"
    for argv in (dec, cmds["prefill-0"]):  # the reference's API on both roles
        assert "--enable-auto-tool-choice" in argv
        assert (val(argv, "--tool-call-parser"), val(argv, "--reasoning-parser")) == (
            "glm47",
            "glm45",
        )
    kv = json.loads(val(dec, "--kv-transfer-config"))
    assert kv["kv_role"] == "kv_consumer" and kv["kv_connector_extra_config"] == {
        "transport": "nixl"
    }
    gpus.append("CUDA_VISIBLE_DEVICES=16,17,18,19,20,21,22,23 ")
    for g in gpus:
        assert g in out
    assert all(c[4] == "/models/GLM-5.2" for n, c in cmds.items() if n != "proxy")


def test_bad_file_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("model: m\ninstances:\n  - {role: colocated, port: 1234, devices: cpu, prot: 1}\n")
    assert run_main(str(p), "--dry-run") == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve launch: error: ")
    assert "bad.yaml: instances[0]: unknown key(s) prot" in err


def test_module_entry_point_dry_run() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.serving.launch",
            str(EXAMPLES / "2p1d-cpu.yaml"),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert list(commands(r.stdout)) == ["prefill-0", "prefill-1", "decode-0", "proxy"]
