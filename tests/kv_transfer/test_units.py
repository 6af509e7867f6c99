import time

import numpy as np
import pytest

from pdserve.config import KVTransferConfig
from pdserve.config.kv_transfer import DEFAULT_NIXL_THREADS
from pdserve.kv_transfer.compat import compat_hash, compat_mismatch
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.transports.base import block_run_table, block_runs


def test_lease_renew_read_pin_expire_and_finish():
    t = LeaseTable(0.2)
    t.add("a", [1, 2])
    t.add("b", [3])
    t.add("c", [4])
    assert t.begin_read("a") == [1, 2]  # pinned while read
    time.sleep(0.15)
    t.renew(["b"])  # extends b by 2/3 of the lease from now
    time.sleep(0.1)
    assert t.take_expired() == ["c"]  # a is being read, b was renewed
    t.end_read("a")
    assert t.finish("b") and not t.finish("b")
    assert t.take_done() == ["b"] and t.take_done() == []
    time.sleep(0.05)
    assert t.take_expired() == ["a"]
    assert t.num_expired == 2 and len(t) == 0
    assert t.begin_read("a") is None


def test_release_during_a_read_frees_only_after_the_read():
    t = LeaseTable(30)
    t.add("a", [1])
    assert t.begin_read("a") == [1]
    assert t.finish("a")  # e.g. the proxy releases while decode is still reading
    assert t.take_done() == [] and t.begin_read("a") is None
    assert not t.finish("a")
    t.end_read("a")
    assert t.take_done() == ["a"] and len(t) == 0


def test_compat_mismatch_names_each_field():
    a = {"block_size": 16, "dtype": "bfloat16", "num_layers": 2}  # any fields
    assert compat_mismatch(a, dict(a)) is None
    msg = compat_mismatch(a, {**a, "block_size": 32, "dtype": "float16"})
    assert msg is not None
    assert (
        "block_size (prefill 32, decode 16)" in msg and "dtype" in msg and "num_layers" not in msg
    )
    assert compat_hash(a) != compat_hash({**a, "block_size": 32})


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, '"transport": "nixl"'),
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "not supported"),
        ({"kv_connector": "PdConnector", "kv_role": "producer"}, "kv_role"),
        ({"kv_connector": "PdConnector"}, "kv_role"),
        ({"kv_connector": "PdConnector", "kv_role": "kv_both", "x": 1}, "unknown key"),
        (
            {
                "kv_connector": "PdConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"transport": "rdma"},
            },
            "transport",
        ),
        (
            {
                "kv_connector": "PdConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lease": 3},
            },
            "lease",
        ),
        (
            {
                "kv_connector": "PdConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "retry",
            },
            "kv_load_failure_policy",
        ),
    ],
)
def test_kv_transfer_config_is_validated(cfg, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.from_json(cfg)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"allowed_prefill": "127.0.0.1:5000"}, "allowed_prefill must be a list"),
        ({"allowed_prefill": ["127.0.0.1"]}, "allowed_prefill must be a list"),
        ({"allowed_prefill": ["h:0"]}, "allowed_prefill must be a list"),
        ({"allowed_prefill": [5000]}, "allowed_prefill must be a list"),
        ({"max_reads_per_lease": 0}, "max_reads_per_lease must be a number >= 1"),
        ({"max_reads_per_second": "fast"}, "max_reads_per_second"),
        ({"max_ids_per_message": True}, "max_ids_per_message"),
        ({"max_prefill_peers": -1}, "max_prefill_peers"),
        ({"nixl_threads": -1}, "nixl_threads must be an integer >= 0"),
        ({"nixl_threads": 2.5}, "nixl_threads must be an integer >= 0"),
        ({"nixl_threads": 4}, "nixl_threads applies to transport nixl only"),
    ],
)
def test_side_channel_limits_are_validated(extra, match):
    cfg = {"kv_connector": "PdConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.from_json(cfg)


def test_side_channel_limits_have_defaults_and_can_be_set():
    c = KVTransferConfig.from_json({"kv_connector": "PdConnector", "kv_role": "kv_both"})
    assert c is not None and c.allowed_prefill is None
    assert (c.max_reads_per_lease, c.max_ids_per_message, c.max_prefill_peers) == (1, 1024, 64)
    assert c.max_reads_per_second == 1000.0 and c.nixl_threads == 0
    extra = {
        "allowed_prefill": ["10.0.0.1:7000", "[::1]:7001"],
        "max_reads_per_lease": 2,
        "max_reads_per_second": 50,
        "max_ids_per_message": 64,
        "max_prefill_peers": 4,
        "nixl_threads": 4,
        "transport": "nixl",
    }
    c = KVTransferConfig.from_json(
        {"kv_connector": "PdConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    )
    assert c is not None and c.allowed_prefill == {("10.0.0.1", 7000), ("::1", 7001)}
    assert (c.max_reads_per_lease, c.max_ids_per_message, c.max_prefill_peers) == (2, 64, 4)
    assert c.max_reads_per_second == 50.0 and c.nixl_threads == 4


def test_nixl_threads_default_to_the_thread_pool_for_nixl_only() -> None:
    def threads(extra: dict) -> int:
        c = KVTransferConfig.from_json(
            {"kv_connector": "PdConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        )
        assert c is not None
        return c.nixl_threads

    assert threads({"transport": "nixl"}) == DEFAULT_NIXL_THREADS > 1
    assert threads({"transport": "nixl", "nixl_threads": 0}) == 0  # NIXL's single worker
    assert threads({"transport": "cuda_ipc"}) == threads({}) == 0


def test_side_channel_health_is_exported():
    from pdserve.core_types.stats import SchedulerStats
    from pdserve.metrics.prometheus import PrometheusMetrics

    stats = SchedulerStats(
        kv_transfer_healthy=False,
        kv_transfer_restarts=2,
        kv_side_channel_rejected={"unauthenticated": 5, "malformed": 1, "limit": 0},
    )
    reg = PrometheusMetrics("m", stats_provider=lambda: stats, max_model_len=10).registry
    lab = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("pdserve:kv_transfer_healthy", lab) == 0.0
    assert reg.get_sample_value("pdserve:kv_transfer_restarts_total", lab) == 2.0
    got = reg.get_sample_value(
        "pdserve:kv_side_channel_rejected_total", {**lab, "kind": "unauthenticated"}
    )
    assert got == 5.0


def test_kv_transfer_config_from_json_string():
    c = KVTransferConfig.from_json('{"kv_connector": "PdConnector", "kv_role": "kv_consumer"}')
    assert c is not None and c.is_consumer and not c.is_producer and c.transport == "tcp"
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_json("{")


def test_block_runs_coalesce_consecutive_blocks():
    assert block_runs([5, 6, 7, 9, 10], [1, 2, 3, 4, 5]) == [(5, 1, 3), (9, 4, 2)]
    assert block_runs([], []) == []
    assert block_runs([3, 2], [1, 2]) == [(3, 1, 1), (2, 2, 1)]
    with pytest.raises(ValueError):
        block_runs([1], [1, 2])


def test_block_run_table_matches_a_block_by_block_walk() -> None:
    """The vectorised runs equal a walk that extends the last run while both sides stay
    consecutive, on random mappings (some consecutive on one side or both)."""

    def walk(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
        runs: list[tuple[int, int, int]] = []
        for s, d in zip(src, dst, strict=True):
            if runs and (s, d) == (runs[-1][0] + runs[-1][2], runs[-1][1] + runs[-1][2]):
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((s, d, 1))
        return runs

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        src = [int(x) for x in rng.integers(0, 30, n)]
        dst = [int(x) for x in rng.integers(0, 30, n)]
        if rng.random() < 0.5:
            src = list(range(5, 5 + n))
        if rng.random() < 0.5:
            dst = list(range(9, 9 + n))
        table = block_run_table(np.asarray(src), dst)
        assert table.dtype == np.int64 and table.shape == (len(walk(src, dst)), 3)
        assert block_runs(src, dst) == walk(src, dst) == [tuple(r) for r in table.tolist()]


def test_a_wildcard_kv_server_advertises_a_dialable_address(monkeypatch) -> None:
    """kv_transfer_params carry the address decode dials: never 0.0.0.0."""
    import socket

    from pdserve.kv_transfer import server as srv

    assert srv.advertised_host("10.0.0.5") == "10.0.0.5"
    assert srv.advertised_host("0.0.0.0", "prefill-0.internal") == "prefill-0.internal"
    got = srv.advertised_host("0.0.0.0")
    assert got not in srv.WILDCARDS and not got.startswith("0.")

    class NoRoute:
        def __init__(self, *a: object) -> None: ...
        def __enter__(self) -> "NoRoute":
            return self

        def __exit__(self, *a: object) -> None: ...
        def connect(self, addr: object) -> None:
            raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "socket", NoRoute)
    assert srv.advertised_host("0.0.0.0") == "127.0.0.1"
    assert srv.advertised_host("::") == "::1"


def test_compat_refuses_mismatched_kv_cache_scales():
    from pdserve.kv_transfer.compat import compat_info

    def info(scales):
        return compat_info(
            model_config={"a": 1},
            kv_cache=[{"group": "attn", "dtype": "float8_e4m3fn"}],
            block_size=16,
            speculative=None,
            transport="tcp",
            kv_cache_scales=scales,
        )

    a = info({"model.layers.0.self_attn.attn": [0.5, 0.25]})
    assert a["kv_cache_scales"].startswith("sha256:") and a["kv_cache_scales"].endswith(
        "over 1 layers"
    )
    assert compat_mismatch(a, info({"model.layers.0.self_attn.attn": [0.5, 0.25]})) is None
    msg = compat_mismatch(info({"model.layers.0.self_attn.attn": [0.5, 0.5]}), a)
    assert msg is not None and "kv_cache_scales (prefill 'sha256:" in msg
    assert "the per-layer fp8 KV cache k_scale/v_scale" in msg and "block_size" not in msg
    assert info(None)["kv_cache_scales"] == info({})["kv_cache_scales"] == "none"
