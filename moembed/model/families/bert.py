"""BERT checkpoints (`model_type: bert`, e.g. all-MiniLM-L6-v2): Hugging Face BertModel ↔ moembed names.

BERT's attention projections query/key/value become one fused `qkv`; LayerNorm `gamma`/`beta` (older
checkpoints) are read as `weight`/`bias`; a `bert.` or `model.` prefix is dropped. `BertConverter` is also the
base of the RoBERTa-type families (`roberta.py`), which differ only in their position numbering and defaults.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from pydantic import ValidationError

from moembed.errors import MoembedError, config_error
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
    architecture = "BertModel"  # written to config.json "architectures" on export
    prefix = r"^(bert|model)\."  # dropped from checkpoint names (task heads' wrappers)
    default_pad = 0  # pad_token_id when config.json has none (the transformers config class's default)

    def position_offset(self, pad_token_id: int) -> int:
        """The checkpoint's position-table row of the first token (BERT counts from 0)."""
        return 0

    def config_from_hf(self, cfg: dict, path: Path) -> EncoderConfig:
        file = path / "config.json"
        for key, want in (("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
            if cfg.get(key, want) != want:
                raise MoembedError(f"{file}: {key} {cfg[key]!r} is not supported (expected {want!r})")
        pad = cfg.get("pad_token_id")
        pad = self.default_pad if pad is None else pad
        table = cfg.get("max_position_embeddings", 512)
        if not isinstance(table, int) or table <= self.position_offset(pad):
            raise MoembedError(f"{file}: max_position_embeddings {table!r} leaves no positions after the "
                               f"{self.position_offset(pad)} rows the {self.model_type} family skips")
        try:
            return EncoderConfig(
                family="bert", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                intermediate_size=cfg["intermediate_size"], max_position=table - self.position_offset(pad),
                type_vocab_size=cfg.get("type_vocab_size", 2), pad_token_id=pad,
                layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_dropout=cfg.get("hidden_dropout_prob", 0.1),
                attention_dropout=cfg.get("attention_probs_dropout_prob", 0.1), hf_model_type=self.model_type,
            )
        except KeyError as e:
            raise MoembedError(f"{file}: missing key {e.args[0]!r}") from None
        except ValidationError as e:
            raise config_error(e, str(file)) from None

    def weights_from_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
        sd = {re.sub(self.prefix, "", k).replace(".gamma", ".weight").replace(".beta", ".bias"): v
              for k, v in sd.items()}
        out = {}
        skip = self.position_offset(config.pad_token_id)
        for k, v in sd.items():
            if k.startswith("embeddings.") and not k.endswith("position_ids"):
                mod, param = k.split(".")[1], k.split(".")[-1]
                if mod in _EMB:
                    # rows below the offset are never read by a real token (RoBERTa: padding_idx + 1 onwards)
                    out[f"embeddings.{_EMB[mod]}.{param}"] = v[skip:] if mod == "position_embeddings" else v
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

    def layouts(self, config: EncoderConfig) -> list[str]:
        return ["transformers"] if self.can_export(config) else []

    def hf_config(self, c: EncoderConfig) -> dict:
        return {
            "architectures": [self.architecture], "model_type": self.model_type, "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "intermediate_size": c.intermediate_size, "hidden_act": "gelu",
            "max_position_embeddings": c.max_position + self.position_offset(c.pad_token_id),
            "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_token_id,
            "hidden_dropout_prob": c.hidden_dropout, "attention_probs_dropout_prob": c.attention_dropout,
            "position_embedding_type": "absolute", "initializer_range": 0.02,
        }

    def weights_to_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
        inv_emb = {v: k for k, v in _EMB.items()}
        inv_layer = {v: k for k, v in _LAYER.items()}
        out = {}
        skip = self.position_offset(config.pad_token_id)
        for k, v in sd.items():
            v = v.contiguous()
            if k.startswith("embeddings."):
                _, mod, param = k.split(".")
                if mod == "position" and skip:  # the skipped rows are never read by a real token: zeros
                    v = torch.cat([v.new_zeros(skip, v.shape[1]), v])  # (offset + max_position, d)
                out[f"embeddings.{inv_emb[mod]}.{param}"] = v
                continue
            m = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", k)
            if not m:
                raise MoembedError(f"export: weight {k!r} has no {self.model_type} equivalent")
            i, mod, p = m.groups()
            if mod == "qkv":
                for n, part in zip(("query", "key", "value"), v.chunk(3, 0)):
                    out[f"encoder.layer.{i}.attention.self.{n}.{p}"] = part.contiguous()
            elif mod in inv_layer:
                out[f"encoder.layer.{i}.{inv_layer[mod]}.{p}"] = v
            else:
                raise MoembedError(f"export: weight {k!r} has no {self.model_type} equivalent")
        return out


CONVERTER = BertConverter()
