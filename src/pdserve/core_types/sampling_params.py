"""Sampling parameters of one request, shaped like vLLM's ``SamplingParams``.

Validation happens once, at the edge (``verify``), and raises ``ValueError`` with
a message that names the field; the engine trusts a verified instance.
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
        """The one kind set (``verify`` ensures there is exactly one)."""
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

    def verify(self) -> None:
        kind = self.kind
        if kind == "choice" and (not self.choice or any(not c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")


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

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for tid, bias in (self.logit_bias or {}).items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {tid}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.structured_outputs is not None:
            self.structured_outputs.verify()
            if self.min_tokens:
                raise ValueError(
                    "min_tokens cannot be combined with structured output: the grammar "
                    "decides where the output ends"
                )
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty words")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
                )
            for name, ids in (
                ("logit_bias", list(self.logit_bias or {})),
                ("allowed_token_ids", self.allowed_token_ids or []),
            ):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(
                        f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
                    )
