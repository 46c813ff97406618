"""Training data: real-corpus readers and builders, consistency filtering, hard-negative mining, tokenizers."""
