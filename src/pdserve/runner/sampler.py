"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

All decisions that depend on request parameters are made on the host from the
parameters themselves (never by reading device values), so sampling adds no host
sync; the runner syncs once per step when it reads the sampled ids.

Random sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` draws
from ``p``. Seeded requests draw their ``E`` row from their own generator, so their
samples do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.layers.fused import use_fused_kernels


@dataclass
class SamplingMetadata:
    """Per-row parameters for one step (row i = request i of the batch)."""

    all_greedy: bool
    temperature: torch.Tensor | None  # [B] float32 (greedy rows hold 1.0)
    greedy_rows: torch.Tensor | None  # [B] bool, None when no row is greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled; None if none uses it
    top_p: torch.Tensor | None  # [B] float32, None if none uses it
    min_p: torch.Tensor | None  # [B] float32, None if none uses it
    generators: dict[int, torch.Generator]  # row -> generator for seeded rows
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to mask (min_tokens)
    need_logprobs: bool


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) set with -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        sorted_logits = sorted_logits.masked_fill(cum > top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)


class Sampler:
    """The step's sampler. Random rows go through the sort-free Triton kernel
    (:func:`pdserve.kernels.sampling.sample`) where fused kernels are on (CUDA, see
    :mod:`pdserve.layers.fused`), else through the sort-based torch path below, which is
    the kernel's reference; both take the same Exp(1) noise, so seeded rows draw the
    same tokens either way up to float rounding at a filter's boundary."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.fused = use_fused_kernels(device)

    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [B, V] float32 -> (token ids [B] int64, logprob of each sampled token or None)."""
        raw = logits
        if md.banned is not None:
            logits = logits.clone()
            logits[md.banned[0], md.banned[1]] = float("-inf")
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            assert md.temperature is not None
            q = torch.empty_like(logits).exponential_(generator=self.generator)
            for row, gen in md.generators.items():
                q[row].exponential_(generator=gen)
            if self.fused:
                from pdserve.kernels.sampling import sample

                sampled = sample(
                    logits,
                    md.temperature,
                    md.top_k,
                    md.top_p,
                    md.min_p,
                    noise=q,
                    greedy_rows=md.greedy_rows,
                )
            else:
                x = logits / md.temperature.unsqueeze(1)
                x = apply_top_k_top_p(x, md.top_k, md.top_p)
                probs = x.softmax(dim=-1)
                if md.min_p is not None:
                    thresh = probs.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
                    probs = probs.masked_fill(probs < thresh, 0.0)
                sampled = (probs / q).argmax(dim=-1)
                if md.greedy_rows is not None:
                    sampled = torch.where(md.greedy_rows, greedy, sampled)
        lp = None
        if md.need_logprobs:
            lp = raw.log_softmax(dim=-1).gather(1, sampled.unsqueeze(1)).squeeze(1)
        return sampled, lp
