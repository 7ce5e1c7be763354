"""Speculative decoding: proposers (n-gram lookup, ...) and exact rejection sampling."""
from engine.spec.ngram import NgramProposer
from engine.spec.rejection import rejection_sample

__all__ = ["NgramProposer", "rejection_sample"]
