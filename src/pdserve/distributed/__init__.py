"""Ranks of one instance: process groups, collectives and the DP step agreement.

One instance runs ``data_parallel_size x tensor_parallel_size`` ranks, one process each
(rank ``dp_rank * tp_size + tp_rank``). Layers never look ranks up globally: the model is
built with a :class:`~pdserve.distributed.groups.ParallelGroups` and every parallel layer
keeps the :class:`~pdserve.distributed.groups.Group` it reduces over. A size-1 group's
collectives are the identity, so single-process code runs the same layers unchanged.
"""

from pdserve.distributed.groups import Group, ParallelGroups, RankInfo, init_parallel_groups

__all__ = ["Group", "ParallelGroups", "RankInfo", "init_parallel_groups"]
