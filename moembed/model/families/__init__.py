"""Model families: one registry mapping a Hugging Face `model_type` to the converter of its checkpoints.

Adding a family is one module here (a converter implementing `base.Converter`) and one line in `FAMILIES`.
"""

from __future__ import annotations

from pathlib import Path

from moembed.errors import MoembedError
from moembed.model.config import EncoderConfig
from moembed.model.families import bert, nomic_bert, roberta
from moembed.model.families.base import Converter

FAMILIES: dict[str, Converter] = {
    bert.CONVERTER.model_type: bert.CONVERTER,
    roberta.ROBERTA.model_type: roberta.ROBERTA,
    roberta.XLM_ROBERTA.model_type: roberta.XLM_ROBERTA,
    nomic_bert.CONVERTER.model_type: nomic_bert.CONVERTER,
}


def converter_for(cfg: dict, path: Path) -> Converter:
    """The converter of a Hugging Face config.json dict read from directory `path`; unsupported types raise,
    naming the file, the type and the supported ones."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise MoembedError(
            f"{path / 'config.json'}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)} "
            "(other sentence-transformers models can still serve as teachers)"
        )
    return FAMILIES[model_type]


DEFAULT_EXPORT = "bert"  # the layout of encoders built by moembed itself (no `hf_model_type`)


def exporter_for(config: EncoderConfig) -> Converter | None:
    """The family whose Hugging Face format holds an encoder of `config`: the one it was read from (else BERT)
    when that one can, else the first that can (None: moembed's own format only)."""
    own = FAMILIES.get(config.hf_model_type or DEFAULT_EXPORT)
    if own is not None and own.can_export(config):
        return own
    return next((c for c in FAMILIES.values() if c.can_export(config)), None)
