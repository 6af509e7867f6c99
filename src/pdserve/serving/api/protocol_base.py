"""The bases of the API's pydantic models and the 400 error they raise.

Requests forbid unknown fields and non-finite numbers (``StrictModel``); a top-level
request body first refuses a lone UTF-16 surrogate in any string, naming the field
(``CheckedModel``, :mod:`pdserve.serving.api.unicode_check`). Responses allow extra
fields (``ResponseModel``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from pdserve.frontend.processor import InvalidRequest
from pdserve.serving.api.unicode_check import find_lone_surrogate, lone_surrogate_message

# Invalid user input; becomes HTTP 400, ``param`` naming the offending field. One class
# for the shape errors raised here and the rule errors of the input processor.
RequestError = InvalidRequest


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CheckedModel(StrictModel):
    """A top-level request body: refuses lone surrogates anywhere in it, first."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        hit = find_lone_surrogate(data)
        if hit is not None:
            raise RequestError(lone_surrogate_message(*hit), hit[0])
        return data


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokenUsageInfo(ResponseModel):
    cached_tokens: int | None = None


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class PromptLogprob(ResponseModel):
    """vLLM's ``Logprob`` of one token at a prompt position (rank 1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None for the first, else token id -> Logprob
PromptLogprobs = list[dict[str, PromptLogprob] | None]
