"""Parallel sampling (``n`` > 1): one request of n samples becomes n engine requests.

The engine core only runs requests of one sample each. A request with ``n`` > 1 is fanned
out in the frontend (the API server or the offline ``LLM``) into ``n`` child requests:

- child ``i`` has request id :func:`child_request_id` and the parent's parameters with
  ``n = 1`` and, when the parent has a ``seed``, ``seed + i`` (vLLM's rule): the samples
  differ, and the whole answer is reproducible; without a seed each child draws from the
  engine's generator; greedy children are all equal;
- the children share the prompt's KV through the prefix cache: the first one admitted
  commits its prompt blocks to the cache as it is allocated, and a sibling admitted in
  the same step or later hits them (a block's KV is written, layer by layer, before any
  attention of the step reads it), so the prompt is computed once, less the partial last
  block and the one token every request computes itself;
- only child 0 asks for ``prompt_logprobs`` (they are the prompt's, the same for every
  sample; a request asking for them computes its whole prompt, skipping the cache), so
  its siblings still share its prompt blocks; :func:`merge_outputs` gives them to the
  parent;
- the children are independent engine requests from there on: stop strings, logprobs,
  structured output, penalties, speculative decoding all apply per child; aborting the
  parent aborts each child; their outputs come back as choices ``0 .. n-1``
  (:func:`merge_outputs`).
"""

from __future__ import annotations

import copy

from pdserve.core_types.sampling_params import SamplingParams
from pdserve.frontend.outputs import RequestOutput


def child_request_id(request_id: str, index: int) -> str:
    """The engine request id of sample ``index`` (the parent's id when ``n`` is 1)."""
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s parameters: ``n = 1``, ``seed + index`` when seeded, and
    ``prompt_logprobs`` on sample 0 only."""
    child = copy.copy(params)
    child.n = 1
    if index > 0:
        child.prompt_logprobs = None
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(engine request id, parameters) of each sample; the request itself when n is 1."""
    if params.n == 1:
        return [(request_id, params)]
    return [(child_request_id(request_id, i), child_params(params, i)) for i in range(params.n)]


def merge_outputs(request_id: str, children: list[RequestOutput]) -> RequestOutput:
    """The parent's final output: each child's completion as choice ``i`` (children in
    index order); the prompt's fields (and prompt logprobs) are the first child's."""
    if len(children) == 1:
        return children[0]
    first = children[0]
    outputs = []
    for i, child in enumerate(children):
        comp = copy.copy(child.outputs[0])
        comp.index = i
        outputs.append(comp)
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outputs,
        finished=all(c.finished for c in children),
        num_cached_tokens=first.num_cached_tokens,
        error=next((c.error for c in children if c.error), None),
        prompt_logprobs=first.prompt_logprobs,
    )
