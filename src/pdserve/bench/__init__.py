"""Benchmark clients that speak only HTTP (OpenAI API), so they run against any
OpenAI-compatible server (vLLM, SGLang, pdserve).

``serve`` is ``pdserve bench serve`` (vLLM's ``bench serve`` semantics); it is
built from ``datasets`` (random prompts), ``arrivals`` (open-loop schedule),
``request_func`` + ``sse`` (streaming timing), ``metrics`` (pure aggregates) and
``report`` (summary block and result JSON), plus ``scrape`` (the server's /metrics:
prefix-cache hit rate per run). ``sla`` (``bench sla``: capacity under a TTFT/TPOT SLA,
searched by ``sla_search``) and ``soak`` (``pdserve soak``: RSS growth per process, judged
by ``soak_fit`` from ``soak_sampler``'s samples) run ``serve``'s pieces; ``plots`` draws
their PNGs (matplotlib, imported on use). See docs/BENCHMARKS.md. Modules are imported
on use, not here.
"""
