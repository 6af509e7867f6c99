"""Token embedding and the LM head (optionally tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """``weight`` [num_embeddings, embedding_dim]; ids index rows (ids must be in range)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


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
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tied is not None
        if tied is not None:
            if (tied.num_embeddings, tied.embedding_dim) != (vocab_size, hidden_size):
                raise ValueError(
                    f"cannot tie an LM head of shape {(vocab_size, hidden_size)} to an embedding "
                    f"of shape {(tied.num_embeddings, tied.embedding_dim)}"
                )
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, tied={self.tied}"
