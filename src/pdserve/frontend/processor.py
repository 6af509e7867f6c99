"""Input validation and tokenization: the edge where user input becomes the one typed
request, :class:`~pdserve.core_types.messages.EngineCoreRequest`.

This module holds every rule a request must pass, and is the only place that checks
them; a refusal raises :class:`InvalidRequest` (a ``ValueError``) with a message meant
for the user and the field it is about, before the request reaches the engine, so a bad
request never disturbs the others. The API server's protocol models check the JSON's
shape only (types, unknown fields, which fields go together) and its handlers call the
rules here, at the point of their flow each needs: :meth:`InputProcessor.check_text_length`
before tokenizing, :meth:`InputProcessor.check` once the prompt's ids and the parameters
are known, :meth:`InputProcessor.check_grammar` (blocking) last. The offline ``LLM``
calls the same methods but the last: there a grammar that does not compile fails its
request in the engine (an ``error`` output). Nothing after this point validates user
input again.

The rules of :meth:`InputProcessor.check`, in order (the first broken one is reported):

1. the prompt is not empty; it leaves room for one output token within
   ``max_model_len``; its ids are in the vocabulary;
2. the sampling parameters (:func:`check_sampling`): ``n`` in [1, 64], temperature,
   top-p / top-k / min-p, ``max_tokens`` >= 1, ``min_tokens`` (>= 0, <= ``max_tokens``,
   not with structured output), (prompt) logprobs in [0, 20], logit bias in [-100, 100],
   penalties, ``allowed_token_ids`` not empty, stop strings and bad words not empty,
   the structured-output spec, token ids of ``stop_token_ids`` / ``logit_bias`` /
   ``allowed_token_ids`` in the vocabulary;
3. prompt + ``max_tokens`` fit ``max_model_len``;
4. a ``priority`` only under ``--scheduling-policy priority``; ``bad_words`` not with
   speculative decoding;
5. P/D: ``n`` > 1 not on a prefill leg (``do_remote_decode``), prompt logprobs not on a
   decode leg (``do_remote_prefill``).

A request of ``n`` samples is checked once, then fanned out (``frontend/parallel.py``)
into ``n`` engine requests that :meth:`InputProcessor.build` makes without checking again.

Error ``param`` names: the rules name :class:`SamplingParams`' fields; a caller whose
fields are named otherwise (the chat API's ``top_logprobs``, the Responses API's
``max_output_tokens``) passes ``names`` to map them. The token-id range checks of
``stop_token_ids``, ``logit_bias`` and ``allowed_token_ids`` and ``min_tokens`` >
``max_tokens`` name their field in the message and leave ``param`` empty, as the API has
always answered them.

A text prompt is checked against ``max_model_len`` twice: first without tokenizing it
(:func:`min_token_count`: its characters divided by the most characters one token can
stand for, when the tokenizer has such a bound), so a huge text is refused at once;
then exactly, on its token ids.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pdserve.core_types.grammar import build_grammar
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.messages import EngineCoreRequest
from pdserve.core_types.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    SamplingParams,
    StructuredOutputsParams,
)
from pdserve.frontend.tokenizer import Tokenizer

PromptType = str | dict[str, Any] | list[int]


class InvalidRequest(ValueError):
    """A request the processor refuses (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def min_token_count(tokenizer: Any, text: str) -> int:
    """A lower bound on ``len(tokenizer.encode(text))``, found without encoding: the
    characters of ``text`` divided by the tokenizer's ``max_chars_per_token`` (0 when
    the tokenizer has no such bound)."""
    per_token = getattr(tokenizer, "max_chars_per_token", None)
    if not isinstance(per_token, int) or per_token < 1:
        return 0
    return -(-len(text) // per_token)


def too_long_text_message(text: str, min_tokens: int, max_model_len: int) -> str:
    """What to tell a user whose text is refused by :func:`min_token_count`."""
    return (
        f"This model's maximum context length is {max_model_len} tokens, but the prompt "
        f"has {len(text)} characters, which is at least {min_tokens} tokens for this "
        "tokenizer. Please reduce the length of the prompt."
    )


def _out_of_vocab(ids: list[int], vocab_size: int) -> list[int]:
    return [t for t in ids if not 0 <= t < vocab_size]


def check_structured_spec(spec: StructuredOutputsParams, param: str) -> None:
    """Exactly one constraint kind, and a ``choice`` of non-empty strings."""
    # the vLLM field names its parts (structured_outputs.choice); the older aliases
    # (guided_choice, ...) are the part itself
    part = "structured_outputs." if param == "structured_outputs" else ""
    try:
        kind = spec.kind
    except ValueError as e:
        raise InvalidRequest(str(e), param) from None
    if kind == "choice" and (not spec.choice or any(not c for c in spec.choice)):
        raise InvalidRequest(f"{part}choice must be a list of non-empty strings", param)


def check_sampling(
    params: SamplingParams,
    vocab_size: int | None = None,
    names: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`InvalidRequest` for the first invalid sampling field (``names``:
    the caller's name of a field, where it differs)."""
    named = names or {}

    def bad(message: str, field: str | None) -> InvalidRequest:
        return InvalidRequest(message, named.get(field, field) if field else None)

    p = params
    if not 1 <= p.n <= MAX_N:
        raise bad(f"n must be in [1, {MAX_N}], got {p.n}", "n")
    if not (p.temperature >= 0.0):
        raise bad(f"temperature must be >= 0, got {p.temperature}", "temperature")
    if not (0.0 < p.top_p <= 1.0):
        raise bad(f"top_p must be in (0, 1], got {p.top_p}", "top_p")
    if p.top_k < 0:
        raise bad(f"top_k must be 0 or -1 (disabled) or positive, got {p.top_k}", "top_k")
    if not (0.0 <= p.min_p <= 1.0):
        raise bad(f"min_p must be in [0, 1], got {p.min_p}", "min_p")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {p.max_tokens}", "max_tokens")
    if p.min_tokens < 0:
        raise bad(f"min_tokens must be >= 0, got {p.min_tokens}", "min_tokens")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise bad(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})", None)
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}", "logprobs")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_LOGPROBS:
        raise bad(
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}",
            "prompt_logprobs",
        )
    for tid, bias in (p.logit_bias or {}).items():
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {bias} for token {tid}",
                "logit_bias",
            )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -2.0 <= value <= 2.0:
            raise bad(f"{name} must be in [-2, 2], got {value}", name)
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise bad(
            f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}",
            "repetition_penalty",
        )
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        raise bad("allowed_token_ids must not be empty", "allowed_token_ids")
    if p.structured_outputs is not None:
        check_structured_spec(
            p.structured_outputs, named.get("structured_outputs", "structured_outputs")
        )
        if p.min_tokens:
            raise bad(
                "min_tokens cannot be combined with structured output: the grammar "
                "decides where the output ends",
                None,
            )
    if p.bad_words is not None and any(not w.strip() for w in p.bad_words):
        raise bad("bad_words must be non-empty words", "bad_words")
    if any(not isinstance(s, str) or not s for s in p.stop):
        raise bad("stop strings must be non-empty", "stop")
    if vocab_size is None:
        return
    out = _out_of_vocab(p.stop_token_ids, vocab_size)
    if out:
        raise bad(f"stop_token_ids {out} are outside the vocabulary [0, {vocab_size})", None)
    for name, ids in (
        ("logit_bias", list(p.logit_bias or {})),
        ("allowed_token_ids", p.allowed_token_ids or []),
    ):
        out = _out_of_vocab(ids, vocab_size)
        if out:
            raise bad(
                f"{name} token ids {out[:5]} are outside the vocabulary [0, {vocab_size})", None
            )


class InputProcessor:
    """The rules of one model's requests (see the module docstring) and the engine
    requests they become."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        speculative: bool = False,
        priority_scheduling: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.speculative = speculative
        self.priority_scheduling = priority_scheduling
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise InvalidRequest(
                f"a prompt must be a string, a token id list or a dict, got {type(prompt).__name__}"
            )
        if ids is None:
            if not isinstance(text, str) or not text:
                raise InvalidRequest("the prompt is empty", "prompt")
            self.check_text_length(text)
            ids = self.tokenizer.encode(text)
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidRequest("prompt_token_ids must be a list of integers", "prompt")
        return text, ids

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """Refuse a text that cannot fit ``max_model_len`` without tokenizing it."""
        low = min_token_count(self.tokenizer, text)
        if low >= self.max_model_len:
            raise InvalidRequest(too_long_text_message(text, low, self.max_model_len), param)

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Every id in the vocabulary."""
        out = _out_of_vocab(ids, self.vocab_size)
        if out:
            shown = ", ".join(str(t) for t in out[:5])
            raise InvalidRequest(
                f"token ids outside the vocabulary [0, {self.vocab_size}): {shown}"
                + (f" and {len(out) - 5} more" if len(out) > 5 else ""),
                param,
            )

    def check(
        self,
        ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        *,
        names: Mapping[str, str] | None = None,
    ) -> None:
        """Every rule of one request of ``params.n`` samples (the module docstring's
        list, in its order); ``names`` maps a field to the caller's name of it (the
        prompt's too: ``"prompt"``)."""
        named = names or {}
        prompt = named.get("prompt", "prompt")
        limit = self.max_model_len
        if not ids:
            raise InvalidRequest("the prompt is empty (it has no tokens)", prompt)
        if len(ids) >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, but the "
                f"prompt has {len(ids)} tokens, leaving no room to generate. "
                "Please reduce the length of the prompt.",
                prompt,
            )
        self.check_token_ids(ids, prompt)
        check_sampling(params, self.vocab_size, named)
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the length of the "
                "prompt or the number of completion tokens.",
                named.get("max_tokens", "max_tokens"),
            )
        if params.priority != 0 and not self.priority_scheduling:
            raise InvalidRequest(
                f"priority={params.priority} needs a server started with --scheduling-policy "
                "priority (this one schedules first come, first served)",
                "priority",
            )
        if params.bad_words and self.speculative:
            raise InvalidRequest(
                "bad_words with speculative decoding are not supported yet", "bad_words"
            )
        self._check_pd(params, kv_transfer_params, named)

    @staticmethod
    def _check_pd(
        params: SamplingParams, kv: KVTransferParams | None, named: Mapping[str, str]
    ) -> None:
        """What P/D cannot do: ``n`` > 1 on a prefill leg (the instance holds one
        prompt's KV for one decode), prompt logprobs on a decode leg (the prompt's KV is
        pulled, its logits never computed)."""
        if kv is None:
            return
        if params.n > 1 and kv.do_remote_decode:
            raise InvalidRequest(
                f"n={params.n} cannot be combined with kv_transfer_params do_remote_decode: a "
                "prefill leg computes the prompt once for one decode (the P/D proxy sends it "
                "with n=1 and the decode leg draws the n samples)",
                named.get("n", "n"),
            )
        if params.prompt_logprobs is not None and kv.do_remote_prefill:
            param = named.get("prompt_logprobs", "prompt_logprobs")
            asked = "prompt_logprobs" if param == "prompt_logprobs" else "echo=true with logprobs"
            raise InvalidRequest(
                f"{asked} cannot be combined with kv_transfer_params do_remote_prefill: "
                "the prompt's KV comes from a prefill instance, so this instance never "
                "computes the prompt's logits",
                param,
            )

    @staticmethod
    def check_grammar(spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Blocking (the first call imports xgrammar): the spec's grammar builds, or
        :class:`InvalidRequest` naming ``param``."""
        check_structured_spec(spec, param)
        try:
            build_grammar(spec)
        except ValueError as e:
            raise InvalidRequest(str(e), param) from None

    def bad_word_sequences(self, words: list[str]) -> list[list[int]]:
        """The token sequences of ``words`` as vLLM bans them: each word as given (its
        leading spaces dropped) and after one space, when the two differ."""
        seqs: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()  # (a set: linear in the words, not quadratic)
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and tuple(ids) not in seen:
                    seen.add(tuple(ids))
                    seqs.append(ids)
        return seqs

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | dict | None = None,
    ) -> EngineCoreRequest:
        """Tokenize, check and build a request of one sample."""
        text, ids = self.tokenize(prompt)
        return self.make_request(request_id, ids, params, kv_transfer_params)

    def make_request(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | dict | None = None,
    ) -> EngineCoreRequest:
        """Check (:meth:`check`) and build (:meth:`build`) a request of one sample."""
        kv = self.parse_kv(kv_transfer_params)
        self.check(ids, params, kv)
        return self.build(request_id, ids, params, kv)

    @staticmethod
    def parse_kv(raw: KVTransferParams | dict | None) -> KVTransferParams | None:
        """Typed ``kv_transfer_params`` (:class:`InvalidRequest` when malformed)."""
        if raw is None:
            return None
        try:
            return KVTransferParams.parse(raw)
        except ValueError as e:
            raise InvalidRequest(str(e), "kv_transfer_params") from None

    def build(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> EngineCoreRequest:
        """The engine request of one sample of a request :meth:`check` passed (a fanned-
        out child: ``n`` is 1); checks nothing again."""
        if params.n != 1:
            raise AssertionError(
                f"n={params.n}: an engine request is one sample; fan n > 1 out into n "
                "requests first (pdserve.frontend.parallel)"
            )
        if params.bad_words:
            params.bad_words_token_ids = self.bad_word_sequences(params.bad_words)
        room = self.max_model_len - len(ids)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(ids),
            sampling_params=params,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            max_output_tokens=params.max_tokens if params.max_tokens is not None else room,
            arrival_time=time.monotonic(),
            kv_transfer_params=kv_transfer_params,
        )
