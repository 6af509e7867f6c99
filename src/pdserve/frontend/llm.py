"""The offline API, shaped like vLLM's ``LLM``: ``LLM(model_dir).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pdserve.config import EngineConfig
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import RequestStatus
from pdserve.frontend.output_processor import OutputProcessor
from pdserve.frontend.outputs import RequestOutput
from pdserve.frontend.parallel import fan_out, merge_outputs
from pdserve.frontend.processor import InputProcessor, PromptType
from pdserve.frontend.tokenizer import Tokenizer
from pdserve.spec_decode.proposer import Proposer


class LLM:
    """An in-process engine. ``kwargs`` are engine options named like the CLI flags
    (``dtype``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``block_size``, ``enable_prefix_caching``, ``device``, ...). ``proposer`` plugs in a
    drafter of one's own for speculative decoding (the protocol in
    :mod:`pdserve.spec_decode.proposer`)."""

    def __init__(self, model: str, *, proposer: Proposer | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=str(model), **kwargs)
        self.tokenizer = Tokenizer.from_pretrained(
            self.config.model.tokenizer or self.config.model.model
        )
        self.engine = EngineCore(self.config, proposer)
        self.processor = InputProcessor(
            self.tokenizer,
            self.engine.max_model_len,
            self.engine.vocab_size,
            speculative=self.config.speculative is not None,
            priority_scheduling=self.config.scheduler.scheduling_policy == "priority",
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's helpers (tensor-parallel followers, KV transfer, grammar
        compilation); the object cannot generate afterwards. Idempotent."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        All prompts are validated before any is queued: one bad prompt raises
        ``ValueError`` and leaves the engine as it was. A prompt with ``n`` > 1 runs as
        ``n`` engine requests (:mod:`pdserve.frontend.parallel`) and gets one output with
        ``n`` completions.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompt_list = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("give one SamplingParams, or one per prompt")
        reqs = []
        groups: list[tuple[str, list[str]]] = []  # each prompt's id, its engine requests'
        for p, sp in zip(prompt_list, params_list, strict=True):
            text, ids = self.processor.tokenize(p)
            self.processor.check(ids, sp)  # once for the n samples
            parent = str(next(self._ids))
            groups.append((parent, []))
            for rid, child in fan_out(parent, sp):
                reqs.append((text, self.processor.build(rid, ids, child)))
                groups[-1][1].append(rid)
        for text, req in reqs:
            self.output_processor.add_request(
                req.request_id, text, req.prompt_token_ids, req.sampling_params
            )
            self.engine.add_request(req)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outs, stopped = self.output_processor.process(self.engine.step(), delta=False)
            if stopped:
                self.engine.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
            for o in outs:
                if o.finished:
                    finals[o.request_id] = o
        missing = [i for i, (_, g) in enumerate(groups) if any(rid not in finals for rid in g)]
        if missing:
            raise RuntimeError(f"requests {missing} ended without a final output")
        return [merge_outputs(parent, [finals[rid] for rid in g]) for parent, g in groups]
