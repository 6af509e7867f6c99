"""Sampling parameters of one request, shaped like vLLM's ``SamplingParams``.

The fields' rules live with every other rule of a request in the input processor
(:func:`pdserve.frontend.processor.check_sampling`), which checks an instance once, at
the edge; the engine trusts a checked instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # most alternatives (top logprobs) a request may ask for per token
MAX_N = 64  # most samples (``n``) one request may ask for
MAX_LOGIT_BIAS = 100.0
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly
    one of ``json`` (a JSON schema, as JSON text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of these strings) or ``grammar`` (xgrammar's EBNF).
    JSON is generated compact (no optional whitespace between tokens)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @property
    def kind(self) -> str:
        """The one kind set (``ValueError`` unless exactly one is)."""
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar (got {', '.join(set_kinds) or 'none'})"
            )
        return set_kinds[0]

    def key(self) -> tuple[str, str]:
        """(kind, spec): equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, "\x00".join(self.choice or [])
        return kind, str(getattr(self, kind))


@dataclass
class SamplingParams:
    # independent samples of the prompt; the frontend fans n > 1 out into n engine
    # requests of n=1 (:mod:`pdserve.frontend.parallel`), the engine only takes n=1
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # the sampled token's logprob, plus the top-N alternatives when N > 0 (both under the
    # raw model distribution: before bias, bans, temperature and filters)
    logprobs: int | None = None
    # vLLM's prompt_logprobs: for every prompt position after the first, the actual
    # token's logprob and rank plus the top-N alternatives (raw model distribution); the
    # request then computes its whole prompt (no prefix-cache hits)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # vLLM's penalties: presence / frequency over the output tokens (subtracted from the
    # logits once / once per occurrence), repetition over prompt and output tokens
    # (positive logits divided by it, negative ones multiplied)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None  # every other id is masked out
    # the output is constrained to a grammar (xgrammar; the engine core advances a matcher
    # per request and masks the logits); the request stops when the grammar is complete
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's bad_words: never generate these words; the input processor tokenizes each
    # (as is and after a space) into bad_words_token_ids; a sequence's last token is banned
    # where the output so far ends with the rest of it
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # scheduling priority under --scheduling-policy priority (lower first); must be 0 else
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
