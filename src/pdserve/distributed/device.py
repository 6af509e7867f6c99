"""Which device a rank of a multi-rank instance runs on.

Rank ``r`` of an instance (``r = dp_rank * tp_size + tp_rank``) runs on
``cuda:<base + r>`` of the devices this process sees (the launcher sets
``CUDA_VISIBLE_DEVICES`` from the instance's ``devices``; ``--device cuda`` or ``auto``
with a GPU: base 0, ``--device cuda:N``: base N), or on the CPU. A single-rank instance
keeps ``--device`` as given.
"""

from __future__ import annotations

import torch

from pdserve.distributed.groups import RankInfo


def rank_device(name: str, info: RankInfo) -> torch.device:
    """The device of rank ``info`` for ``--device name`` (auto | cpu | cuda | cuda:N)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    visible = torch.cuda.device_count() if dev.type == "cuda" else 0
    if dev.type == "cuda" and not visible:
        raise ValueError(f"--device {name} was asked for but no CUDA GPU is available")
    if dev.type != "cuda" or info.world_size == 1:
        return dev
    base, n = dev.index or 0, info.world_size
    if base + n > visible:
        raise ValueError(
            f"this instance has {n} ranks, one GPU each (cuda:{base}..cuda:{base + n - 1} from "
            f"--device {name}), but {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", base + info.rank)
