"""Absolute → rotary positions: the mNomic-BERT step (nomic-embed-v2 §4.1) before MLM continues."""

from __future__ import annotations

from moembed.errors import MoembedError
from moembed.model.config import EncoderConfig
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder


def to_rotary(emb: Embedder) -> Embedder:
    """The same model with rotary instead of learned absolute positions.

    Every weight except the position table is copied unchanged; the result needs further MLM training to learn
    to use rotary positions (its int8 calibration is dropped). Raises when the model is already rotary.
    """
    if emb.config.position == "rotary":
        raise MoembedError("mlm.to_rotary: the model already uses rotary positions")
    cfg = EncoderConfig(**{**emb.config.model_dump(), "position": "rotary"})
    encoder = Encoder.for_weights(cfg)  # every weight is loaded below (strict)
    sd = {k: v for k, v in emb.encoder.state_dict().items() if k != "embeddings.position.weight"}
    encoder.load_state_dict(sd, strict=True)
    return emb.derive(encoder, calibration=None)
