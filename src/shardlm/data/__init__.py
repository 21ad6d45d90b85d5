"""Token shards: preparation, layout-independent sampling, and the embedded default corpus."""
