"""What a launched step leaves for :meth:`ModelRunner.finish
<pdserve.runner.model_runner.ModelRunner.finish>`: the pinned host copies of its results
and the handle that ties them to the step's inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.core_types.sampling_params import MAX_LOGPROBS
from pdserve.runner.prompt_logprobs import (
    PromptLogprobsHost,
    PromptLogprobsPlan,
    Scored,
    leading_view,
)
from pdserve.runner.step_inputs import StepInputs


class HostOutputs:
    """Pinned host copies of one step's results (two slots alternate: a step's results
    land in one while the next step is prepared and launched with the other)."""

    def __init__(self, max_reqs: int, width: int, pin: bool) -> None:
        self.tokens = torch.zeros((max_reqs, width), dtype=torch.int64, pin_memory=pin)
        self.num = torch.zeros(max_reqs, dtype=torch.int64, pin_memory=pin)
        self.logprobs = torch.zeros((max_reqs, width), dtype=torch.float32, pin_memory=pin)
        self.drafts = torch.zeros((max_reqs, max(width - 1, 1)), dtype=torch.int64, pin_memory=pin)
        top = (max_reqs, width, MAX_LOGPROBS)
        self.top_ids = torch.zeros(top, dtype=torch.int64, pin_memory=pin)
        self.top_lps = torch.zeros(top, dtype=torch.float32, pin_memory=pin)
        self.pin = pin
        self.prompt: PromptLogprobsHost | None = None  # made at the first prompt_logprobs step

    def prompt_host(self, max_tokens: int) -> PromptLogprobsHost:
        if self.prompt is None:
            self.prompt = PromptLogprobsHost(max_tokens, self.pin)
        return self.prompt


@dataclass
class Copied:
    """Views of one step's results in a :class:`HostOutputs` slot (None: not copied)."""

    tokens: torch.Tensor  # [B, w] accepted tokens
    num: torch.Tensor | None  # [B] accepted counts (None: one each)
    logprobs: torch.Tensor | None  # [B, w]
    drafts: torch.Tensor | None  # [B, k] proposed for the next step
    top: tuple[torch.Tensor, torch.Tensor] | None  # [B, w, N] top ids and logprobs
    prompt: PromptLogprobsHost | None  # prompt logprobs scored this step


def copy_out(
    host: HostOutputs,
    tokens: torch.Tensor,
    num: torch.Tensor | None,
    lp: torch.Tensor | None,
    drafts: torch.Tensor | None,
    top: tuple[torch.Tensor, torch.Tensor] | None,
    scored: Scored | None,
    max_tokens: int,
) -> Copied:
    """Start the non-blocking copies of a step's results into ``host``."""
    n, w = tokens.shape

    def put(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        view = leading_view(dst, src.shape)
        view.copy_(src, non_blocking=True)
        return view

    prompt = None
    if scored is not None:
        prompt = host.prompt_host(max_tokens)
        prompt.copy_from(scored)
    return Copied(
        put(host.tokens, tokens),
        put(host.num, num) if num is not None else None,
        put(host.logprobs, lp) if lp is not None else None,
        put(host.drafts, drafts) if drafts is not None else None,
        (put(host.top_ids, top[0]), put(host.top_lps, top[1])) if top is not None else None,
        prompt,
    )


@dataclass
class StepHandle:
    """A launched step: its inputs, and its results on their way to the host."""

    inp: StepInputs | None  # None for an empty step
    path: str = "eager"
    copied: Copied | None = None
    done_event: torch.cuda.Event | None = None
    prompt_plan: PromptLogprobsPlan | None = None  # prompt_logprobs scored this step
    start_event: torch.cuda.Event | None = None  # recorded before the step's first upload


def ragged(values: np.ndarray, num: np.ndarray | None, samples: np.ndarray) -> list[list]:
    """Row ``i``'s first ``num[i]`` values (all counts 1 when ``num`` is None), [] where
    the request sampled nothing."""
    if num is None:
        return [
            [x] if s else [] for x, s in zip(values[:, 0].tolist(), samples.tolist(), strict=True)
        ]
    return [values[i, : num[i]].tolist() if samples[i] else [] for i in range(len(samples))]
