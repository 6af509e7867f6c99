"""The OpenAI-compatible API server of one pdserve instance (``pdserve serve``).

Entry: :mod:`.cli`; app: :mod:`.app`; runner: :mod:`.server`.
"""
