"""Every engine flag reaches the engine config (a flag that parses but is dropped is a bug)."""

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
