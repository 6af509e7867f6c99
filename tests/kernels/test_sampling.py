"""The sort-free sampling kernel against the runner's sort-based sampler math."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.sampling import sample, sample_reference


def _params(b: int, v: int, g: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    temp = torch.rand(b, generator=g) * 1.5 + 0.2
    temp[::7] = 0.0  # greedy rows
    top_k = torch.randint(1, v // 2, (b,), generator=g)
    top_k[::3] = v  # disabled
    top_p = torch.rand(b, generator=g) * 0.9 + 0.1
    top_p[1::4] = 1.0  # disabled
    min_p = torch.rand(b, generator=g) * 0.2
    return {
        "temperature": temp.to(device),
        "top_k": top_k.to(device),
        "top_p": top_p.to(device),
        "min_p": min_p.to(device),
    }


@pytest.mark.parametrize(
    "use", [(), ("top_k",), ("top_p",), ("top_k", "top_p"), ("top_k", "top_p", "min_p")]
)
def test_same_noise_same_tokens(device: torch.device, use: tuple[str, ...]) -> None:
    """With shared Exp(1) noise the kernel picks the reference's token (the only
    allowed differences are float ties at a top-k/top-p boundary)."""
    g = torch.Generator().manual_seed(len(use))
    b, v = 24, 1500
    logits = (torch.randn(b, v, generator=g) * 4).to(device)
    noise = torch.empty(b, v).exponential_(generator=g).to(device)
    p = _params(b, v, g, device)
    kw = {name: p[name] for name in use}
    got = sample(logits, p["temperature"], noise=noise, block=512, **kw)
    ref = sample_reference(logits, p["temperature"], noise=noise, **kw)
    assert got.dtype == torch.int64
    assert (got != ref).sum() <= 1


def test_ties_and_banned_tokens(device: torch.device) -> None:
    """Heavily tied logits (radix select must keep all ties of the k-th value, as
    the reference does) and -inf (banned) tokens, which must never be drawn.

    top-p is left out here on purpose: at a tied nucleus boundary the kernel keeps
    all tied tokens or none (mass strictly above), the sort keeps those its sort
    order happens to put first."""
    g = torch.Generator().manual_seed(5)
    b, v = 16, 700
    logits = torch.randint(-3, 4, (b, v), generator=g).float()
    logits[:, ::5] = float("-inf")
    logits, noise = logits.to(device), torch.empty(b, v).exponential_(generator=g).to(device)
    temp = torch.ones(b, device=device)
    top_k = torch.randint(1, 300, (b,), generator=g).to(device)
    got = sample(logits, temp, top_k, noise=noise, block=256)
    ref = sample_reference(logits, temp, top_k, noise=noise)
    assert torch.all(got % 5 != 0)
    assert torch.equal(got, ref)


def test_greedy_paths(device: torch.device) -> None:
    logits = torch.randn(5, 300, device=device)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, None), greedy)
    temp = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0], device=device)
    rows = torch.tensor([False, True, False, False, False], device=device)
    out = sample(
        logits, temp, greedy_rows=rows, top_k=torch.tensor([300, 300, 1, 2, 300], device=device)
    )
    assert torch.equal(out[:4], greedy[:4])  # T=0, greedy flag, top_k=1, T=0


def test_sampled_distribution(device: torch.device) -> None:
    """Statistical check with a fixed seed: the empirical distribution of many
    draws of one row matches the renormalised top-k/top-p/min-p distribution
    (few draws in the CPU interpreter, many on the GPU)."""
    v = 24
    n, tv_max = (50_000, 0.015) if device.type == "cuda" else (300, 0.1)
    g = torch.Generator().manual_seed(11)
    row = torch.randn(v, generator=g) * 1.5
    logits = row.repeat(n, 1).to(device)
    temp = torch.full((n,), 0.8, device=device)
    top_k = torch.full((n,), 12, device=device)
    top_p = torch.full((n,), 0.85, device=device)
    min_p = torch.full((n,), 0.02, device=device)
    noise = torch.empty(n, v).exponential_(generator=g).to(device)
    got = sample(logits, temp, top_k, top_p, min_p, noise=noise)
    freq = torch.bincount(got.cpu(), minlength=v).double() / n
    # expected distribution, computed directly from the definition
    x = row.double() / 0.8
    order = x.argsort(descending=True)
    probs = torch.zeros(v, dtype=torch.double)
    topk = order[:12]
    pk = torch.softmax(x[topk], 0)
    before = pk.cumsum(0) - pk
    keep = topk[before <= 0.85]
    pk = torch.softmax(x[keep], 0)
    keep = keep[pk >= 0.02 * pk.max()]
    probs[keep] = torch.softmax(x[keep], 0)
    assert freq[probs == 0].sum() == 0
    assert (freq - probs).abs().sum() / 2 < tv_max  # total variation


def test_runner_sampler_uses_the_kernel_with_the_same_draws(device: torch.device) -> None:
    """The runner's Sampler on the fused path (the Triton kernel) returns the tokens of its
    torch path for the same seeds: same noise, same filters."""
    from pdserve.layers.sampler import Sampler, SamplingMetadata

    b, v = 6, 1000
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(b, v, generator=g) * 3).to(device)
    t = torch.full((b,), 0.9, device=device)
    md = SamplingMetadata(
        all_greedy=False,
        temperature=t,
        greedy_rows=torch.tensor([True, False, False, False, False, False], device=device),
        top_k=torch.tensor([v, 50, v, 20, v, 5], dtype=torch.int64, device=device),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 0.95, 1.0], device=device),
        min_p=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.1], device=device),
        generators={3: torch.Generator(device=device).manual_seed(5)},
        banned=None,
        need_logprobs=True,
    )
    torch_path, kernel_path = Sampler(device, seed=7), Sampler(device, seed=7)
    torch_path.fused, kernel_path.fused = False, True
    for _ in range(3):
        md.generators[3].manual_seed(5)
        want, want_lp = torch_path(logits, md)
        md.generators[3].manual_seed(5)
        got, got_lp = kernel_path(logits, md)
        assert torch.equal(got, want)
        assert got_lp is not None and want_lp is not None
        torch.testing.assert_close(got_lp, want_lp)
