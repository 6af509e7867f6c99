"""HTTP serving: three roles over a few shared modules.

* :mod:`pdserve.serving.api`: the OpenAI-compatible API server (``pdserve serve``);
* :mod:`pdserve.serving.proxy`: the P/D proxy (``pdserve proxy``);
* :mod:`pdserve.serving.launch`: the topology launcher (``pdserve launch``).

Shared by the roles: :mod:`~pdserve.serving.http` (OpenAI error body, request ids,
client disconnect, SSE framing), :mod:`~pdserve.serving.uvicorn_server` (the uvicorn
runner) and :mod:`~pdserve.serving.net` (listening sockets).

Imports only go downward: a role imports the shared modules and lower packages, never
another role; the shared modules import no role. The launcher runs the other two as
``pdserve serve`` / ``pdserve proxy`` processes and imports neither.
"""
