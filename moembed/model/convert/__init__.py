"""Embedder-to-Embedder conversions: each takes an `Embedder` and returns a new one with a changed encoder.

- `upcycle`: dense → sparse MoE, experts copied from the dense MLPs (Komatsuzaki et al.; nomic-embed-v2 §4.3);
- `lookup.to_lookup`: a MoVE embedding layer → its precomputed plain table (MoVE §3.1);
- `rotary.to_rotary`: learned absolute positions → rotary positions (nomic-embed-v2 §4.1, mNomic-BERT).

Conversions keep the tokenizer, pooling, prompts and the directory its tokenizer files come from
(`Embedder.derive`). Converting a Hugging Face checkpoint into moembed's names is a family converter's job
(`moembed.model.families`), not one of these.
"""
