"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

All decisions that depend on request parameters are made on the host from the
parameters themselves (never by reading device values), so sampling adds no host
sync; the runner syncs once per step when it reads the sampled ids.

Random sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` draws
from ``p``. Seeded requests draw their ``E`` row from their own generator, so their
samples do not depend on what else is in the batch.

One row of logits per sampled position: a plain step has one per request, a
speculative verify one per draft plus one (the rejection sampler in
:mod:`pdserve.spec_decode.rejection_sampler` uses :meth:`Sampler.probs` and
:meth:`Sampler.noise` for those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.reference import apply_top_k_top_p
from pdserve.layers.fused import use_fused_kernels


@dataclass
class Penalties:
    """vLLM's penalties of the rows that have any: ``counts`` of each id among the row's
    output tokens so far, ``prompt`` marks the ids of its prompt."""

    rows: torch.Tensor  # [P] int64 logits rows
    counts: torch.Tensor  # [P, V] float32
    prompt: torch.Tensor  # [P, V] bool
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise ``logits`` [R, V] in place."""
        x = logits[self.rows]
        out = self.counts > 0
        rep = self.repetition.unsqueeze(1)
        seen = self.prompt | out
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - self.frequency.unsqueeze(1) * self.counts
        x = x - self.presence.unsqueeze(1) * out.to(x.dtype)
        logits[self.rows] = x


@dataclass
class SamplingMetadata:
    """Per-row parameters for one step (row i = one sampled position)."""

    all_greedy: bool
    temperature: torch.Tensor | None  # [R] float32 (greedy rows hold 1.0)
    greedy_rows: torch.Tensor | None  # [R] bool, None when no row is greedy
    top_k: torch.Tensor | None  # [R] int64, vocab size where disabled; None if none uses it
    top_p: torch.Tensor | None  # [R] float32, None if none uses it
    min_p: torch.Tensor | None  # [R] float32, None if none uses it
    generators: dict[int, torch.Generator]  # row -> generator for seeded rows
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to mask (min_tokens)
    need_logprobs: bool
    num_top_logprobs: int = 0  # top-N alternatives to return per row (the batch's largest N)
    # logit_bias: (rows, token ids, values) added to the logits
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: (restricted [R] bool, rows, token ids); a restricted row keeps
    # only its listed ids
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    # structured output: (logits rows [S] int64, bitmask [S, ceil(V / 32)] int32); bit j of
    # a row's mask set = token j allowed
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None


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

    def masked(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """``logits`` plus each row's ``logit_bias``, then penalised (presence, frequency,
        repetition), then with the ids outside its ``allowed_token_ids``, the banned ids
        (min_tokens) and the ids its grammar forbids (structured output) at -inf; a copy
        when any of these applies."""
        if (
            md.banned is None
            and md.bias is None
            and md.allowed is None
            and md.penalties is None
            and md.grammar is None
        ):
            return logits
        logits = logits.clone()
        if md.bias is not None:
            rows, ids, values = md.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if md.penalties is not None:
            md.penalties.apply(logits)
        if md.allowed is not None:
            restricted, rows, ids = md.allowed
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[rows, ids] = True
            keep |= ~restricted.unsqueeze(1)
            logits.masked_fill_(~keep, float("-inf"))
        if md.banned is not None:
            logits[md.banned[0], md.banned[1]] = float("-inf")
        if md.grammar is not None:
            rows, bitmask = md.grammar
            allowed = unpack_bitmask(bitmask, logits.shape[-1])
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits

    def noise(self, like: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Exp(1) noise per row; seeded rows draw theirs from their own generators."""
        q = torch.empty_like(like).exponential_(generator=self.generator)
        for row, gen in md.generators.items():
            q[row].exponential_(generator=gen)
        return q

    def uniform(self, n: int, device: torch.device, md: SamplingMetadata) -> torch.Tensor:
        """U(0, 1) per row; seeded rows draw theirs from their own generators."""
        u = torch.rand(n, device=device, generator=self.generator)
        for row, gen in md.generators.items():
            u[row] = torch.rand((), device=device, generator=gen)
        return u

    def probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution each row samples from after temperature, top-k, top-p and
        min-p (greedy rows: one-hot at their argmax), normalised. ``logits`` are already
        :meth:`masked`."""
        if md.all_greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        assert md.temperature is not None
        x = apply_top_k_top_p(logits / md.temperature.unsqueeze(1), md.top_k, md.top_p)
        p = x.softmax(dim=-1)
        if md.min_p is not None:
            thresh = p.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
            p = p.masked_fill(p < thresh, 0.0)
            p = p / p.sum(dim=-1, keepdim=True)
        if md.greedy_rows is not None:
            hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(p.dtype)
            p = torch.where(md.greedy_rows.unsqueeze(1), hot, p)
        return p

    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [R, V] float32 -> (token ids [R] int64, logprob of each sampled token or None)."""
        raw = logits
        logits = self.masked(logits, md)
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            assert md.temperature is not None
            q = self.noise(logits, md)
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


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, W] int32 bitmask (bit j of word w = token 32 w + j) -> [S, vocab_size] bool."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def top_logprobs(raw: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` most likely ids of each row of the raw logits [R, V] under the raw
    model distribution (what the sampled token's logprob is taken from too):
    (token ids [R, n] int64, logprobs [R, n] float32), most likely first."""
    values, ids = raw.float().log_softmax(dim=-1).topk(n, dim=-1)
    return ids, values
