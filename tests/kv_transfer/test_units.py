import time

import pytest

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.compat import compat_hash, compat_mismatch
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.transports.base import block_runs


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
        ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "not supported"),
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
