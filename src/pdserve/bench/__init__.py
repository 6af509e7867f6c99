"""Benchmark clients that speak only HTTP (OpenAI API), so they run against any
OpenAI-compatible server (vLLM, SGLang, pdserve).

``serve`` is ``pdserve bench serve`` (vLLM's ``bench serve`` semantics); it is
built from ``datasets`` (random prompts), ``arrivals`` (open-loop schedule),
``request_func`` + ``sse`` (streaming timing), ``metrics`` (pure aggregates) and
``report`` (summary block and result JSON). Modules are imported on use, not here.
"""
