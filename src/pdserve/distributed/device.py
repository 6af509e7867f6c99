"""Which device a rank of a multi-rank instance runs on.

Rank ``r`` of an instance (``r = dp_rank * tp_size + tp_rank``) runs on ``cuda:r`` of the
devices this process sees (the launcher sets ``CUDA_VISIBLE_DEVICES`` from the instance's
``devices``), or on the CPU. A single-rank instance keeps ``--device`` as given.
"""

from __future__ import annotations

import torch

from pdserve.distributed.groups import RankInfo


def rank_device(name: str, info: RankInfo) -> torch.device:
    """The device of rank ``info`` for ``--device name`` (auto | cpu | cuda | cuda:N)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but no CUDA GPU is available")
    if dev.type != "cuda" or info.world_size == 1:
        return dev
    if dev.index is not None:
        raise ValueError(
            f"--device {name} names one GPU, but this instance has {info.world_size} ranks; "
            "use --device cuda (rank r runs on cuda:r of the visible devices)"
        )
    visible = torch.cuda.device_count()
    if visible < info.world_size:
        raise ValueError(
            f"this instance has {info.world_size} ranks (one GPU each) but only {visible} "
            "GPU(s) are visible (CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", info.rank)
