"""What ends a request, checked token by token over the tokens a step accepted.

A token is appended, then: EOS (unless ``ignore_eos``) or a stop token id, once
``min_tokens`` are out, stops the request; so does reaching ``max_tokens`` or
``max_model_len``. Tokens a verify accepted after the stop are dropped. A request with a
grammar then feeds what it kept to its matcher: the grammar's end stops it (later
tokens dropped), a token the grammar refuses fails it.
"""

from __future__ import annotations

from pdserve.engine.request import Request, RequestStatus


def take_tokens(
    req: Request, new: list[int], max_model_len: int
) -> tuple[RequestStatus | None, int]:
    """Append ``new`` (a step's accepted tokens) to ``req`` up to its stop. Returns (its
    finished status or None, how many tokens it kept)."""
    status = None
    taken = 0
    for tok in new:
        req.output_token_ids.append(tok)
        taken += 1
        status = stop_status(req, tok, max_model_len)
        if status is not None:
            break
    if req.grammar is not None and status != RequestStatus.FINISHED_ERROR:
        status, taken = advance_grammar(req, new[:taken], status)
    return status, taken


def stop_status(req: Request, tok: int, max_model_len: int) -> RequestStatus | None:
    """Whether ``req`` ends on ``tok``, its latest output token."""
    sp = req.sampling_params
    if req.num_output_tokens >= sp.min_tokens:
        if not sp.ignore_eos and tok in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if tok in sp.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_output_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def advance_grammar(
    req: Request, tokens: list[int], status: RequestStatus | None
) -> tuple[RequestStatus | None, int]:
    """Feed the kept tokens to ``req``'s matcher: it stops once the grammar terminates
    (tokens a verify accepted after that are dropped); a token the grammar refuses (only
    possible when every allowed token was masked out, e.g. by min_tokens' bans) fails
    the request. Returns (status, tokens kept)."""
    assert req.grammar is not None
    used, ok = req.grammar.accept_run(tokens)
    del req.output_token_ids[len(req.output_token_ids) - len(tokens) + used :]
    if not ok:
        req.error = f"token {tokens[used - 1]} does not fit the request's structured output grammar"
        return RequestStatus.FINISHED_ERROR, used
    if status is None and req.grammar.terminated:
        return RequestStatus.FINISHED_STOPPED, used
    return status, used
