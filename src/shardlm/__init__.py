"""shardlm: train decoder-only transformers from one CPU process to many GPUs.

Importing the package imports no torch, so the planner and config stay light.
"""
__version__ = "0.1.0"
