"""NomicBERT checkpoints (`model_type: nomic_bert`): two layouts of one architecture ↔ moembed names.

A post-LayerNorm encoder with rotary positions (nomic-embed-v1 §4.1.2) whose checkpoints come in two layouts,
told apart by their config.json keys:

- "transformers": transformers' own NomicBertConfig (`hidden_size`, `num_hidden_layers`, `rope_parameters`,
  ...): SwiGLU MLPs and no biases.
- "published": the config of Nomic's released checkpoints (nomic-embed-text-v1/v1.5, nomic-embed-text-v2-moe;
  GPT-2-style keys `n_embd`, `n_layer`, `n_head`, `n_inner`, `rotary_emb_*`, `qkv_proj_bias`, ...), which also
  describes MoE layers.

The weights of both are named as in the published checkpoints (transformers' `save_pretrained` writes these names
too): `embeddings.word_embeddings`, `embeddings.token_type_embeddings`, `emb_ln`,
`encoder.layers.{i}.attn.Wqkv` / `attn.out_proj`, `norm1`, `norm2`, and per layer either a dense MLP
  (`mlp.fc11` up + `mlp.fc12` gate + `mlp.fc2` for SwiGLU, `mlp.fc1` + `mlp.fc2` for GELU) or, on every
  `moe_every_n_layers`-th layer counted from the second (layer i with i % n == 1), the MoE layer of
  nomic-embed-v2 §3.2 (megablocks' packing):
      mlp.router.layer.weight (E, d)       router, no bias          → mlp.router.weight
      mlp.experts.mlp.w1      (E·i, d)     expert e: rows e·i…      → mlp.experts.fc1_weight (E, i, d)
      mlp.experts.mlp.w2      (E·i, d)     expert e: rows e·i…      → mlp.experts.fc2_weight (E, d, i), transposed
      mlp.experts.bias        (d,)         one bias after the sum   → mlp.output_bias
  with softmax gates over all experts, top-k not renormalised (`moe_normalize_expert_weights: false`) and
  GELU experts without biases of their own. moembed's MoE block holds this with
  `MoEConfig(renormalize=False, expert_bias=False, output_bias=True, every=n, offset=1)`.

Reading also accepts transformers' module names (`layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{up,gate,down}_proj`,
`post_attention_layernorm`, `post_mlp_layernorm`, `embeddings.LayerNorm`), and checks every checkpoint tensor
against the shape its config implies, naming the first that differs.
Writing: `layouts(config)` lists the layouts that hold an encoder exactly; `can_export` (what
`families.exporter_for` asks) is true for the "transformers" layout only, the one `AutoModel` loads without
remote code; `hf_config` / `weights_to_hf` take the layout to write ("published" holds the MoE models).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import torch

from moembed.errors import MoembedError, config_error
from moembed.model.config import EncoderConfig, MoEConfig

Layout = Literal["transformers", "published"]  # the config.json dialect written
LAYOUTS: tuple[Layout, ...] = ("transformers", "published")
Naming = Literal["published", "native"]  # the tensor names: Nomic's checkpoints, or transformers' module names

# Checkpoint keys that are not part of the encoder (pretraining heads, pooler, cached buffers): ignored on read.
_IGNORED = re.compile(r"^(cls\.|lm_head\.|pooler\.)|(position_ids|inv_freq|token_type_ids)$")


def _get(cfg: dict, path: Path, key: str):
    if key not in cfg:
        raise MoembedError(f"{path / 'config.json'}: missing key {key!r}")
    return cfg[key]


def _config(path: Path, **fields) -> EncoderConfig:
    from pydantic import ValidationError

    try:
        return EncoderConfig(family="nomic", position="rotary", hf_model_type="nomic_bert", **fields)
    except ValidationError as e:
        raise config_error(e, str(path / "config.json")) from None


class NomicBertConverter:
    model_type = "nomic_bert"
    tokenizer_class = "BertTokenizer"

    # ---- reading ----------------------------------------------------------------------------------------------

    def config_from_hf(self, cfg: dict, path: Path) -> EncoderConfig:
        return self._published_config(cfg, path) if "n_embd" in cfg else self._transformers_config(cfg, path)

    def _transformers_config(self, cfg: dict, path: Path) -> EncoderConfig:
        where = path / "config.json"
        if cfg.get("hidden_act", "silu") != "silu":
            raise MoembedError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU needs 'silu')")
        d, heads = _get(cfg, path, "hidden_size"), _get(cfg, path, "num_attention_heads")
        if cfg.get("head_dim") not in (None, d // heads):
            raise MoembedError(f"{where}: head_dim {cfg['head_dim']} differs from hidden_size / num_attention_heads")
        rope = cfg.get("rope_parameters") or {}
        kind = rope.get("rope_type", "default")
        if kind not in ("default", "dynamic"):
            raise MoembedError(f"{where}: rope_parameters.rope_type {kind!r} is not supported (default, dynamic)")
        return _config(
            path, vocab_size=_get(cfg, path, "vocab_size"), hidden_size=d,
            num_layers=_get(cfg, path, "num_hidden_layers"), num_heads=heads,
            intermediate_size=_get(cfg, path, "intermediate_size"), mlp="swiglu", bias=False,
            max_position=cfg.get("max_position_embeddings", 2048), type_vocab_size=cfg.get("type_vocab_size", 2),
            pad_token_id=cfg.get("pad_token_id") or 0, layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_dropout=cfg.get("hidden_dropout_prob", 0.0),
            attention_dropout=cfg.get("attention_probs_dropout_prob", 0.0),
            rope_base=rope.get("rope_theta", cfg.get("rope_theta", 1000.0)),
            # transformers' "dynamic" rope is Eq. 5 of nomic-embed-v1 with α = factor (moembed: per sequence)
            dynamic_ntk=kind == "dynamic", ntk_alpha=rope.get("factor", 2.0) if kind == "dynamic" else 2.0,
        )

    def _published_config(self, cfg: dict, path: Path) -> EncoderConfig:
        where = path / "config.json"
        # Architecture switches of the remote code that moembed's encoder does not have: each must be off.
        for key, want in (("prenorm", False), ("parallel_block", False), ("use_rms_norm", False), ("causal", False),
                          ("rotary_emb_interleaved", False), ("rotary_emb_scale_base", None),
                          ("num_shared_experts", 0), ("expert_choice_router", False), ("ffn_div", 1)):
            if cfg.get(key, want) != want:
                raise MoembedError(f"{where}: {key} = {cfg[key]!r} is not supported (only {want!r})")
        if cfg.get("rotary_emb_fraction") != 1.0:
            raise MoembedError(f"{where}: rotary_emb_fraction {cfg.get('rotary_emb_fraction')!r} is not supported "
                               "(rotary positions on the whole head dimension, 1.0, only)")
        act = cfg.get("activation_function")
        if act not in ("swiglu", "gelu"):
            raise MoembedError(f"{where}: activation_function {act!r} is not supported (swiglu, gelu)")
        biases = {k: cfg.get(k, True) for k in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias")}
        if len(set(biases.values())) > 1:
            raise MoembedError(f"{where}: {biases} — moembed needs all three biases on or all off")
        d, layers = _get(cfg, path, "n_embd"), _get(cfg, path, "n_layer")
        scaling = cfg.get("rotary_scaling_factor")  # Dynamic NTK α when set (nomic-embed-v1 Eq. 5)
        return _config(
            path, vocab_size=_get(cfg, path, "vocab_size"), hidden_size=d, num_layers=layers,
            num_heads=_get(cfg, path, "n_head"), intermediate_size=cfg.get("n_inner") or 4 * d,
            mlp=act, bias=biases["qkv_proj_bias"],
            max_position=cfg.get("max_trained_positions", cfg.get("n_positions", 2048)),
            type_vocab_size=cfg.get("type_vocab_size", 2), pad_token_id=cfg.get("pad_token_id") or 0,
            layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5), hidden_dropout=cfg.get("resid_pdrop", 0.0),
            attention_dropout=cfg.get("attn_pdrop", 0.0), rope_base=cfg.get("rotary_emb_base", 10_000.0),
            dynamic_ntk=scaling is not None, ntk_alpha=scaling if scaling is not None else 2.0,
            moe=self._published_moe(cfg, path, layers, act),
        )

    @staticmethod
    def _published_moe(cfg: dict, path: Path, num_layers: int, act: str) -> MoEConfig | None:
        where = path / "config.json"
        every = cfg.get("moe_every_n_layers", 0) or 0
        if not cfg.get("num_experts") or every < 2 or num_layers < 2:
            return None  # the remote code's rule i % n == 1 selects no layer for n < 2
        if act != "gelu":
            raise MoembedError(f"{where}: MoE layers with activation_function {act!r} are not supported (gelu)")
        norm = cfg.get("moe_normalize_expert_weights") or 0
        if norm not in (0, 1):  # megablocks divides the top-k weights by their p-norm; p = 1 is the plain sum
            raise MoembedError(f"{where}: moe_normalize_expert_weights {norm!r} is not supported (false or 1)")
        try:
            return MoEConfig(num_experts=cfg["num_experts"], top_k=cfg.get("moe_top_k", 1), every=every, offset=1,
                             renormalize=norm == 1, expert_bias=False, output_bias=True)
        except ValueError as e:
            raise MoembedError(f"{where}: MoE settings: {e}") from None

    def weights_from_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (either naming, recognised from the names) → moembed names, after checking each
        tensor's shape against the config (MoembedError naming the first tensor that differs, and both shapes)."""
        sd = {re.sub(r"^(nomic_bert|bert|model)\.", "", k): v for k, v in sd.items() if not _IGNORED.search(k)}
        naming: Naming = "published" if any(k.startswith(("emb_ln.", "encoder.layers.")) for k in sd) else "native"
        expected = _shapes(config, naming)
        for name, shape in expected.items():
            if name not in sd:
                raise MoembedError(f"missing tensor {name!r} (shape {shape}) that config.json implies")
            if tuple(sd[name].shape) != shape:
                raise MoembedError(f"tensor {name!r} has shape {tuple(sd[name].shape)}, config.json implies {shape}")
        extra = [k for k in sd if k not in expected]
        if extra:
            raise MoembedError(f"unexpected tensor {extra[0]!r}: config.json describes no such weight")
        return {mine: _join(mine, [sd[p] for p in parts], config) for mine, parts in _rename(config, naming).items()}

    # ---- writing ----------------------------------------------------------------------------------------------

    def layouts(self, config: EncoderConfig) -> list[Layout]:
        """The layouts that hold an encoder of this config exactly."""
        c, out = config, []
        if c.position != "rotary" or c.move is not None:
            return out
        if (c.moe is None and c.mlp == "swiglu" and not c.bias and not c.dynamic_ntk and c.type_vocab_size > 0):
            out.append("transformers")  # Dynamic NTK off: transformers rescales by the batch's length, not the text's
        if c.moe is None or _published_moe_ok(c):
            out.append("published")
        return out

    def can_export(self, config: EncoderConfig) -> bool:
        """Dense, SwiGLU, no biases, no Dynamic NTK: what transformers' NomicBertModel holds without remote code."""
        return "transformers" in self.layouts(config)

    def hf_config(self, c: EncoderConfig, layout: Layout = "transformers") -> dict:
        self._check_layout(c, layout)
        if layout == "transformers":
            return {
                "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
                "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "hidden_act": "silu",
                "max_position_embeddings": c.max_position, "type_vocab_size": c.type_vocab_size,
                "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_token_id,
                "hidden_dropout_prob": c.hidden_dropout, "attention_probs_dropout_prob": c.attention_dropout,
                "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base}, "initializer_range": 0.02,
            }
        out = {
            "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
            # Where the published checkpoints take their modelling code from (loaded with trust_remote_code).
            "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                         "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
            "vocab_size": c.vocab_size, "n_embd": c.hidden_size, "n_layer": c.num_layers, "n_head": c.num_heads,
            "n_inner": c.intermediate_size, "n_positions": c.max_position, "max_trained_positions": c.max_position,
            "activation_function": c.mlp, "qkv_proj_bias": c.bias, "mlp_fc1_bias": c.bias, "mlp_fc2_bias": c.bias,
            "rotary_emb_fraction": 1.0, "rotary_emb_base": c.rope_base, "rotary_emb_interleaved": False,
            "rotary_emb_scale_base": None, "rotary_scaling_factor": c.ntk_alpha if c.dynamic_ntk else None,
            "prenorm": False, "parallel_block": False, "use_rms_norm": False, "causal": False,
            "layer_norm_epsilon": c.layer_norm_eps, "type_vocab_size": c.type_vocab_size,
            "pad_token_id": c.pad_token_id, "resid_pdrop": c.hidden_dropout, "embd_pdrop": c.hidden_dropout,
            "attn_pdrop": c.attention_dropout,
        }
        if c.moe is not None:
            out.update({
                "num_experts": c.moe.num_experts, "moe_top_k": c.moe.top_k, "moe_every_n_layers": c.moe.every,
                "moe_normalize_expert_weights": 1 if c.moe.renormalize else False, "num_shared_experts": 0,
                "expert_choice_router": False, "ffn_div": 1, "moe_impl": "megablocks",
                "moe_resid_pdrop": c.hidden_dropout,
            })
        return out

    def weights_to_hf(self, sd: dict[str, torch.Tensor], config: EncoderConfig,
                      layout: Layout = "transformers") -> dict[str, torch.Tensor]:
        """Inverse of `weights_from_hf`: the published tensor names, whichever config dialect `layout` writes."""
        self._check_layout(config, layout)
        names = _rename(config, "published")
        extra = [k for k in sd if k not in names]
        if extra:
            raise MoembedError(f"export: weight {extra[0]!r} has no NomicBERT equivalent")
        out = {}
        for mine, v in sd.items():
            for name, part in zip(names[mine], _split(mine, v.detach(), config, len(names[mine]))):
                out[name] = part.contiguous()
        return out

    def _check_layout(self, config: EncoderConfig, layout: Layout) -> None:
        if layout not in self.layouts(config):
            raise MoembedError(f"export: this encoder does not fit the {layout!r} NomicBERT layout "
                               f"(it fits: {', '.join(self.layouts(config)) or 'none'})")


def _published_moe_ok(c: EncoderConfig) -> bool:
    """Whether the MoE layers are those of the published layout: GELU experts without biases, one shared output
    bias, on layers i % every == 1 (every ≥ 2)."""
    m = c.moe
    expert_bias = c.bias if m.expert_bias is None else m.expert_bias
    pattern = [i for i in range(c.num_layers) if i % m.every == 1] if m.every >= 2 else None
    return (c.mlp == "gelu" and not expert_bias and m.output_bias and pattern is not None
            and c.moe_layers() == pattern)


def _rename(c: EncoderConfig, naming: Naming) -> dict[str, list[str]]:
    """moembed name → the checkpoint tensors it is made of (several when fused: qkv, SwiGLU up + gate)."""
    ps = ["weight", "bias"] if c.bias else ["weight"]
    if naming == "native":  # transformers' NomicBertModel has no biases on its linear layers
        names = {"embeddings.word.weight": ["embeddings.word_embeddings.weight"],
                 "embeddings.token_type.weight": ["embeddings.token_type_embeddings.weight"],
                 "embeddings.norm.weight": ["embeddings.LayerNorm.weight"],
                 "embeddings.norm.bias": ["embeddings.LayerNorm.bias"]}
        for i in range(c.num_layers):
            p = f"layers.{i}."
            names[p + "qkv.weight"] = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
            names[p + "out.weight"] = [p + "self_attn.o_proj.weight"]
            names[p + "mlp.fc1.weight"] = [p + "mlp.up_proj.weight", p + "mlp.gate_proj.weight"]
            names[p + "mlp.fc2.weight"] = [p + "mlp.down_proj.weight"]
            for n in ("weight", "bias"):
                names[p + f"norm1.{n}"] = [p + f"post_attention_layernorm.{n}"]
                names[p + f"norm2.{n}"] = [p + f"post_mlp_layernorm.{n}"]
        return names
    names = {"embeddings.word.weight": ["embeddings.word_embeddings.weight"],
             "embeddings.norm.weight": ["emb_ln.weight"], "embeddings.norm.bias": ["emb_ln.bias"]}
    if c.type_vocab_size:
        names["embeddings.token_type.weight"] = ["embeddings.token_type_embeddings.weight"]
    moe = set(c.moe_layers())
    for i in range(c.num_layers):
        p, q = f"layers.{i}.", f"encoder.layers.{i}."
        for n in ps:
            names[p + f"qkv.{n}"] = [q + f"attn.Wqkv.{n}"]
            names[p + f"out.{n}"] = [q + f"attn.out_proj.{n}"]
        for n in ("weight", "bias"):
            names[p + f"norm1.{n}"] = [q + f"norm1.{n}"]
            names[p + f"norm2.{n}"] = [q + f"norm2.{n}"]
        if i in moe:
            names[p + "mlp.router.weight"] = [q + "mlp.router.layer.weight"]
            names[p + "mlp.experts.fc1_weight"] = [q + "mlp.experts.mlp.w1"]
            names[p + "mlp.experts.fc2_weight"] = [q + "mlp.experts.mlp.w2"]
            names[p + "mlp.output_bias"] = [q + "mlp.experts.bias"]
            continue
        for n in ps:
            swiglu = c.mlp == "swiglu"  # up (fc11) and gate (fc12) rows, in moembed's SwiGLU fc1 order
            names[p + f"mlp.fc1.{n}"] = [q + f"mlp.fc11.{n}", q + f"mlp.fc12.{n}"] if swiglu else [q + f"mlp.fc1.{n}"]
            names[p + f"mlp.fc2.{n}"] = [q + f"mlp.fc2.{n}"]
    return names


def _shapes(c: EncoderConfig, naming: Naming) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name → the shape the config implies, in checkpoint order (embeddings, then layers)."""
    d, i, E = c.hidden_size, c.intermediate_size, c.moe.num_experts if c.moe else 0
    out = {}
    for mine, parts in _rename(c, naming).items():
        for name in parts:
            if name.endswith(("mlp.w1", "mlp.w2")):
                out[name] = (E * i, d)  # experts packed along the rows, each (i, d)
            elif name.endswith("router.layer.weight"):
                out[name] = (E, d)
            elif mine.endswith("qkv.weight") and len(parts) == 1:
                out[name] = (3 * d, d)
            elif mine.endswith("qkv.bias"):
                out[name] = (3 * d,)
            elif mine.endswith(("qkv.weight", "out.weight")):
                out[name] = (d, d)
            elif mine.endswith("mlp.fc1.weight"):
                out[name] = (i, d)
            elif mine.endswith("mlp.fc1.bias"):
                out[name] = (i,)
            elif mine.endswith("mlp.fc2.weight"):
                out[name] = (d, i)
            elif mine == "embeddings.word.weight":
                out[name] = (c.vocab_size, d)
            elif mine == "embeddings.token_type.weight":
                out[name] = (c.type_vocab_size, d)
            else:  # norms, output biases, fc2 / out_proj biases
                out[name] = (d,)
    return out


def _join(mine: str, parts: list[torch.Tensor], c: EncoderConfig) -> torch.Tensor:
    """The moembed tensor from its checkpoint tensors (shapes already checked)."""
    E, i, d = (c.moe.num_experts if c.moe else 0), c.intermediate_size, c.hidden_size
    if mine.endswith("experts.fc1_weight"):
        return parts[0].reshape(E, i, d)  # (E·i, d) → (E, i, d): expert e's fc1 weight
    if mine.endswith("experts.fc2_weight"):
        return parts[0].reshape(E, i, d).transpose(1, 2).contiguous()  # → (E, d, i): as a dense fc2 weight
    return torch.cat(parts, 0) if len(parts) > 1 else parts[0]  # qkv: q, k, v rows; SwiGLU fc1: up, gate rows


def _split(mine: str, v: torch.Tensor, c: EncoderConfig, n: int) -> list[torch.Tensor]:
    """Inverse of `_join`."""
    if mine.endswith("experts.fc1_weight"):
        return [v.reshape(-1, c.hidden_size)]  # (E, i, d) → (E·i, d)
    if mine.endswith("experts.fc2_weight"):
        return [v.transpose(1, 2).reshape(-1, c.hidden_size)]  # (E, d, i) → (E, i, d) → (E·i, d)
    return list(v.chunk(n, 0)) if n > 1 else [v]


CONVERTER = NomicBertConverter()
