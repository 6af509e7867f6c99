"""Test and benchmark fixtures that ship with pdserve (no model is ever downloaded).

``pdserve.testing.checkpoint`` writes random-initialised checkpoints in exact
Hugging Face format (``pdserve make-checkpoint``), shaped by the model classes
themselves; ``pdserve.testing.tokenizer_maker`` builds their deterministic
tokenizers. Nothing here is imported by the serving path.
"""
