"""The topology launcher (``pdserve launch``): starts, watches and stops an xPyD topology.

Entry: :mod:`.cli` (also ``python -m pdserve.serving.launch``); file: :mod:`.topology`;
processes: :mod:`.launcher`.
"""
