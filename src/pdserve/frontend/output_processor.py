"""Turns engine-core token outputs into user outputs: detokenization and stop strings.

Runs in the frontend (the offline ``LLM`` or the API server), never in the engine
core. One ``RequestState`` per live request, removed when the request finishes; a
stop string ends a request here, and the caller must then abort it in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.scheduler_output import EngineCoreOutput, PromptLogprobs
from pdserve.frontend.outputs import CompletionOutput, Logprob, PromptLogprobList, RequestOutput
from pdserve.frontend.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (leading-space handling)


class IncrementalDetokenizer:
    """Decodes a growing token list, emitting text only once it is stable (no partial UTF-8)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special: bool) -> None:
        self.tok = tokenizer
        self.skip = skip_special
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip
        )
        full = self.tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    text: str = ""
    sent_text: int = 0  # chars of ``text`` already emitted (delta mode)
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobList | None = None
    sent_prompt_logprobs: bool = False  # delta mode: they went out with an output

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(self.logprobs) if self.logprobs is not None else None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.states[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
            top_logprobs=[] if params.logprobs else None,
        )

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(
        self, outputs: list[EngineCoreOutput], delta: bool
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the user outputs and the ids a stop string finished (to abort in the engine)."""
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for eo in outputs:
            st = self.states.get(eo.request_id)
            if st is None:
                continue
            st.num_cached_tokens = eo.num_cached_tokens
            if eo.prompt_logprobs is not None:
                st.prompt_logprobs = prompt_logprob_list(st.prompt_token_ids, eo.prompt_logprobs)
            if eo.new_token_ids and self._add_tokens(st, eo):
                stopped.append(st.request_id)
            if st.finish_reason is None and eo.finish_reason is not None:
                st.finish_reason = eo.finish_reason
                st.stop_reason = eo.stop_reason
            results.append(self._make_output(st, delta, eo.error, eo.kv_transfer_params))
            if st.finish_reason is not None:
                del self.states[st.request_id]
        return results, stopped

    def _add_tokens(self, st: RequestState, eo: EngineCoreOutput) -> bool:
        """Append a step's tokens (several after a speculative verify) and their text;
        True when a stop string ended the request. With stop strings the tokens go in
        one at a time, so none after the one that completed the string is kept."""
        ids, lps = eo.new_token_ids, eo.new_logprobs
        chunks = [ids] if not st.params.stop or len(ids) == 1 else [[t] for t in ids]
        taken = 0
        for j, chunk in enumerate(chunks):
            st.token_ids.extend(chunk)
            if st.logprobs is not None and lps:
                st.logprobs.extend(lps[taken : taken + len(chunk)])
            if st.top_logprobs is not None and eo.new_top_token_ids and eo.new_top_logprobs:
                end = taken + len(chunk)
                st.top_logprobs.extend(
                    dict(zip(ids_, lps_, strict=True))
                    for ids_, lps_ in zip(
                        eo.new_top_token_ids[taken:end], eo.new_top_logprobs[taken:end], strict=True
                    )
                )
            taken += len(chunk)
            new_text = st.detok.add(chunk)
            st.text += new_text
            # the engine's own finish on the last token stands; a stop string before it wins
            may_stop = j < len(chunks) - 1 or eo.finish_reason is None
            if may_stop and self._check_stop_strings(st, len(new_text)):
                return True
        return False

    def _check_stop_strings(self, st: RequestState, new_len: int) -> bool:
        stops = st.params.stop
        if not stops or not new_len:
            return False
        longest = max(len(s) for s in stops)
        start = max(0, len(st.text) - new_len - longest + 1)
        best = None
        for s in stops:
            i = st.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        st.text = st.text[: i + len(s)] if st.params.include_stop_str_in_output else st.text[:i]
        st.finish_reason = "stop"
        st.stop_reason = s
        return True

    def _make_output(
        self, st: RequestState, delta: bool, error: str | None, kv_params: KVTransferParams | None
    ) -> RequestOutput:
        finished = st.finish_reason is not None
        if delta:
            # hold back text that could be the start of a stop string
            hold = 0 if finished or not st.params.stop else max(len(s) for s in st.params.stop) - 1
            end = max(st.sent_text, len(st.text) - hold)
            text = st.text[st.sent_text : end]
            ids = st.token_ids[st.sent_tokens :]
            lps = st.logprobs[st.sent_tokens :] if st.logprobs is not None else None
            tops = st.top_logprobs[st.sent_tokens :] if st.top_logprobs is not None else None
            st.sent_text, st.sent_tokens = end, len(st.token_ids)
        else:
            text, ids = st.text, list(st.token_ids)
            lps = list(st.logprobs) if st.logprobs is not None else None
            tops = list(st.top_logprobs) if st.top_logprobs is not None else None
        prompt_lps = st.prompt_logprobs
        if delta and prompt_lps is not None:
            prompt_lps = None if st.sent_prompt_logprobs else prompt_lps
            st.sent_prompt_logprobs = True
        comp = CompletionOutput(
            index=0,
            text=text,
            token_ids=ids,
            cumulative_logprob=st.cumulative_logprob,
            logprobs=lps,
            top_logprobs=tops,
            finish_reason=st.finish_reason,
            stop_reason=st.stop_reason,
        )
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=[comp],
            finished=finished,
            num_cached_tokens=st.num_cached_tokens,
            error=error,
            kv_transfer_params=kv_params,
            prompt_logprobs=prompt_lps,
        )


def prompt_logprob_list(prompt_ids: list[int], plp: PromptLogprobs) -> PromptLogprobList:
    """vLLM's prompt_logprobs list of the engine's arrays: None for the first token, then
    per position the actual token (its logprob and rank) and the top-N (ranks 1..N)."""
    out: PromptLogprobList = [None]
    for j, (lp, rank, ids, lps) in enumerate(
        zip(plp.logprobs, plp.ranks, plp.top_ids, plp.top_logprobs, strict=True)
    ):
        entry = {prompt_ids[j + 1]: Logprob(lp, rank)}
        for r, (tid, value) in enumerate(zip(ids, lps, strict=True)):
            entry.setdefault(tid, Logprob(value, r + 1))
        out.append(entry)
    return out
