"""In-flight accounting: the tokens of a step that is launched but has not landed.

``depth`` is how many steps are in flight when the next one is scheduled: 0 under
synchronous scheduling, 1 under asynchronous scheduling. A request that samples in a
step counts that step's tokens (its drafts plus one) as ``num_output_placeholders``
times ``depth`` until the step lands, so at depth 0 every count here is 0 and every
rule below is inert; the scheduler calls them the same way at either depth.

While tokens of a request are in flight the next step is scheduled on them (a decode
computes one token past them, its drafts are ``-1`` placeholders the device fills),
except where that step could not be used: the tokens in flight already reach the
request's length limit (it finishes when they land), or its next mask needs the token
in flight (structured output whose masks are not deferred past the forward).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.request import Request


class Placeholders:
    def __init__(self, depth: int, max_model_len: int) -> None:
        self.depth = depth
        self.max_model_len = max_model_len

    def launched(self, req: Request, num_tokens: int) -> None:
        """``req`` samples ``num_tokens`` (1 + drafts) in the step being scheduled."""
        req.num_output_placeholders += self.depth * num_tokens

    def landed(self, req: Request, num_tokens: int) -> None:
        """The step in which ``req`` sampled ``num_tokens`` landed."""
        req.num_output_placeholders -= self.depth * num_tokens

    @staticmethod
    def dropped(req: Request) -> None:
        """``req`` was preempted: what is in flight for it will be dropped."""
        req.num_output_placeholders = 0

    @staticmethod
    def end(req: Request) -> int:
        """Tokens ``req`` has once what is in flight lands (at the optimistic count)."""
        return req.num_tokens + req.num_output_placeholders

    def reaches_length(self, req: Request) -> bool:
        """The tokens in flight already take ``req`` to its length limit."""
        n_out = req.num_output_tokens + req.num_output_placeholders
        return n_out >= req.max_output_tokens or self.end(req) >= self.max_model_len

    def holds_back(self, req: Request, masks_first: bool) -> bool:
        """``req`` sits this step out: a step of it is in flight and it finishes when
        that lands, or (``masks_first``: masks are filled before a step's forward) its
        next mask needs the token in flight."""
        return bool(req.num_output_placeholders) and (
            (req.needs_landed_tokens and masks_first) or self.reaches_length(req)
        )

    @staticmethod
    def any_mask_waiting(running: Iterable[Request]) -> bool:
        """A running request has a step in flight whose token its next mask needs."""
        return any(r.num_output_placeholders and r.needs_landed_tokens for r in running)
