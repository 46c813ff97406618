"""The interface of a model-family converter: Hugging Face config and weights ↔ moembed's `EncoderConfig` and names.

One converter per Hugging Face `model_type`, registered in `moembed.model.families`. `config_from_hf` and
`weights_from_hf` load a checkpoint of that type (`config_from_hf` records the type in `EncoderConfig.hf_model_type`,
so export picks the same family back); `can_export`, `hf_config` and `weights_to_hf` write a moembed encoder back
in that format (`--format huggingface` and the sentence-transformers export), for the configs the family can hold.
On load, `weights_to_hf` applied to an encoder built on the meta device gives the shapes a checkpoint's tensors
must have, so it should work on meta tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from moembed.model.config import EncoderConfig


class Converter(Protocol):
    model_type: str  # Hugging Face config.json "model_type"
    tokenizer_class: str  # written to tokenizer_config.json on export when the source had none

    def config_from_hf(self, cfg: dict, path: Path) -> EncoderConfig:
        """The EncoderConfig of a Hugging Face config.json dict; errors name `path / "config.json"` and the key."""

    def weights_from_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
        """A Hugging Face state dict renamed to moembed's encoder names."""

    def can_export(self, config: EncoderConfig) -> bool:
        """Whether an encoder of this config is expressible in the layout transformers' own class reads."""

    def layouts(self, config: EncoderConfig) -> list[str]:
        """The layouts that hold an encoder of this config exactly: "transformers" (what `can_export` says) and,
        for a family whose released checkpoints use a layout of their own (nomic_bert), "published"."""

    def hf_config(self, config: EncoderConfig) -> dict:
        """The Hugging Face config.json dict of an exported encoder."""

    def weights_to_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
        """Inverse of `weights_from_hf`."""
