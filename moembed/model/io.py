"""Model directories: moembed's own format, and conversion from/to Hugging Face BERT and sentence-transformers.

moembed format (a directory):
    config.json         {"format": "moembed", "version", "name", "encoder": {...}, "pooling", "normalize",
                         "prompts", "max_length"}
    model.safetensors   encoder weights (moembed names)
    tokenizer.json      (plus the source's other tokenizer files, kept for export)
    calibration.safetensors   optional sample of embeddings for int8 ranges
Weights are read only through safetensors, or `torch.load(weights_only=True)` for pytorch_model.bin.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moembed import __version__
from moembed.errors import MoembedError, config_error
from moembed.fileio import atomic_dir, recover_dir
from moembed.model.config import EncoderConfig
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder
from moembed.model.tokenizer import TextTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MoembedError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoembedError(f"{path}: not valid JSON ({e})") from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    st, binf = path / "model.safetensors", path / "pytorch_model.bin"
    try:
        if st.exists():
            return load_file(str(st))
        if binf.exists():
            return torch.load(binf, map_location="cpu", weights_only=True)
    except Exception as e:
        f = st if st.exists() else binf
        raise MoembedError(f"{f}: cannot read weights ({type(e).__name__}: {str(e)[:200]})") from None
    raise MoembedError(f"{path}: no model.safetensors or pytorch_model.bin")


# ---- Hugging Face BERT ↔ moembed names ---------------------------------------------------------------------------

_HF_LAYER = {
    "attention.output.dense": "out",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "output.LayerNorm": "norm2",
}
_HF_EMB = {
    "word_embeddings": "word",
    "position_embeddings": "position",
    "token_type_embeddings": "token_type",
    "LayerNorm": "norm",
}


def bert_config_from_hf(cfg: dict, path: Path) -> EncoderConfig:
    if cfg.get("model_type") != "bert":
        raise MoembedError(
            f"{path / 'config.json'}: model_type {cfg.get('model_type')!r} is not supported "
            "(moembed converts BERT checkpoints; other sentence-transformers models can still serve as teachers)"
        )
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


def weights_from_hf_bert(sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face BertModel state dict to moembed's encoder names (q, k, v fused into qkv)."""
    sd = {re.sub(r"^(bert|model)\.", "", k).replace(".gamma", ".weight").replace(".beta", ".bias"): v for k, v in sd.items()}
    out = {}
    for k, v in sd.items():
        if k.startswith("embeddings.") and not k.endswith("position_ids"):
            mod, param = k.split(".")[1], k.split(".")[-1]
            if mod in _HF_EMB:
                out[f"embeddings.{_HF_EMB[mod]}.{param}"] = v
        m = re.match(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$", k)
        if m and m.group(2) in _HF_LAYER:
            out[f"layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}.{m.group(3)}"] = v
    for i in range(config.num_layers):
        for p in ("weight", "bias"):
            parts = [sd.get(f"encoder.layer.{i}.attention.self.{n}.{p}") for n in ("query", "key", "value")]
            if all(t is not None for t in parts):
                out[f"layers.{i}.qkv.{p}"] = torch.cat(parts, 0)
    return out


def weights_to_hf_bert(sd: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
    """Inverse of `weights_from_hf_bert` (for dense BERT-style encoders)."""
    inv_emb = {v: k for k, v in _HF_EMB.items()}
    inv_layer = {v: k for k, v in _HF_LAYER.items()}
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


def _load_state(encoder: Encoder, sd: dict[str, torch.Tensor], source: Path) -> None:
    own = encoder.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise MoembedError(f"{source}: weights do not match the config ({what})")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise MoembedError(f"{source}: weight {k!r} has shape {tuple(v.shape)}, config expects {tuple(own[k].shape)}")
    encoder.load_state_dict(sd)


# ---- loading ----------------------------------------------------------------------------------------------------


def load_embedder(path: str | Path, max_length: int | None = None) -> Embedder:
    """Load a moembed directory, a sentence-transformers directory, or a Hugging Face BERT directory."""
    path = Path(path)
    recover_dir(path)  # a replacement of this directory interrupted by a kill (fileio: rename-aside fallback)
    if not path.is_dir():
        raise MoembedError(f"{path}: not a model directory")
    cfg = _read_json(path / "config.json")
    if cfg.get("format") == "moembed":
        return _load_moembed(path, cfg, max_length)
    return _load_hf(path, cfg, max_length)


def _load_moembed(path: Path, cfg: dict, max_length: int | None) -> Embedder:
    from pydantic import ValidationError

    try:
        config = EncoderConfig(**cfg["encoder"])
    except KeyError as e:
        raise MoembedError(f"{path / 'config.json'}: missing key {e.args[0]!r}") from None
    except ValidationError as e:
        raise config_error(e, str(path / "config.json"), "encoder.") from None
    encoder = Encoder(config)
    _load_state(encoder, _read_weights(path), path / "model.safetensors")
    tok = TextTokenizer.from_dir(path, max_length or cfg.get("max_length", config.max_position))
    calibration = None
    if (path / "calibration.safetensors").exists():
        calibration = load_file(str(path / "calibration.safetensors"))["embeddings"].numpy()
    emb = Embedder(
        encoder, tok, pooling=cfg.get("pooling", "mean"), normalize=cfg.get("normalize", True),
        prompts=cfg.get("prompts"), name=cfg.get("name", path.name), calibration=calibration,
    )
    emb.source_dir = path
    return emb.eval()


def _load_hf(path: Path, cfg: dict, max_length: int | None) -> Embedder:
    """A Hugging Face BERT directory, optionally wrapped as a sentence-transformers model (modules.json)."""
    pooling, normalize, prompts, st_max = "cls", False, {}, None
    if (path / "modules.json").exists():
        modules = _read_json(path / "modules.json")
        types = [m.get("type", "") for m in modules]
        normalize = any(t.endswith("Normalize") for t in types)
        pool_mod = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
        if pool_mod is not None:
            pc = _read_json(path / pool_mod["path"] / "config.json")
            if pc.get("pooling_mode_mean_tokens"):
                pooling = "mean"
            elif pc.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif pc.get("pooling_mode_lasttoken"):
                pooling = "last"
            else:
                raise MoembedError(f"{path / pool_mod['path'] / 'config.json'}: pooling mode not supported")
        if (path / "sentence_bert_config.json").exists():
            st_max = _read_json(path / "sentence_bert_config.json").get("max_seq_length")
        if (path / "config_sentence_transformers.json").exists():
            prompts = _read_json(path / "config_sentence_transformers.json").get("prompts") or {}
    config = bert_config_from_hf(cfg, path)
    encoder = Encoder(config)
    _load_state(encoder, weights_from_hf_bert(_read_weights(path), config), path)
    tok = TextTokenizer.from_dir(path, max_length or st_max or config.max_position)
    emb = Embedder(encoder, tok, pooling=pooling, normalize=normalize, prompts=prompts, name=path.name)
    emb.source_dir = path
    return emb.eval()


# ---- saving and export -------------------------------------------------------------------------------------------


def _copy_tokenizer(emb: Embedder, out: Path) -> None:
    src = getattr(emb, "source_dir", None)
    copied = False
    if src is not None:
        for f in TOKENIZER_FILES:
            if (Path(src) / f).exists():
                shutil.copy2(Path(src) / f, out / f)
                copied = copied or f == "tokenizer.json"
    if not copied:
        emb.tokenizer.save(out)


def write_moembed_files(emb: Embedder, out: Path) -> None:
    """Write the moembed files into an existing directory (callers make it atomic)."""
    cfg = {
        "format": "moembed", "version": __version__, "name": emb.name,
        "encoder": emb.config.model_dump(mode="json"), "pooling": emb.pooling, "normalize": emb.normalize,
        "prompts": emb.prompts, "max_length": emb.max_length,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sd = {k: v.detach().contiguous().cpu() for k, v in emb.encoder.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(emb, out)
    if emb.calibration is not None:
        save_file({"embeddings": torch.from_numpy(emb.calibration).contiguous()}, str(out / "calibration.safetensors"))


def save_embedder(emb: Embedder, path: str | Path) -> None:
    """Write the moembed format atomically (a temporary directory renamed into place)."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        write_moembed_files(emb, tmp)
    emb.source_dir = path


ST_MODULE = "moembed.model.st_module.MoembedEncoder"


def export_sentence_transformers(emb: Embedder, path: str | Path) -> None:
    """Write a directory that `SentenceTransformer(path)` loads.

    Dense BERT-style encoders become a standard Transformer (BertModel) module. Other encoders (MoE layers,
    rotary positions, SwiGLU) get moembed's own first module (`st_module.MoembedEncoder`, loaded with
    `trust_remote_code=True`) over the moembed files in the directory root; Pooling/Normalize are standard.
    """
    c = emb.config
    if c.moe is not None or c.position != "absolute" or c.mlp != "gelu" or getattr(c, "move", None) is not None:
        with atomic_dir(Path(path)) as tmp:
            write_moembed_files(emb, tmp)
            _write_st_modules(emb, tmp, ST_MODULE)
        return
    path = Path(path)
    with atomic_dir(path) as tmp:
        hf_cfg = {
            "architectures": ["BertModel"], "model_type": "bert", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "intermediate_size": c.intermediate_size, "hidden_act": "gelu", "max_position_embeddings": c.max_position,
            "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_token_id,
            "hidden_dropout_prob": c.hidden_dropout, "attention_probs_dropout_prob": c.attention_dropout,
            "position_embedding_type": "absolute", "initializer_range": 0.02,
        }
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        sd = weights_to_hf_bert({k: v.detach().cpu() for k, v in emb.encoder.state_dict().items()}, c)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _copy_tokenizer(emb, tmp)
        if not (tmp / "tokenizer_config.json").exists():
            (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "model_max_length": emb.max_length}))
        _write_st_modules(emb, tmp, "sentence_transformers.models.Transformer")


def _write_st_modules(emb: Embedder, tmp: Path, first_type: str) -> None:
    """modules.json (first module in the root, then Pooling and Normalize) and the sentence-transformers configs."""
    c = emb.config
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": first_type},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if emb.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (tmp / "2_Normalize").mkdir()
    (tmp / "modules.json").write_text(json.dumps(modules, indent=2))
    (tmp / "1_Pooling").mkdir()
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": c.hidden_size,
        "pooling_mode_cls_token": emb.pooling == "cls",
        "pooling_mode_mean_tokens": emb.pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_lasttoken": emb.pooling == "last",
    }, indent=2))
    (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": emb.max_length, "do_lower_case": False}))
    (tmp / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": emb.prompts, "default_prompt_name": None, "similarity_fn_name": "cosine",
        "__version__": {"moembed": __version__},
    }, indent=2))
