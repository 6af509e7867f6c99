"""Structured output in the engine core: grammars compiled off the step loop, one matcher
per request, one token bitmask per step.

Lifecycle of a constrained request (``SamplingParams.structured_outputs``):

1. ``EngineCore.add_request`` hands it to :class:`StructuredOutputManager`, which submits
   its grammar to a small thread pool (xgrammar compiles in C++ without the GIL); compiled
   grammars are cached by the spec's key (LRU), so equal schemas compile once.
2. Each step the engine core takes the requests whose grammar is ready and queues them in
   the scheduler with a :class:`RequestGrammar` (a matcher) on the request; a grammar
   that failed to compile finishes its request with an error (the API server has already
   refused specs that do not parse, so that is rare).
3. Each step fills one bitmask row per constrained request that samples in it
   (``Scheduler.fill_masks`` with :class:`BitmaskFiller`, all rows in one multi-threaded
   xgrammar call); the runner applies it to those logits rows on the device
   (``Sampler.masked``).
4. ``Scheduler.update_from_output`` advances the matcher with each accepted token; the
   request stops when the matcher terminates (the grammar is complete and a stop token
   was taken, or nothing more can follow).

The matcher must have seen every earlier token before a bitmask is filled. Under async
scheduling the masks are deferred (``SchedulerOutput.masks_deferred``): the engine core
schedules a constrained request while its previous step is still in flight, launches
the new step's forward (which needs no mask), then lands the step in flight, advances
the matchers, fills the masks and only then enqueues the sampling. The matchers' host
work thus runs while the device computes the forward, as vLLM overlaps its grammar
bitmask with the model forward. A request that finished on the landed token keeps an
all-allowing row (its sample is dropped). Without async scheduling, or under tensor
parallelism (every rank launches a whole step), the masks are filled when the step is
scheduled, after the step before it has landed.

Speculative decoding: a verify's request samples from one logits row per position, and
each row gets its own bitmask row, the grammar's state after the drafts before it
(:meth:`BitmaskFiller.fill` advances the matcher over the drafts and rolls it back; a
placeholder draft is filled from the proposal that landed, ``Request.verified_drafts``).
A draft the grammar forbids is masked out at its own row, so the rejection sampler
rejects it and samples the row's masked distribution instead: the output is what the
engine without speculation gives (the same tokens under greedy). The accepted tokens
then advance the matcher as usual.

xgrammar is imported on the first constrained request, so engines that never see one
do not pay for it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.core_types.grammar import build_grammar
from pdserve.core_types.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 256
_COMPILE_THREADS = 2


def tokenizer_info(tokenizer_dir: str | Path, vocab_size: int) -> Any:
    """xgrammar's view of the model's tokenizer (``tokenizer.json``), sized to the
    model's logits (a padded vocabulary's extra ids are never allowed)."""
    import xgrammar as xgr
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    backend = Backend.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_object=backend)
    with warnings.catch_warnings():  # stop ids are each request's EOS ids (RequestGrammar)
        warnings.simplefilter("ignore", UserWarning)
        return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size)


class RequestGrammar:
    """One request's matcher; stop tokens are the request's EOS ids."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.failed = False

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and ``failed``) when the grammar refuses it."""
        if not self.matcher.accept_token(token):
            self.failed = True
        return not self.failed

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def accept_run(self, tokens: list[int]) -> tuple[int, bool]:
        """Advance over a step's accepted tokens (several after a speculative verify):
        (how many belong to the output, False when the grammar refused one). Tokens
        after the one that terminated the grammar are not fed and do not belong."""
        for n, tok in enumerate(tokens):
            if self.terminated:
                return n, True
            if not self.accept(tok):
                return n + 1, False
        return len(tokens), True


class StructuredOutputManager:
    """Compiles grammars in a thread pool (cached by key) and holds the requests whose
    grammar is not ready yet."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self.pending: dict[str, tuple[Any, Future[Any]]] = {}  # request id -> (request, fut)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = tokenizer_info(self.tokenizer_dir, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
        return self._compiler.compile_grammar(build_grammar(spec))

    def submit(self, spec: StructuredOutputsParams) -> Future[Any]:
        key = spec.key()
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            return fut
        if self._pool is None:
            # one worker builds the compiler; xgrammar compiles with threads of its own
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        fut = self._pool.submit(self._compile, spec)
        self._cache[key] = fut
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return fut

    def add(self, request: Any) -> None:
        """Start compiling ``request``'s grammar; it waits here until it is ready."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        if request.request_id in self.pending:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.pending[request.request_id] = (request, self.submit(spec))

    def abort(self, request_id: str) -> Any | None:
        entry = self.pending.pop(request_id, None)
        return entry[0] if entry is not None else None

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Any], list[tuple[Any, str]]]:
        """(requests whose grammar is ready, with ``grammar`` set; (request, error) of
        those whose grammar failed). With ``wait_s`` it waits that long for the first
        pending grammar when none is ready."""
        if wait_s > 0 and self.pending and not any(f.done() for _, f in self.pending.values()):
            first = next(iter(self.pending.values()))[1]
            with contextlib.suppress(TimeoutError):
                first.exception(timeout=wait_s)
        ready: list[Any] = []
        failed: list[tuple[Any, str]] = []
        for rid in [rid for rid, (_, f) in self.pending.items() if f.done()]:
            request, fut = self.pending.pop(rid)
            err = fut.exception()
            if err is not None:
                failed.append((request, str(err)))
                continue
            request.grammar = RequestGrammar(fut.result(), sorted(request.eos_token_ids))
            ready.append(request)
        return ready, failed

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class BitmaskFiller:
    """Fills a step's bitmask: [len(grammars), ceil(vocab / 32)] int32, bit j of row i
    set when grammar i allows token j next (all rows in one multi-threaded call)."""

    def __init__(self, vocab_size: int) -> None:
        import xgrammar as xgr

        self.words = (vocab_size + 31) // 32
        self._batch = xgr.BatchGrammarMatcher()

    def fill(
        self,
        grammars: list[RequestGrammar | None],
        drafts: list[list[int]] | None = None,
    ) -> np.ndarray:
        """One row per grammar; a None row allows every token. With ``drafts`` (a
        speculative verify) grammar ``i`` has ``1 + len(drafts[i])`` consecutive rows:
        row ``j`` allows what may follow ``drafts[i][:j]`` (the matcher is advanced over
        the drafts for the fill, one position of every request per batched call, then
        rolled back). Past a draft the grammar refuses (or a placeholder ``-1``, or the
        end of the grammar) the rows allow everything: the rejection sampler never
        reaches them, since the draft before them is masked out at its own row."""
        if drafts is None or not any(drafts):
            return self._fill_rows(grammars)
        import torch

        counts = [1 + len(d) for d in drafts]
        start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        out = np.full((int(sum(counts)), self.words), -1, np.int32)
        view = torch.from_numpy(out)
        live = [i for i, g in enumerate(grammars) if g is not None]
        advanced = dict.fromkeys(live, 0)
        for j in range(max(counts)):
            live = [i for i in live if j < counts[i]]
            if not live:
                break
            matchers = [grammars[i].matcher for i in live]  # type: ignore[union-attr]
            self._batch.batch_fill_next_token_bitmask(
                matchers, view, [int(start[i]) + j for i in live]
            )
            still = []
            for i, m in zip(live, matchers, strict=True):
                tok = drafts[i][j] if j < len(drafts[i]) else -1
                if tok >= 0 and not m.is_terminated() and m.accept_token(tok):
                    advanced[i] += 1
                    if not m.is_terminated():
                        still.append(i)
            live = still
        for i, n in advanced.items():
            if n:
                grammars[i].matcher.rollback(n)  # type: ignore[union-attr]
        return out

    def _fill_rows(self, grammars: list[RequestGrammar | None]) -> np.ndarray:
        import torch

        rows = [i for i, g in enumerate(grammars) if g is not None]
        matchers = [g.matcher for g in grammars if g is not None]
        filled = np.empty((len(rows), self.words), np.int32)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(torch.from_numpy(filled), 0)
        elif matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(filled))
        if len(rows) == len(grammars):
            return filled
        out = np.full((len(grammars), self.words), -1, np.int32)
        out[rows] = filled
        return out
