"""The KV budget arithmetic of ``gpu_memory_utilization`` (pure function, no GPU needed)."""

from __future__ import annotations

from pdserve.runner.memory import NON_TORCH_ALLOWANCE, kv_budget_bytes

GIB = 1 << 30
TOTAL = 140 * GIB


def test_alone_on_the_card_charges_the_drop_in_free_memory() -> None:
    # 20 GiB of weights + activations went from free to ours; the allocator reserved 19.5.
    budget, ours = kv_budget_bytes(TOTAL, 115 * GIB, 135 * GIB, int(19.5 * GIB), 0.9)
    assert ours == 20 * GIB
    assert budget == int(TOTAL * 0.9) - 20 * GIB


def test_a_neighbour_loading_meanwhile_is_not_charged_to_us() -> None:
    """Two instances share a GPU and start together: free memory fell by 40 GiB while
    this process reserved only 19 (the other 20 are the neighbour's weights)."""
    budget, ours = kv_budget_bytes(TOTAL, 95 * GIB, 135 * GIB, 19 * GIB, 0.42)
    assert ours == 19 * GIB + NON_TORCH_ALLOWANCE
    assert budget == int(TOTAL * 0.42) - ours
    assert budget > 38 * GIB  # was 0.42 * 140 - 40 = 18.8 GiB before the cap


def test_budget_never_exceeds_what_is_free() -> None:
    budget, _ = kv_budget_bytes(TOTAL, 30 * GIB, 135 * GIB, 19 * GIB, 0.9)
    assert budget == 30 * GIB - int(0.02 * TOTAL)
