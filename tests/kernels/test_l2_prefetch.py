"""The L2 prefetch kernel reads every byte it is given (its XOR words match the torch
reference) and the side-stream prefetcher is graph-capturable and changes no result."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.l2_prefetch import BLOCK, l2_prefetch, l2_prefetch_reference
from pdserve.layers.prefetch import WeightPrefetcher


@pytest.mark.parametrize(
    ("shape", "ctas"),
    [((7, 6), 1), ((64, 130), 3), ((3 * BLOCK + 5, 2), 4), ((BLOCK, 2), 8)],
)
def test_prefetch_reads_every_word(device: torch.device, shape: tuple[int, int], ctas: int) -> None:
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
    sink = torch.full((ctas,), -1, dtype=torch.int32, device=device)
    l2_prefetch(w, sink)
    assert torch.equal(sink.cpu(), l2_prefetch_reference(w, ctas))


def test_prefetch_refuses_bad_inputs(device: torch.device) -> None:
    sink = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(torch.zeros(8, 8, device=device).t()[:3], sink)
    with pytest.raises(ValueError, match="whole 4-byte words"):
        l2_prefetch(torch.zeros(3, dtype=torch.bfloat16, device=device), sink)
    with pytest.raises(ValueError, match="int32 sink"):
        l2_prefetch(torch.zeros(8, device=device), sink.float())


def test_prefetcher_env_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_L2_PREFETCH", "0")
    assert not WeightPrefetcher.from_env().enabled
    monkeypatch.setenv("PDSERVE_L2_PREFETCH", "1")
    monkeypatch.setenv("PDSERVE_L2_PREFETCH_CTAS", "16")
    pf = WeightPrefetcher.from_env()
    assert pf.enabled and pf.num_ctas == 16
    # CPU weights are never prefetched, so there is nothing to join
    assert not pf.start(torch.zeros(4, 4), num_tokens=1)
    with pytest.raises(RuntimeError, match="no weight prefetch"):
        pf.join()
    monkeypatch.setenv("PDSERVE_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        WeightPrefetcher.from_env()
    monkeypatch.setenv("PDSERVE_L2_PREFETCH", "1")
    monkeypatch.setenv("PDSERVE_L2_PREFETCH_CTAS", "0")
    with pytest.raises(ValueError, match="PDSERVE_L2_PREFETCH_CTAS"):
        WeightPrefetcher.from_env()


@pytest.mark.gpu
def test_prefetch_in_a_cuda_graph() -> None:
    """start/join captured in a graph: the replay overlaps the prefetch with other work,
    the GEMM result is the eager one, and the sink holds the prefetched words."""
    dev = torch.device("cuda")
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(4, 4096, device=dev, dtype=torch.bfloat16)
    pf = WeightPrefetcher(True, num_ctas=32, max_tokens=64)
    assert not pf.start(w, num_tokens=65)  # a prefill-sized step does not prefetch

    def step() -> torch.Tensor:
        assert pf.start(w, num_tokens=x.shape[0])
        y = torch.tanh(x) * 2  # the latency-bound stretch it overlaps
        pf.join()
        return y @ w.t()

    eager = step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(pf._sinks[w.device].cpu(), l2_prefetch_reference(w, 32))
