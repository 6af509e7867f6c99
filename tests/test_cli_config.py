"""Every engine flag reaches the engine config (a flag that parses but is dropped is a bug)."""

import pytest

from pdserve.cli import build_parser
from pdserve.config import EngineConfig


def test_serve_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        [
            "serve",
            "/m",
            "--enforce-eager",
            "--max-num-seqs",
            "7",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--kv-transfer-config",
            '{"kv_connector": "PdConnector", "kv_role": "kv_producer"}',
        ]
    )
    cfg = EngineConfig.from_cli(args)
    assert cfg.compilation.cudagraph_mode == "NONE"
    assert cfg.kv_transfer is not None and cfg.kv_transfer.is_producer
    assert cfg.scheduler.max_num_seqs == 7 and cfg.cache.block_size == 32
    assert cfg.cache.enable_prefix_caching is False


def test_compilation_config_flag():
    args = build_parser().parse_args(
        [
            "serve",
            "/m",
            "--compilation-config",
            '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 4]}',
        ]
    )
    cfg = EngineConfig.from_cli(args)
    assert cfg.compilation.cudagraph_mode == "FULL_DECODE_ONLY"
    assert cfg.compilation.capture_sizes(256) == [1, 4]


def test_serve_body_limit_flag():
    from pdserve.serving.api.middleware import DEFAULT_MAX_REQUEST_BODY_BYTES

    parse = build_parser().parse_args
    assert parse(["serve", "/m"]).max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES
    assert parse(["serve", "/m", "--max-request-body-bytes", "1024"]).max_request_body_bytes == 1024
    assert parse(["serve", "/m", "--max-request-body-bytes", "0"]).max_request_body_bytes == 0
    with pytest.raises(SystemExit):
        parse(["serve", "/m", "--max-request-body-bytes", "-1"])


def test_generate_runs_on_the_tiny_checkpoint(tiny_llama, capsys):
    """`pdserve generate` as the README shows it (it died in dataclasses.asdict on the
    unset --kv-transfer-config)."""
    from pdserve.cli import main

    argv = ["generate", str(tiny_llama), "--prompt", "Hello", "--prompt", "Bye"]
    rc = main([*argv, "--max-tokens", "4", "--ignore-eos", "--enforce-eager"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("output (4 tokens, finish_reason=length)") == 2
    assert "generated 8 tokens" in out
