"""Input validation and tokenization: the edge where user input becomes the one typed
request, :class:`~pdserve.core_types.messages.EngineCoreRequest`.

Everything invalid raises ``ValueError`` with a message meant for the user, before the
request reaches the engine, so a bad request never disturbs the others. Nothing after
this point validates user input again.

A text prompt is checked against ``max_model_len`` twice: first without tokenizing it
(:func:`min_token_count`: its characters divided by the most characters one token can
stand for, when the tokenizer has such a bound), so a huge text is refused at once;
then exactly, on its token ids.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.messages import EngineCoreRequest
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.frontend.tokenizer import Tokenizer

PromptType = str | dict[str, Any] | list[int]


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


class InputProcessor:
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
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise ValueError(
                f"a prompt must be a string, a token id list or a dict, got {type(prompt).__name__}"
            )
        if ids is None:
            if not isinstance(text, str) or not text:
                raise ValueError("the prompt is empty")
            self.check_text_length(text)
            ids = self.tokenizer.encode(text)
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError("prompt_token_ids must be a list of integers")
        return text, ids

    def check_text_length(self, text: str) -> None:
        """Refuse a text that cannot fit ``max_model_len`` without tokenizing it."""
        low = min_token_count(self.tokenizer, text)
        if low >= self.max_model_len:
            raise ValueError(too_long_text_message(text, low, self.max_model_len))

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"it must be shorter, to leave room for at least one output token"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )

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
        text, ids = self.tokenize(prompt)
        return self.make_request(request_id, ids, params, kv_transfer_params)

    def make_request(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | dict | None = None,
    ) -> EngineCoreRequest:
        self.check_prompt(ids)
        params.verify(self.vocab_size)
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: an engine request is one sample; fan n > 1 out into n "
                "requests first (pdserve.frontend.parallel)"
            )
        kv = KVTransferParams.parse(kv_transfer_params) if kv_transfer_params is not None else None
        if params.prompt_logprobs is not None and kv is not None and kv.do_remote_prefill:
            raise ValueError(
                "prompt_logprobs cannot be combined with kv_transfer_params do_remote_prefill: "
                "the prompt's KV comes from a prefill instance, so this instance never "
                "computes the prompt's logits"
            )
        if params.priority != 0 and not self.priority_scheduling:
            raise ValueError(
                f"priority={params.priority} needs a server started with "
                "--scheduling-policy priority"
            )
        if params.bad_words:
            if self.speculative:
                raise ValueError("bad_words with speculative decoding are not supported yet")
            params.bad_words_token_ids = self.bad_word_sequences(params.bad_words)
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) plus the prompt's {len(ids)} tokens exceed "
                f"max_model_len ({self.max_model_len})"
            )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(ids),
            sampling_params=params,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            max_output_tokens=params.max_tokens if params.max_tokens is not None else room,
            arrival_time=time.monotonic(),
            kv_transfer_params=kv,
        )
