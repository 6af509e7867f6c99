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
