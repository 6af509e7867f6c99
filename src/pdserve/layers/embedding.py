"""Token embedding and the LM head (optionally tied to it), vocab-parallel under TP.

With a tensor-parallel group of size n, the vocabulary is split in n blocks of
``ceil(V / n)`` rows; rank r holds rows ``[r ceil(V/n), (r+1) ceil(V/n))`` of the table,
the last rank(s) padded with zero rows past V (any V works). The embedding looks up the
ids in its block (others give zeros) and the ranks' rows are summed with one all-reduce;
the LM head computes its block's logits and the blocks are all-gathered (every rank then
holds the same full logits, so all ranks sample the same tokens) and the padding is cut.
A tied head shares the embedding's block. With a size-1 group both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.groups import Group
from pdserve.layers.linear import Entries, Shard


class _VocabBlock:
    """Rank ``tp.rank``'s block of a vocabulary of ``vocab`` ids."""

    def __init__(self, vocab: int, tp: Group) -> None:
        self.vocab = vocab
        self.rows = -(-vocab // tp.size)  # rows held, padding included
        self.start = min(tp.rank * self.rows, vocab)
        self.num_real = min(vocab - self.start, self.rows)  # rows that are real ids

    def shard(self, tp: Group) -> Shard | None:
        return Shard(0, self.start, self.start + self.num_real, self.vocab) if tp.size > 1 else None


def _vocab_weight(rows: int, dim: int, num_real: int, dtype: torch.dtype | None) -> nn.Parameter:
    w = torch.empty(rows, dim, dtype=dtype)
    if num_real < rows:
        w[num_real:].zero_()  # padding rows: never loaded, zero logits (cut) and embeddings
    return nn.Parameter(w, requires_grad=False)


class VocabEmbedding(nn.Module):
    """``weight`` [num_embeddings, embedding_dim] (this rank's block under TP); ids index
    rows (ids must be in range)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        tp: Group | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or Group()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.block = _VocabBlock(num_embeddings, self.tp)
        self.weight = _vocab_weight(self.block.rows, embedding_dim, self.block.num_real, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.block.start
        outside = (local < 0) | (local >= self.block.num_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def tensor_entries(self, prefix: str) -> Entries:
        return {
            prefix + "weight": (self.weight.data[: self.block.num_real], self.block.shard(self.tp))
        }

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.rank}/{self.tp.size}"


class LMHead(nn.Module):
    """Hidden states → logits over the vocabulary, returned in float32.

    With ``tied`` given the head shares that embedding's weight (one tensor, one
    copy) and owns no checkpoint tensor of its own.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        tied: VocabEmbedding | None = None,
        tp: Group | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or Group()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tied is not None
        self.block = _VocabBlock(vocab_size, self.tp)
        if tied is not None:
            if (tied.num_embeddings, tied.embedding_dim) != (vocab_size, hidden_size):
                raise ValueError(
                    f"cannot tie an LM head of shape {(vocab_size, hidden_size)} to an embedding "
                    f"of shape {(tied.num_embeddings, tied.embedding_dim)}"
                )
            if tied.tp.size != self.tp.size or tied.tp.rank != self.tp.rank:
                raise ValueError("a tied LM head must be split like its embedding")
            self.weight = tied.weight
        else:
            self.weight = _vocab_weight(self.block.rows, hidden_size, self.block.num_real, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
            if logits.shape[-1] != self.vocab_size:
                logits = logits[..., : self.vocab_size].contiguous()
        return logits.float()

    def tensor_entries(self, prefix: str) -> Entries:
        return {
            prefix + "weight": (self.weight.data[: self.block.num_real], self.block.shard(self.tp))
        }

    def extra_repr(self) -> str:
        return (
            f"{self.vocab_size}, {self.hidden_size}, tied={self.tied}, "
            f"tp={self.tp.rank}/{self.tp.size}"
        )
