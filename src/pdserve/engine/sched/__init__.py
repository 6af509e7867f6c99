"""The scheduler's parts; :class:`pdserve.engine.scheduler.Scheduler` composes them.

Each part sees requests as counts and token ids, never tensors:

- :mod:`.queues`: the waiting and running queues and their policy (fcfs or priority).
- :mod:`.admission`: the step's token budget, ``max_num_seqs``, block allocation,
  admission from the waiting queue and preemption under block pressure.
- :mod:`.remote_kv`: prompts whose KV comes from a prefill instance (the KV connector).
- :mod:`.spec`: speculative decoding: drafts per step, P/D first-step padding, acceptance.
- :mod:`.placeholders`: in-flight accounting: tokens of a step launched, not yet landed.
- :mod:`.masks`: structured-output bitmasks and bad-word bans, and when they are filled.
- :mod:`.stops`: what ends a request, checked token by token over a landed step.
"""
