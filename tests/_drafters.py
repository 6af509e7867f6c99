"""Test-only drafters for the speculative step contract (not shipped as methods).

Both know, for every prompt, the target's greedy continuation (measured beforehand
without speculation). :class:`OracleDrafter` proposes that continuation, so every
greedy draft is accepted; :class:`WrongDrafter` proposes a token next to it, so every
draft is rejected. They run on the device like a real drafter (a gather at each
request's next position, no host sync), so they exercise async scheduling too.
"""

from __future__ import annotations

import torch

from pdserve.spec_decode.proposer import DraftBatch


class OracleDrafter:
    def __init__(self, k: int, sequences: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        """``sequences``: prompt -> prompt + its greedy continuation."""
        self.num_speculative_tokens = k
        self.sequences = sequences
        self.vocab = vocab
        self.calls = 0

    def _known(self, batch: DraftBatch) -> torch.Tensor:
        """[B, L] each request's known sequence (-1 padded), from its prompt."""
        seqs = []
        for i, row in enumerate(batch.rows):
            n = int(batch.num_prompt_tokens[i])
            prompt = tuple(int(t) for t in batch.token_table[row, :n])
            seqs.append(self.sequences.get(prompt, list(prompt)))
        width = max(len(s) for s in seqs) + self.num_speculative_tokens + 1
        out = torch.full((len(seqs), width), -1, dtype=torch.int64)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = torch.tensor(s)
        return out.to(batch.sampled.device)

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        self.calls += 1
        known = self._known(batch)
        k = self.num_speculative_tokens
        ar = torch.arange(1, k + 1, device=known.device)
        idx = (batch.next_positions.unsqueeze(1) + ar).clamp(max=known.shape[1] - 1)
        return known.gather(1, idx)


class WrongDrafter(OracleDrafter):
    def propose(self, batch: DraftBatch) -> torch.Tensor:
        right = super().propose(batch)
        return torch.where(right >= 0, (right + 1) % self.vocab, right)
