"""Typed, validated encoder configuration.

One `EncoderConfig` covers the two encoder families:
- BERT-style: learned absolute positions, token types, GELU MLP, post-LayerNorm (loads existing BERT checkpoints).
- Nomic-style (nomic-embed-v1 §4.1.2): rotary positions, SwiGLU MLP, no dropout, vocabulary padded to a
  multiple of 64, Dynamic NTK RoPE scaling at inference (Eq. 5).
An optional `MoEConfig` turns chosen layers' MLPs into sparse Mixture-of-Experts blocks (nomic-embed-v2 §3.2).
Configs are validated on construction; errors name the key. Named configs (presets) are in `presets.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MoEConfig(_Strict):
    """Which layers are sparse MoE and how they route (nomic-embed-v2 §3.2: 8 experts, top-2, every second layer)."""

    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    # Layers are chosen by `every`/`offset` (layer i is MoE when i % every == offset; default: the 2nd, 4th, ...)
    # unless `layers` lists them explicitly (0-based).
    every: int = Field(2, ge=1)
    offset: int = Field(1, ge=0)
    layers: list[int] | None = None
    renormalize: bool = True  # renormalise the top-k gate weights to sum to 1 (off: the softmax probabilities as is)
    # Biases of the experts' own linear layers (None: as EncoderConfig.bias), and one output bias of width d added
    # once after the gate-weighted sum, shared by all experts (the published nomic-embed-text-v2-moe layout).
    expert_bias: bool | None = None
    output_bias: bool = False
    capacity_factor: float | None = Field(None, gt=0)  # None: dropless
    router_jitter: float = Field(0.0, ge=0)
    # Hidden units of each expert (None: EncoderConfig.intermediate_size). Fine-grained upcycling gives each expert
    # a 1/G slice of the dense MLP (He et al. 2024, arXiv 2410.07524; moembed.model.convert.upcycle).
    expert_size: int | None = Field(None, ge=1)
    # Auxiliary-loss-free balancing (Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3 §2.1.2): a per-expert bias
    # added to the logits only to choose the experts (never to the gates), moved after every optimizer step by
    # balance_rate · sign(mean load − load). 0: off (no bias buffer).
    balance_rate: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "MoEConfig":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.offset >= self.every:
            raise ValueError(f"offset ({self.offset}) must be smaller than every ({self.every})")
        return self

    def layer_indices(self, num_layers: int) -> list[int]:
        if self.layers is not None:
            bad = [i for i in self.layers if not 0 <= i < num_layers]
            if bad:
                raise ValueError(f"moe.layers: {bad} out of range for {num_layers} layers")
            return sorted(set(self.layers))
        return [i for i in range(num_layers) if i % self.every == self.offset]


class MoVEConfig(_Strict):
    """Mixture-of-Vocabulary-Experts embedding layer (MoVE §3.1): each token of the large routing vocabulary V_l
    (size `EncoderConfig.vocab_size`) is built from its pieces in the base vocabulary V_s by one of K experts."""

    base_vocab_size: int = Field(..., ge=1)  # |V_s|
    num_experts: int = Field(..., ge=1)  # K
    expert_dim: int = Field(..., ge=1)  # d_e: each expert is d → d_e → d (Fig. 2b)
    max_pieces: int = Field(..., ge=1)  # most V_s pieces of one V_l token (width of the φ table)
    routing: Literal["hash", "learned", "semantic"] = "hash"  # App. D: hash-balanced is the paper's choice
    residual: bool = False  # add the expert's input to its output (off: Eq. 2 as written)


class EncoderConfig(_Strict):
    """A bidirectional transformer encoder."""

    family: Literal["bert", "nomic"] = "bert"
    vocab_size: int = Field(30522, ge=1)
    hidden_size: int = Field(384, ge=1)
    num_layers: int = Field(6, ge=1)
    num_heads: int = Field(12, ge=1)
    intermediate_size: int = Field(1536, ge=1)
    max_position: int = Field(512, ge=1)  # trained context length (absolute table size for BERT-style)
    type_vocab_size: int = Field(2, ge=0)
    pad_token_id: int = Field(0, ge=0)

    position: Literal["absolute", "rotary"] = "absolute"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    bias: bool = True  # biases on the linear layers (Nomic-style models drop them)
    layer_norm_eps: float = Field(1e-12, gt=0)
    hidden_dropout: float = Field(0.1, ge=0, lt=1)
    attention_dropout: float = Field(0.1, ge=0, lt=1)

    rope_base: float = Field(10_000.0, gt=0)
    ntk_alpha: float = Field(2.0, ge=1)  # Dynamic NTK α (nomic-embed-v1 Eq. 5); applied beyond max_position
    dynamic_ntk: bool = True

    moe: MoEConfig | None = None
    move: MoVEConfig | None = None  # when set, vocab_size is |V_l| and the embedding layer is MoVE
    # The Hugging Face `model_type` the weights were read from (`moembed.model.families`); export writes the
    # encoder back in that family's layout when it can. None: a model built by moembed.
    hf_model_type: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "EncoderConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.position == "rotary" and (self.hidden_size // self.num_heads) % 2:
            raise ValueError("rotary positions need an even head dimension")
        if self.pad_token_id >= self.vocab_size:
            raise ValueError(f"pad_token_id ({self.pad_token_id}) must be < vocab_size ({self.vocab_size})")
        if self.moe is not None:
            self.moe.layer_indices(self.num_layers)
        if self.move is not None and not self.pad_token_id < self.move.base_vocab_size <= self.vocab_size:
            raise ValueError(
                f"move.base_vocab_size ({self.move.base_vocab_size}) must be > pad_token_id and <= vocab_size ({self.vocab_size})"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def moe_layers(self) -> list[int]:
        return [] if self.moe is None else self.moe.layer_indices(self.num_layers)


def pad_vocab(n: int, multiple: int = 64) -> int:
    """Vocabulary size rounded up to a multiple (nomic-embed-v1 §4.1.2 pads to 64 for fast matmuls)."""
    return -(-n // multiple) * multiple
