"""The P/D proxy of a disaggregated deployment (``pdserve proxy``).

Entry: :mod:`.cli`; app: :mod:`.app`; the two legs of a request: :mod:`.forward`.
"""
