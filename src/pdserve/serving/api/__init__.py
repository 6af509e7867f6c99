"""The OpenAI-compatible API server of one pdserve instance (``pdserve serve``).

Entry: :mod:`.cli`; app: :mod:`.app`; runner: :mod:`.server`.

The OpenAI/vLLM surface in one place (details in the modules named):

* endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``
  (:mod:`.responses`; text and message input, JSON or typed SSE events, no tools),
  ``/v1/models``, ``/v1/models/{id}`` (404 in OpenAI's error shape), ``/tokenize``,
  ``/detokenize``, ``/health``, ``/metrics``, ``/version`` (the proxy has ``/version`` too);
* chat output parsing (:mod:`.chat_output`, parsers in :mod:`pdserve.frontend.parsers`):
  ``--reasoning-parser glm45|deepseek_r1`` fills ``reasoning_content`` (message and
  stream deltas; ``chat_template_kwargs`` ``enable_thinking``/``thinking`` false turns it
  off, ``include_reasoning=false`` drops it); ``--enable-auto-tool-choice
  --tool-call-parser glm47|glm45|deepseek_v31|hermes`` fills ``tool_calls`` for requests
  with ``tools`` and ``tool_choice`` ``auto``; ``none`` renders the tools and parses
  nothing; ``required`` and a named function constrain the output to calls
  (:class:`.chat_output.ForcedToolCalls`; ``strict`` functions only with those);
* structured output (:mod:`.protocol_structured`, engine side in
  :mod:`pdserve.engine.structured_output`): ``response_format`` ``json_object`` /
  ``json_schema``, ``structured_outputs`` and the ``guided_*`` aliases, through xgrammar
  (with speculative decoding too: each verified position has its own mask);
* vLLM request extras (:mod:`.protocol`): ``truncate_prompt_tokens`` (implemented),
  ``priority`` (any value with ``--scheduling-policy priority``, else 0 only), ``cache_salt`` and ``spaces_between_special_tokens`` (accepted,
  no effect: see the protocol docstring for why);
* operations: a uvicorn access log line per request (on by default;
  ``--disable-uvicorn-access-log``), ``--metrics-vllm-aliases`` (``vllm:`` copies of the
  key series, :mod:`pdserve.metrics.prometheus`).
"""
