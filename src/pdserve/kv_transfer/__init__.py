"""KV transfer between a prefill instance (producer) and a decode instance (consumer).

The connector has two roles, like vLLM's: a scheduler side (inside the scheduler's
step) and a worker side (next to the KV cache tensors). Both live in the engine-core
process today; they talk only through per-step metadata and per-step outputs, so the
worker side can move into separate worker processes (TP/DP) without changing the
contract.

Request lifecycle, prefill side (``kv_role`` kv_producer or kv_both):
  1. The request arrives with ``kv_transfer_params.do_remote_decode = true`` (set by
     the proxy) and ``max_tokens = 1``; it is scheduled and computed as usual.
  2. When it finishes normally, ``request_finished`` returns ``delay_free = True`` and
     the params decode needs (``do_remote_prefill``, ``remote_engine_id``,
     ``remote_block_ids``, ``remote_request_id``, ``remote_host``, ``remote_port``,
     ``tp_size``). The blocks stay allocated under a *lease*: short at first, renewed
     by the decode instance's heartbeats.
  3. The blocks are freed when decode reports the read complete (or that it gave the
     request up), when the lease expires, or when the proxy asks to release them.

Request lifecycle, decode side (kv_consumer or kv_both):
  1. The request arrives with ``do_remote_prefill = true`` and the params above.
     ``on_new_request`` starts lease heartbeats to the prefill engine at once.
  2. When the scheduler first considers it, ``get_num_new_matched_tokens`` says how many
     prompt tokens will come from the wire (all but the last, minus local prefix hits).
     Blocks are allocated for them; the request waits in ``WAITING_FOR_REMOTE_KV``
     without taking a running slot; the worker side pulls the blocks in the background.
     Those blocks may have been freed while a step that still writes into them runs
     (async scheduling), so on a GPU a pull writes nothing before the engine's work
     launched until then has finished (the fence, ``transports.base``).
  3. When the pull finishes, the request returns to ``WAITING`` with those tokens
     computed and then computes only its last prompt token. If the pull fails,
     ``kv_load_failure_policy`` decides: ``fail`` (the request ends with a clear error)
     or ``recompute`` (the prompt is prefilled locally).
  4. A request aborted while waiting tells prefill to free its blocks; one aborted
     during a pull keeps its local blocks until the pull has stopped writing them.

The side channel (decode's puller ↔ prefill's KV server, ZMQ) is hostile ground:
  - Every message carries an HMAC with the topology's secret (``PDSERVE_PD_SECRET``;
    a P/D role refuses to start without it) over a per-connection session and a
    counter, and every reply one bound to its request (``wire``). The server verifies
    before it decodes; anything else, and any recorded message sent again, gets an
    error, is counted and never acted upon, and no byte sequence stops the server
    thread (``handler``, ``server``).
  - Leases are bound to their prompt: prefill records the digest of the prompt's token
    ids with the lease (and returns it as ``remote_prompt_digest``); a read or a done
    notice names the digest of decode's own prompt and decode's engine id, and prefill
    serves the KV only for the same prompt, to the first decode that read it
    (``lease``). Decode params for one prompt never pull (or free) another's KV.
  - Authenticated peers are bounded: reads per lease, reads per second per
    connection, request ids per heartbeat / done notice (``KVTransferConfig``).
  - Decode runs one worker per prefill endpoint with per-job deadlines, so a dead or
    fake peer delays only its own requests; an optional ``allowed_prefill`` list
    keeps it from dialling anything else (``puller``, ``peer_link``).
  - The engine core has the worker half supervise its threads each step: a dead KV
    server marks the instance unhealthy (``/health`` answers 503) until it is
    restarted on the same port after a back-off (``supervisor``).
"""
