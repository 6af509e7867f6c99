"""What a launched step leaves for :meth:`ModelRunner.finish
<pdserve.runner.model_runner.ModelRunner.finish>`: the pinned host copies of its results
and the handle that ties them to the step's inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.core_types.sampling_params import MAX_LOGPROBS
from pdserve.runner.prompt_logprobs import PromptLogprobsHost, PromptLogprobsPlan, Scored
from pdserve.runner.step_inputs import InFlight, StepInputs


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
class Forwarded:
    """A step whose forward is enqueued and whose sampling is not (yet): what
    :meth:`ModelRunner.complete <pdserve.runner.model_runner.ModelRunner.complete>` needs."""

    inp: StepInputs
    hidden: torch.Tensor
    logits: torch.Tensor
    path: str
    prompt_plan: PromptLogprobsPlan | None
    scored: Scored | None


@dataclass
class StepHandle:
    """A launched step: its inputs, and its results on their way to the host."""

    inp: StepInputs | None  # None for an empty step
    path: str = "eager"
    host: HostOutputs | None = None
    width: int = 1  # accepted tokens per request at most (1 + drafts)
    has_num: bool = False
    has_logprobs: bool = False
    has_drafts: bool = False
    num_top: int = 0  # top logprobs per token copied to the host
    done_event: torch.cuda.Event | None = None
    flight: InFlight | None = None
    prompt_plan: PromptLogprobsPlan | None = None  # prompt_logprobs scored this step


def ragged(values: np.ndarray, num: np.ndarray | None, samples: np.ndarray) -> list[list]:
    """Row ``i``'s first ``num[i]`` values (all counts 1 when ``num`` is None), [] where
    the request sampled nothing."""
    if num is None:
        return [
            [x] if s else [] for x, s in zip(values[:, 0].tolist(), samples.tolist(), strict=True)
        ]
    return [values[i, : num[i]].tolist() if samples[i] else [] for i in range(len(samples))]
