"""Chained block hashes for prefix caching.

``hash(block i) = H(hash(block i-1) || tokens of block i || extra)``: equal hashes mean
equal full token prefixes (up to a 128-bit collision). Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_ROOT = b"pdserve-kv-root"


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else _ROOT)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], tokens: Sequence[int], block_size: int, num_tokens: int
) -> None:
    """Append hashes for every full block of ``tokens[:num_tokens]`` not hashed yet."""
    full = num_tokens // block_size
    for i in range(len(hashes), full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, tokens[i * block_size : (i + 1) * block_size]))
