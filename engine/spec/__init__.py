"""Speculative decoding: proposers (n-gram lookup, draft model, layer skip), exact rejection
sampling, adaptive depth; SpecDecoder wires them into the engine's step (see decoder.py)."""
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import NgramLookup
from engine.spec.proposers import DraftModelProposer, LayerSkipProposer, NgramProposer
from engine.spec.rejection import rejection_sample

__all__ = ["DraftModelProposer", "LayerSkipProposer", "NgramLookup", "NgramProposer", "SpeculativeConfig",
           "rejection_sample"]
