"""BERT checkpoints (`model_type: bert`, e.g. all-MiniLM-L6-v2): Hugging Face BertModel ↔ moembed names.

BERT's attention projections query/key/value become one fused `qkv`; LayerNorm `gamma`/`beta` (older
checkpoints) are read as `weight`/`bias`; a `bert.` or `model.` prefix is dropped.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moembed.errors import MoembedError
from moembed.model.config import EncoderConfig

_LAYER = {
    "attention.output.dense": "out",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "output.LayerNorm": "norm2",
}
_EMB = {
    "word_embeddings": "word",
    "position_embeddings": "position",
    "token_type_embeddings": "token_type",
    "LayerNorm": "norm",
}


class BertConverter:
    model_type = "bert"
    tokenizer_class = "BertTokenizer"

    def config_from_hf(self, cfg: dict, path: Path) -> EncoderConfig:
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise MoembedError(f"{path / 'config.json'}: hidden_act {cfg.get('hidden_act')!r} is not supported")
        try:
            return EncoderConfig(
                family="bert", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                intermediate_size=cfg["intermediate_size"], max_position=cfg.get("max_position_embeddings", 512),
                type_vocab_size=cfg.get("type_vocab_size", 2), pad_token_id=cfg.get("pad_token_id") or 0,
                layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_dropout=cfg.get("hidden_dropout_prob", 0.1),
                attention_dropout=cfg.get("attention_probs_dropout_prob", 0.1),
            )
        except KeyError as e:
            raise MoembedError(f"{path / 'config.json'}: missing key {e.args[0]!r}") from None

    def weights_from_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
        sd = {re.sub(r"^(bert|model)\.", "", k).replace(".gamma", ".weight").replace(".beta", ".bias"): v
              for k, v in sd.items()}
        out = {}
        for k, v in sd.items():
            if k.startswith("embeddings.") and not k.endswith("position_ids"):
                mod, param = k.split(".")[1], k.split(".")[-1]
                if mod in _EMB:
                    out[f"embeddings.{_EMB[mod]}.{param}"] = v
            m = re.match(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$", k)
            if m and m.group(2) in _LAYER:
                out[f"layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"] = v
        for i in range(config.num_layers):
            for p in ("weight", "bias"):
                parts = [sd.get(f"encoder.layer.{i}.attention.self.{n}.{p}") for n in ("query", "key", "value")]
                if all(t is not None for t in parts):
                    out[f"layers.{i}.qkv.{p}"] = torch.cat(parts, 0)  # (3d, d) or (3d,)
        return out

    def can_export(self, config: EncoderConfig) -> bool:
        """Dense, absolute positions, GELU MLPs, a plain embedding table: what BertModel holds."""
        return config.moe is None and config.position == "absolute" and config.mlp == "gelu" and config.move is None

    def hf_config(self, c: EncoderConfig) -> dict:
        return {
            "architectures": ["BertModel"], "model_type": "bert", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "intermediate_size": c.intermediate_size, "hidden_act": "gelu", "max_position_embeddings": c.max_position,
            "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_token_id,
            "hidden_dropout_prob": c.hidden_dropout, "attention_probs_dropout_prob": c.attention_dropout,
            "position_embedding_type": "absolute", "initializer_range": 0.02,
        }

    def weights_to_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
        inv_emb = {v: k for k, v in _EMB.items()}
        inv_layer = {v: k for k, v in _LAYER.items()}
        out = {}
        for k, v in sd.items():
            v = v.contiguous()
            if k.startswith("embeddings."):
                _, mod, param = k.split(".")
                out[f"embeddings.{inv_emb[mod]}.{param}"] = v
                continue
            m = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", k)
            if not m:
                raise MoembedError(f"export: weight {k!r} has no BERT equivalent")
            i, mod, p = m.groups()
            if mod == "qkv":
                for n, part in zip(("query", "key", "value"), v.chunk(3, 0)):
                    out[f"encoder.layer.{i}.attention.self.{n}.{p}"] = part.contiguous()
            elif mod in inv_layer:
                out[f"encoder.layer.{i}.{inv_layer[mod]}.{p}"] = v
            else:
                raise MoembedError(f"export: weight {k!r} has no BERT equivalent")
        return out


CONVERTER = BertConverter()
