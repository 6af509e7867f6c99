"""A completion choice's ``logprobs`` (OpenAI's legacy shape), the echoed prompt's included.

``logprobs=N``: for each token its text (``tokens``, special tokens kept), its logprob
(``token_logprobs``, JSON-safe) and, with N > 0, ``top_logprobs``: token text -> logprob
of the N most likely tokens at that position plus the token itself (as OpenAI and vLLM
return it); N = 0 leaves ``top_logprobs`` out. ``text_offset``: where each token starts,
the sum of the lengths of the token texts before it in the choice; it continues across
stream deltas, and from the echoed prompt into the completion.

``echo=true`` with ``logprobs=N``: the choice's logprobs cover the prompt's tokens, then
the generated ones. The prompt's come from the engine's prompt logprobs (the request
asks for them with at least N alternatives, :meth:`CompletionRequest.to_sampling_params`):
the first prompt token has none (``null`` in ``token_logprobs`` and ``top_logprobs``),
each other its actual logprob and the N most likely tokens of its position (ranks 1..N)
plus itself. They are rendered once per request (:func:`echoed_prompt`) and lead every
choice's logprobs (all choices of ``n`` > 1 echo the same prompt), in the stream with the
choice's first chunk. A client's own ``prompt_logprobs=K`` smaller than N still gets K
alternatives in the choice's ``prompt_logprobs`` (:func:`trimmed`).
"""

from __future__ import annotations

from typing import Any

from pdserve.frontend.outputs import PromptLogprobList
from pdserve.serving.api.generate import safe_logprob
from pdserve.serving.api.protocol import CompletionLogProbs


class TokenNames:
    """Token id -> the token's text in logprobs (special tokens kept), each id decoded
    once (a long echoed prompt repeats ids, and so do its alternatives)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._names[token_id] = name
        return name


def _offsets(tokens: list[str], start: int) -> list[int]:
    out = []
    for t in tokens:
        out.append(start)
        start += len(t)
    return out


def _text_len(lp: CompletionLogProbs) -> int:
    return sum(len(t) for t in lp.tokens)


class LogprobsBuilder:
    """One choice's logprobs, delta by delta (``text_offset`` carries on)."""

    def __init__(self, names: TokenNames) -> None:
        self._names = names
        self._offset = 0

    def build(
        self,
        token_ids: list[int],
        logprobs: list[float],
        top: list[dict[int, float]] | None = None,
        lead: CompletionLogProbs | None = None,
    ) -> CompletionLogProbs:
        """The logprobs of these sampled tokens (``top``: each one's alternatives, when
        N > 0), after ``lead`` (the echoed prompt's, in the choice's first delta)."""
        if lead is not None:
            self._offset += _text_len(lead)
        tokens = [self._names(t) for t in token_ids]
        values = [safe_logprob(v) for v in logprobs]
        offsets = _offsets(tokens, self._offset)
        self._offset += sum(len(t) for t in tokens)
        top_lps: list[dict[str, float] | None] | None = None
        if top is not None:
            top_lps = []
            for tok, value, alts in zip(tokens, values, top, strict=False):
                entry = {self._names(t): safe_logprob(v) for t, v in alts.items()}
                entry.setdefault(tok, value)
                top_lps.append(entry)
        own = CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=list(values),
            tokens=tokens,
            top_logprobs=top_lps,
        )
        return own if lead is None else _joined(lead, own)


def _joined(a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
    top: list[dict[str, float] | None] | None = None
    if a.top_logprobs is not None or b.top_logprobs is not None:
        top = [*(a.top_logprobs or [None] * len(a.tokens))]
        top += b.top_logprobs or [None] * len(b.tokens)
    return CompletionLogProbs(
        text_offset=[*a.text_offset, *b.text_offset],
        token_logprobs=[*a.token_logprobs, *b.token_logprobs],
        tokens=[*a.tokens, *b.tokens],
        top_logprobs=top,
    )


def echoed_prompt(
    names: TokenNames, prompt_ids: list[int], plp: PromptLogprobList | None, top_n: int
) -> CompletionLogProbs:
    """The echoed prompt's logprobs (see the module docstring), offsets from 0. A
    position the engine gave no logprobs for (the first; all of them when the request
    ended before its first token) is ``null``."""
    tokens = [names(t) for t in prompt_ids]
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for j, tid in enumerate(prompt_ids):
        entry = plp[j] if plp is not None and j < len(plp) else None
        actual = entry.get(tid) if entry is not None else None
        if entry is None or actual is None:
            values.append(None)
            tops.append(None)
            continue
        value = safe_logprob(actual.logprob)
        values.append(value)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank)
        row = {names(t): safe_logprob(v) for rank, t, v in ranked if rank <= top_n}
        row.setdefault(tokens[j], value)
        tops.append(row)
    return CompletionLogProbs(
        text_offset=_offsets(tokens, 0),
        token_logprobs=values,
        tokens=tokens,
        top_logprobs=tops if top_n > 0 else None,
    )


def trimmed(plp: PromptLogprobList | None, k: int) -> PromptLogprobList | None:
    """``plp`` with each position's actual token and its alternatives of rank <= ``k``
    only (the engine computed more for an echo with ``logprobs`` > ``k``)."""
    if plp is None:
        return None
    out: PromptLogprobList = []
    for entry in plp:
        if entry is None:
            out.append(None)
            continue
        items = iter(entry.items())  # the actual token first, then the top N by rank
        row = dict([next(items)])
        row.update((t, lp) for t, lp in items if lp.rank is not None and lp.rank <= k)
        out.append(row)
    return out
