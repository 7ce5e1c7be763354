"""Greedy comparisons with transformers for the tests: the reference, the engine's side and the near-tie rule
live in check/compare.py, where `baton check gpu` judges with them too; Baton against itself compares with `==`."""
from check.compare import MAX_LOGPROB_GAP, TOP_K, Greedy, GreedyMismatch, baton_greedy, check_greedy_close, hf_greedy

__all__ = ["MAX_LOGPROB_GAP", "TOP_K", "Greedy", "GreedyMismatch", "baton_greedy", "check_greedy_close", "hf_greedy"]
