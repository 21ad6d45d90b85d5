"""The decoder model and its Hugging Face state-dict adapter."""
from .decoder import Block, Decoder, KVCache, build_model

__all__ = ["Block", "Decoder", "KVCache", "build_model"]
