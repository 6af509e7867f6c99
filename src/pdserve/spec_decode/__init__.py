"""Speculative decoding: the proposer protocol and the rejection sampler.

A proposer drafts up to k tokens per request after each step, on the device; the
next step verifies them (1 + k tokens per request) and the rejection sampler keeps
the longest accepted prefix plus one token of the target's own.
"""
