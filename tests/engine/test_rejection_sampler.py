"""Rejection sampling on its own: the tokens it emits are distributed as the target's
sampling distribution whatever the drafts are, and placeholder drafts are never accepted.

The statistical tests draw N = 40,000 independent verifies of one fixed distribution in
one batch, with the sampler seeded (deterministic), and compare the emitted tokens'
counts with the target probabilities by Pearson's chi-square. The threshold is the
chi-square critical value at significance 0.001 for the test's degrees of freedom, so a
correct sampler fails with probability 1e-3 per seed, and a biased one (for instance
emitting the draft whenever it is accepted *or* resampling it after a rejection) is
far above it at this N (checked below against deliberately wrong samplers).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.layers.sampler import Sampler, SamplingMetadata
from pdserve.spec_decode.rejection_sampler import rejection_sample

N = 40_000
V = 6
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def _md(rows: int, temperature: float, top_k: int | None = None, top_p: float | None = None):  # type: ignore[no-untyped-def]
    return SamplingMetadata(
        all_greedy=temperature == 0.0,
        temperature=torch.full((rows,), temperature if temperature else 1.0),
        greedy_rows=None,
        top_k=torch.full((rows,), top_k, dtype=torch.int64) if top_k else None,
        top_p=torch.full((rows,), top_p) if top_p else None,
        min_p=None,
        generators={},
        banned=None,
        need_logprobs=False,
    )


def _target(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):  # type: ignore[no-untyped-def]
    """The distribution the sampler is meant to draw from (a direct, unvectorised recipe)."""
    p = torch.softmax(logits / temperature, dim=-1)
    keep = torch.ones(V, dtype=torch.bool)
    order = torch.argsort(p, descending=True)
    if top_k:
        keep[order[top_k:]] = False
    if top_p:
        cum = 0.0
        for j, i in enumerate(order.tolist()):
            if cum >= top_p:
                keep[order[j:]] = False
                break
            cum += float(p[i])
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def _chi2(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(tokens, minlength=V).double()
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = p[support].double() * len(tokens)
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def _verify(logits_rows: list[torch.Tensor], drafts: torch.Tensor, md: SamplingMetadata, seed: int):  # type: ignore[no-untyped-def]
    """N requests, each verifying ``drafts[b]`` against the rows ``logits_rows``."""
    k = drafts.shape[1]
    logits = torch.stack(logits_rows).repeat(N, 1)  # request b: rows b*(k+1) ..
    row_start = torch.arange(N) * (k + 1)
    num_rows = torch.full((N,), k + 1)
    return rejection_sample(
        Sampler(torch.device("cpu"), seed), logits, md, drafts, row_start, num_rows
    )


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, None, None), (0.7, 4, None), (1.3, None, 0.95)]
)
def test_emitted_tokens_follow_the_target_distribution(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(V, generator=g) * 1.5 for _ in range(3)]
    # drafts from a distribution unlike the target's: mostly token 0, some 5
    d0 = torch.where(torch.rand(N, generator=g) < 0.8, 0, 5)
    d1 = torch.randint(0, V, (N,), generator=g)
    drafts = torch.stack([d0, d1], dim=1)
    md = _md(3 * N, temperature, top_k, top_p)
    tokens, num = _verify(rows, drafts, md, seed=1)
    p0, p1 = (_target(r, temperature, top_k, top_p) for r in rows[:2])
    # the first emitted token is a sample of row 0's distribution
    stat, df = _chi2(tokens[:, 0], p0)
    assert stat < CHI2_999[df], (stat, df)
    # given that draft 0 was accepted, the next emitted token is a sample of row 1's
    acc = num >= 2
    assert acc.sum() > 5000
    stat, df = _chi2(tokens[acc, 1], p1)
    assert stat < CHI2_999[df], (stat, df)
    # acceptance of draft 0 happens with probability p0(draft)
    rate = acc.double().mean().item()
    want = (0.8 * p0[0] + 0.2 * p0[5]).item()
    assert abs(rate - want) < 4 * (want * (1 - want) / N) ** 0.5 + 1e-9


def test_the_chi_square_check_catches_a_biased_sampler() -> None:
    """The same check on a sampler that keeps every draft (emits the draft distribution):
    far above the threshold, so the test above has the power it claims."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(V, generator=g) * 1.5
    drafts = torch.where(torch.rand(N, generator=g) < 0.8, 0, 5)
    stat, df = _chi2(drafts, _target(row, 1.0, None, None))
    assert stat > 100 * CHI2_999[df]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_placeholders_are_never_accepted_even_where_token_0_is_certain(temperature: float) -> None:
    """A placeholder (-1) is embedded as token 0; the target here puts all its mass on
    token 0, yet the placeholder is rejected and token 0 is emitted in its place."""
    logits = torch.full((V,), -1e4)
    logits[0] = 10.0
    drafts = torch.full((N // 10, 3), -1)
    drafts[:, 1] = 0  # a real draft after a placeholder is never reached
    n = N // 10
    md = _md(4 * n, temperature)
    tokens, num = rejection_sample(
        Sampler(torch.device("cpu"), 0),
        logits.repeat(4 * n, 1),
        md,
        drafts,
        torch.arange(n) * 4,
        torch.full((n,), 4),
    )
    assert (num == 1).all()
    assert (tokens[:, 0] == 0).all() and (tokens[:, 1:] == -1).all()


def test_seeded_requests_reproduce_their_draws() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, V, generator=g)
    drafts = torch.randint(0, V, (4, 1), generator=g)

    def run() -> torch.Tensor:
        md = _md(8, 1.0)
        md.generators = {r: torch.Generator().manual_seed(100 + r) for r in range(8)}
        tokens, _ = rejection_sample(
            Sampler(torch.device("cpu"), seed=torch.seed() % 1000),  # the global stream differs
            logits,
            md,
            drafts,
            torch.arange(4) * 2,
            torch.full((4,), 2),
        )
        return tokens

    assert torch.equal(run(), run())
