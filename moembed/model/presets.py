"""Named encoder presets: one registry of `EncoderConfig` builders, used by `model:` in training configs.

    >>> build_preset("minilm_moe")                       # all-MiniLM-L6-v2's shape, every second MLP an MoE block
    >>> build_preset("nomic", vocab_size=30522)          # Nomic-style, vocabulary padded to a multiple of 64

Adding a preset is one builder function here and one line in `PRESETS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from moembed.model.config import EncoderConfig, MoEConfig, pad_vocab


def bert_config(**overrides) -> EncoderConfig:
    """BERT-style encoder (defaults: all-MiniLM-L6-v2's shape)."""
    return EncoderConfig(family="bert", position="absolute", mlp="gelu", **overrides)


def nomic_config(**overrides) -> EncoderConfig:
    """Nomic-style encoder: rotary, SwiGLU, no dropout, no biases, padded vocabulary (nomic-embed-v1 §4.1.2)."""
    base = dict(
        family="nomic", position="rotary", mlp="swiglu", bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        layer_norm_eps=1e-12, type_vocab_size=2, vocab_size=pad_vocab(30522), hidden_size=768, num_layers=12,
        num_heads=12, intermediate_size=3072, max_position=2048,
    )
    base.update(overrides)
    if "vocab_size" in overrides:
        base["vocab_size"] = pad_vocab(overrides["vocab_size"])
    return EncoderConfig(**base)


def minilm_l6() -> EncoderConfig:
    return bert_config()


def minilm_moe(num_experts: int = 8, top_k: int = 2) -> EncoderConfig:
    """all-MiniLM-L6-v2 with every second MLP as an MoE block (layers 2, 4, 6)."""
    return bert_config(moe=MoEConfig(num_experts=num_experts, top_k=top_k))


def nomic_v1_base() -> EncoderConfig:
    """nomic-bert-2048: 137M parameters, 2048 trained context (nomic-embed-v1 §4.1.2)."""
    return nomic_config()


def nomic_v2_moe_base() -> EncoderConfig:
    """Nomic Embed v2 MoE: mNomic-BERT (XLM-R base with rotary positions, nomic-embed-v2 §4.1), 8 experts top-2
    on every second layer (§3.2, §4.3). XLM-R's MLPs are GELU with biases, which gives the paper's 475M total /
    305M active parameters; a SwiGLU variant of the same shape would have 603M / 348M."""
    return nomic_config(
        vocab_size=250_048, max_position=2048, mlp="gelu", bias=True, moe=MoEConfig(num_experts=8, top_k=2)
    )


def tiny_config(family: Literal["bert", "nomic"] = "bert", **overrides) -> EncoderConfig:
    """A tiny random config for unit tests."""
    base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position=64)
    base.update(overrides)
    return bert_config(**base) if family == "bert" else nomic_config(**base)


# The registry: preset name → builder of its EncoderConfig (no arguments needed).
PRESETS: dict[str, Callable[[], EncoderConfig]] = {
    "tiny": tiny_config,
    "bert": bert_config,
    "nomic": nomic_config,
    "minilm_moe": minilm_moe,
    "nomic_v1_base": nomic_v1_base,
    "nomic_v2_moe_base": nomic_v2_moe_base,
}


def build_preset(name: str, vocab_size: int | None = None, overrides: dict[str, Any] | None = None) -> EncoderConfig:
    """The preset's config with a tokenizer's vocabulary (padded to 64 for Nomic-style) and field overrides.

    Raises KeyError for an unknown name and pydantic's ValidationError for bad overrides (callers name the key).
    """
    base = PRESETS[name]().model_dump()
    if vocab_size is not None:
        base["vocab_size"] = pad_vocab(vocab_size) if base["family"] == "nomic" else vocab_size
    base.update(overrides or {})
    return EncoderConfig(**base)
