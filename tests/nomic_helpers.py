"""A tiny random transformers NomicBertModel on disk, for the tests that read such a directory."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_nomic(out: Path, tokenizer_dir: Path):
    """A tiny random transformers NomicBertModel (LayerNorms perturbed too) saved with save_pretrained into `out`,
    with the tokenizer files of `tokenizer_dir`; returns the model."""
    import shutil

    from transformers import NomicBertConfig, NomicBertModel

    torch.manual_seed(0)
    cfg = NomicBertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=48, max_position_embeddings=64, layer_norm_eps=1e-5,
                          initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    model = NomicBertModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    return model
