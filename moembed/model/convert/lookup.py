"""MoVE inference export: a model whose MoVE embedding layer is replaced by its precomputed table (MoVE §3.1, §4.5).

    >>> to_lookup(Embedder.load("path/to/move-model")).save("path/to/lookup-model")
"""

from __future__ import annotations

from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder


def to_lookup(emb: Embedder) -> Embedder:
    """An `Embedder` equal to `emb` whose MoVE embedding layer is replaced by its precomputed (|V_l|, d) table.

    The result is a plain moembed model (config without `move`, vocabulary |V_l|, same tokenizer) that costs no
    expert compute at inference. Raises ValueError for a model without a MoVE layer.
    """
    if emb.config.move is None:
        raise ValueError("this model has no MoVE embedding layer")
    table = emb.encoder.embeddings.word.precompute_table()  # (|V_l|, d)
    encoder = Encoder.for_weights(emb.config.model_copy(update={"move": None}))  # all loaded below (strict)
    sd = {k: v for k, v in emb.encoder.state_dict().items() if not k.startswith("embeddings.word.")}
    sd["embeddings.word.weight"] = table
    encoder.load_state_dict(sd)
    return emb.derive(encoder)
