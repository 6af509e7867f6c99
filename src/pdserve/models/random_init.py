"""Random weights by name, the one rule every random checkpoint follows.

``pdserve make-checkpoint`` writes these values to safetensors, and ``--load-format
dummy`` draws the same values straight into a model on its device (no file): for a
given seed, device and dtype the two agree tensor for tensor, since both draw from one
generator in the model's :meth:`~pdserve.models.registry.CausalLM.checkpoint_tensors`
order. Each tensor is drawn from normal(mean, std), with (mean, std) looked up by name
suffix in :data:`INIT_RULES` (the longest matching suffix wins).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are drawn: make-checkpoint's flags need none
    import torch

    from pdserve.models.hf_config import HFModelConfig

INIT_STD = 0.02
NORM_NOISE = 0.05

INIT_RULES: dict[str, tuple[float, float]] = {
    "norm.weight": (1.0, NORM_NOISE),  # RMSNorm/LayerNorm gains: near 1
    # MoE routing bias: zeros in HF's init, random here so tests exercise it
    "e_score_correction_bias": (0.0, INIT_STD),
}
DEFAULT_INIT = (0.0, INIT_STD)


def init_rule(name: str) -> tuple[float, float]:
    """(mean, std) of the normal the tensor ``name`` is drawn from (see :data:`INIT_RULES`)."""
    matches = [suffix for suffix in INIT_RULES if name.endswith(suffix)]
    return INIT_RULES[max(matches, key=len)] if matches else DEFAULT_INIT


def random_tensors(
    names: Iterable[str],
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    gen: torch.Generator,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Draw each named tensor (shape and dtype from ``specs``) on ``device``, in order."""
    import torch

    for name in names:
        shape, dtype = specs[name]
        mean, std = init_rule(name)
        t = torch.empty(shape, dtype=dtype, device=device)
        t.normal_(mean, std, generator=gen)
        yield name, t


def full_checkpoint_specs(
    config: HFModelConfig, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor a complete checkpoint of ``config`` holds, in
    generation order: the registry's model built on the meta device (nothing allocated),
    with its MTP layers when the config has them (``num_nextn_predict_layers``)."""
    import torch

    from pdserve.models.registry import get_model_class

    options = {"with_mtp": True} if config.raw.get("num_nextn_predict_layers") else {}
    with torch.device("meta"):
        model = get_model_class(config)(config, dtype, **options)
    return model.checkpoint_tensors()
