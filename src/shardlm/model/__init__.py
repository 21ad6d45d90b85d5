"""The decoder model and its Hugging Face state-dict adapter."""
from .decoder import Block, Decoder, DecoderParts, KVCache, build_model

__all__ = ["Block", "Decoder", "DecoderParts", "KVCache", "build_model"]
