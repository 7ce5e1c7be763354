"""Checks a user runs on their own hardware: `baton check gpu` (check/gpu.py) proves the CUDA path right and
measures it. Nothing here imports Ray or the cluster code: a stock CUDA PyTorch image runs it."""
