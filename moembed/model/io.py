"""Model directories ↔ model parts: config, weights, tokenizer and settings. Nothing here builds an Embedder.

`read_parts` reads a directory into a `ModelParts`; `Embedder.from_parts` assembles the model and
`Embedder.parts()` gives the parts back for `save_parts` and `export_sentence_transformers`.

moembed format:
    config.json         {"format": "moembed", "version", "name", "encoder": {...}, "pooling", "normalize",
                         "prompts", "max_length", "similarity_fn_name", "default_prompt_name", "include_prompt"}
    model.safetensors   encoder weights (moembed names)
    tokenizer.json      (plus the source's other tokenizer files, kept for export)
    calibration.safetensors   sample of embeddings for int8 ranges ("embeddings", (n, d) float32); every model
                        moembed trains or converts has one (docs/models.md); also read from and written to
                        Hugging Face and sentence-transformers directories, where other tools ignore it
Hugging Face directories (config.json with a `model_type` of `moembed.model.families`), optionally wrapped as a
sentence-transformers model (modules.json, read and written by `moembed.model.st_config`), are read through their
family's converter.
Weights are read only through safetensors, or `torch.load(weights_only=True)` for pytorch_model.bin.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from moembed.errors import MoembedError, config_error
from moembed.fileio import atomic_dir, atomic_path, recover_dir
from moembed.model.card import CardInfo, write_card
from moembed.model.config import EncoderConfig
from moembed.model.families import FAMILIES, converter_for, exporter_for
from moembed.model.pooling import POOLINGS
from moembed.model.st_config import read_json, read_st_settings, tokenizer_max_length, write_st_modules
from moembed.model.tokenizer import TextTokenizer
from moembed.version import __version__

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
ST_MODULE = "moembed.model.st_module.MoembedEncoder"
MOEMBED_ORIGIN = 'config.json "pooling"'
CALIBRATION_FILE = "calibration.safetensors"


@dataclass
class ModelParts:
    """What a model directory holds, as Python objects."""

    config: EncoderConfig
    state_dict: dict[str, torch.Tensor]  # encoder weights, moembed names
    tokenizer: TextTokenizer
    pooling: str = "mean"
    normalize: bool = True
    prompts: dict[str, str] | None = None  # None: the Embedder's default (Nomic prefixes)
    name: str = "moembed-model"
    calibration: np.ndarray | None = None  # (n, d) float32 sample for int8 ranges
    source_dir: Path | None = None  # tokenizer files are copied from here on save
    weights_path: Path | None = None  # where the weights were read from (named in errors)
    similarity_fn_name: str = "cosine"  # "cosine" | "dot", as sentence-transformers' config names it
    default_prompt_name: str | None = None  # the prompt `encode` applies when given none (a key of prompts)
    include_prompt: bool = True  # False: pooling leaves a prompt's tokens out (`moembed.model.prompts`)


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


# ---- reading ------------------------------------------------------------------------------------------------------


def read_parts(path: str | Path, max_length: int | None = None, pooling: str | None = None) -> ModelParts:
    """The parts of a moembed directory, a sentence-transformers directory, or a Hugging Face directory.
    pooling: replaces the directory's (`moembed.model.pooling.POOLINGS`), checked before the weights are read."""
    path = Path(path)
    recover_dir(path)  # a replacement of this directory interrupted by a kill (fileio: rename-aside fallback)
    if not path.exists():
        raise MoembedError(_not_local(path))
    if not path.is_dir():
        raise MoembedError(f"{path}: not a model directory (a file)")
    if pooling is not None and pooling not in POOLINGS:
        raise MoembedError(f"pooling: unknown mode {pooling!r}; choose one of {', '.join(POOLINGS)}")
    cfg = read_json(path / "config.json")
    parts = _read_moembed(path, cfg, max_length) if cfg.get("format") == "moembed" else _read_hf(path, cfg, max_length)
    if pooling is not None:
        parts.pooling = pooling
    return parts


def pooling_origin(path: str | Path) -> str:
    """Where a model directory's pooling comes from, read from its small config files only (`moembed info`)."""
    path = Path(path)
    if read_json(path / "config.json").get("format") == "moembed":
        return MOEMBED_ORIGIN
    return read_st_settings(path).origin


def _not_local(path: Path) -> str:
    """The message for a model name that is no local directory, e.g. a Hugging Face Hub name."""
    name = str(path)
    hub = "/" in name and not path.is_absolute() and not name.startswith(".") and len(path.parts) == 2
    what = f"{name!r} looks like a Hugging Face Hub name, but moembed" if hub else f"{name}: no such directory; moembed"
    return (f"{what} reads models from local directories only and never downloads. Download the model on a "
            f"machine with internet access, e.g. `hf download {name if hub else 'ORG/NAME'} --local-dir "
            f"DIR` or `SentenceTransformer({(name if hub else 'ORG/NAME')!r}).save('DIR')`, copy DIR here and pass "
            f"its path")


def _read_moembed(path: Path, cfg: dict, max_length: int | None) -> ModelParts:
    from pydantic import ValidationError

    try:
        config = EncoderConfig(**cfg["encoder"])
    except KeyError as e:
        raise MoembedError(f"{path / 'config.json'}: missing key {e.args[0]!r}") from None
    except ValidationError as e:
        raise config_error(e, str(path / "config.json"), "encoder.") from None
    sd = _read_weights(path)
    tok = TextTokenizer.from_dir(path, max_length or cfg.get("max_length", config.max_position))
    return ModelParts(config, sd, tok, pooling=cfg.get("pooling", "mean"), normalize=cfg.get("normalize", True),
                      prompts=cfg.get("prompts"), name=cfg.get("name", path.name),
                      calibration=read_calibration(path, config.hidden_size),
                      source_dir=path, weights_path=path / "model.safetensors",
                      similarity_fn_name=cfg.get("similarity_fn_name") or "cosine",
                      default_prompt_name=cfg.get("default_prompt_name"),
                      include_prompt=_include_prompt(cfg, path / "config.json"))


def _include_prompt(cfg: dict, file: Path) -> bool:
    value = cfg.get("include_prompt", True)
    if not isinstance(value, bool):
        raise MoembedError(f"{file}: include_prompt: expected true or false, got {value!r}")
    return value


def _read_hf(path: Path, cfg: dict, max_length: int | None) -> ModelParts:
    """A Hugging Face directory, optionally wrapped as a sentence-transformers model (modules.json; without one,
    pooled as sentence-transformers pools a bare checkpoint: `moembed.model.st_config`)."""
    st = read_st_settings(path)
    family = converter_for(cfg, path)
    config = family.config_from_hf(cfg, path)
    if st.embedding_dimension is not None and st.embedding_dimension != config.hidden_size:
        raise MoembedError(f"{path}: the Pooling config's embedding_dimension {st.embedding_dimension} differs from "
                           f"config.json's hidden size {config.hidden_size}")
    raw = _read_weights(path)
    _check_hf_shapes(raw, family, config, path)
    try:
        sd = family.weights_from_hf(raw, config)
    except MoembedError as e:  # a tensor that does not fit the config: name the directory it came from
        raise MoembedError(f"{path}: {e}") from None
    # sentence-transformers' maximum: max_seq_length, else the tokenizer's, capped at the position table
    tok_max = min(tokenizer_max_length(path) or config.max_position, config.max_position)
    tok = TextTokenizer.from_dir(path, max_length or st.max_seq_length or tok_max)
    return ModelParts(config, sd, tok, pooling=st.pooling, normalize=st.normalize, prompts=st.prompts,
                      name=path.name, source_dir=path, weights_path=path, similarity_fn_name=st.similarity_fn_name,
                      default_prompt_name=st.default_prompt_name, include_prompt=st.include_prompt,
                      calibration=read_calibration(path, config.hidden_size))


def read_calibration(path: Path, dim: int) -> np.ndarray | None:
    """The int8 calibration sample (n, dim) float32 stored in a model directory, or None; a bad file is named."""
    f = path / CALIBRATION_FILE
    if not f.exists():
        return None
    try:
        x = load_file(str(f))["embeddings"]
    except Exception as e:
        raise MoembedError(f"{f}: cannot read the calibration sample ({type(e).__name__}: {str(e)[:200]})") from None
    if x.dim() != 2 or x.shape[1] != dim or not x.is_floating_point() or not len(x):
        raise MoembedError(f"{f}: expected an (n, {dim}) float tensor 'embeddings' (the model's width), got "
                           f"{str(x.dtype).removeprefix('torch.')} {tuple(x.shape)}; delete it, then `moembed calibrate` writes a new one")
    return x.float().numpy()


def _check_hf_shapes(raw: dict[str, torch.Tensor], family, config: EncoderConfig, path: Path) -> None:
    """The first checkpoint tensor (file order) whose shape differs from what config.json implies raises, naming
    the tensor and both shapes. The expected shapes are the family's write-back of an encoder built on the meta
    device (no memory); a config the family cannot write back is left to `Embedder.from_parts`' check."""
    from moembed.model.encoder import Encoder

    if not family.can_export(config):
        return
    try:
        with torch.device("meta"):
            expected = family.weights_to_hf(Encoder.for_weights(config).state_dict(), config)
    except (NotImplementedError, RuntimeError):  # a write-back that needs real values: leave it to from_parts
        return
    for name, tensor in raw.items():
        key = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # older BERT LayerNorm names
        want = expected.get(key)
        if want is None:  # under a task head's prefix (`bert.`, `roberta.`, ...)
            want = next((v for k, v in expected.items() if key.endswith("." + k)), None)
        if want is not None and tuple(want.shape) != tuple(tensor.shape):
            file = next((path / f for f in ("model.safetensors", "pytorch_model.bin") if (path / f).exists()), path)
            raise MoembedError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, but {path / 'config.json'} "
                               f"implies {tuple(want.shape)}")


def check_state(own: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], source: Path | None) -> None:
    """Weights `sd` against an encoder's own state dict `own`: missing, unexpected or misshapen ones raise, naming
    `source` (the weights file) and the weight."""
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise MoembedError(f"{source}: weights do not match the config ({what})")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise MoembedError(f"{source}: weight {k!r} has shape {tuple(v.shape)}, config expects {tuple(own[k].shape)}")


# ---- writing ------------------------------------------------------------------------------------------------------


def _copy_tokenizer(parts: ModelParts, out: Path) -> None:
    copied = False
    if parts.source_dir is not None:
        for f in TOKENIZER_FILES:
            if (parts.source_dir / f).exists():
                shutil.copyfile(parts.source_dir / f, out / f)  # the content; the mode from the umask
                copied = copied or f == "tokenizer.json"
    if not copied:
        parts.tokenizer.save(out)


def write_parts(parts: ModelParts, out: Path) -> None:
    """Write the moembed files into an existing directory (callers make it atomic)."""
    cfg = {
        "format": "moembed", "version": __version__, "name": parts.name,
        "encoder": parts.config.model_dump(mode="json"), "pooling": parts.pooling, "normalize": parts.normalize,
        "prompts": parts.prompts, "max_length": parts.tokenizer.max_length,
        "similarity_fn_name": parts.similarity_fn_name, "default_prompt_name": parts.default_prompt_name,
        "include_prompt": parts.include_prompt,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sd = {k: v.detach().contiguous().cpu() for k, v in parts.state_dict.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(parts, out)
    _write_calibration(parts.calibration, out / CALIBRATION_FILE)


def _write_calibration(calibration: np.ndarray | None, file: Path) -> None:
    if calibration is not None:
        x = torch.from_numpy(np.ascontiguousarray(calibration, dtype=np.float32))
        save_file({"embeddings": x}, str(file))


def store_calibration(path: str | Path, calibration: np.ndarray) -> None:
    """Write (or replace) the calibration sample of an existing model directory of any format, atomically: the
    model's other files are left as they are (`moembed calibrate`)."""
    with atomic_path(Path(path) / CALIBRATION_FILE) as tmp:
        _write_calibration(calibration, tmp)


def save_parts(parts: ModelParts, path: str | Path, card: CardInfo | None = None) -> None:
    """Write the moembed format atomically (a temporary directory renamed into place), with its model card
    (`moembed.model.card`; `card`: what the caller knows of its training and evaluation)."""
    with atomic_dir(Path(path)) as tmp:
        write_parts(parts, tmp)
        write_card(parts, tmp, "moembed", card, Path(path))


def export_sentence_transformers(model, path: str | Path, card: CardInfo | None = None) -> None:
    """Write a directory that `SentenceTransformer(path)` loads, from `ModelParts` or a model with `parts()`.

    An encoder that a family's Hugging Face format holds (`moembed.model.families`; the family it was read from
    first) becomes a standard Transformer module in that layout. Other encoders (MoE layers, rotary positions,
    SwiGLU, MoVE) get moembed's own first module (`st_module.MoembedEncoder`, loaded with `trust_remote_code=True`)
    over the moembed files in the directory root; Pooling/Normalize are standard. A model card goes with it.
    """
    parts = model if isinstance(model, ModelParts) else model.parts()
    family = exporter_for(parts.config)
    with atomic_dir(Path(path)) as tmp:
        if family is None:
            write_parts(parts, tmp)
            _write_st_modules(parts, tmp, ST_MODULE)
        else:
            _write_hf(parts, family, tmp)
        write_card(parts, tmp, "sentence-transformers", card, Path(path))


def export_huggingface(model, path: str | Path, card: CardInfo | None = None) -> str:
    """Write the encoder in its family's own Hugging Face layout (`AutoModel.from_pretrained(path)` loads it without
    moembed), wrapped with the sentence-transformers files that keep its pooling, normalisation and prompts.
    Returns the family's model_type. An encoder no family can hold raises, saying what stands in the way."""
    parts = model if isinstance(model, ModelParts) else model.parts()
    family, layout = exporter_for(parts.config), {}
    if family is None:
        family, layout = _released_layout(parts.config)
    if family is None:
        raise MoembedError(f"export: {parts.name} has no Hugging Face layout ({_why_not_exportable(parts.config)}); "
                           "--format sentence-transformers writes it with moembed's own module")
    with atomic_dir(Path(path)) as tmp:
        _write_hf(parts, family, tmp, layout)
        write_card(parts, tmp, "huggingface", card, Path(path))
    return family.model_type


def _released_layout(config: EncoderConfig):
    """The family that wrote this encoder, when its released checkpoints' own layout (which transformers' classes do
    not read, e.g. nomic-embed-text-v2-moe's MoE layers) holds it exactly: (family, layout kwargs), else (None, {})."""
    family = FAMILIES.get(config.hf_model_type or "")
    if family is not None and "published" in family.layouts(config):
        return family, {"layout": "published"}
    return None, {}


def _why_not_exportable(c: EncoderConfig) -> str:
    reasons = [why for bad, why in ((c.moe is not None, f"MoE layers {[i + 1 for i in c.moe_layers()]}"),
                                    (c.move is not None, "a MoVE embedding layer"),
                                    (c.position != "absolute", f"{c.position} positions"),
                                    (c.mlp != "gelu", f"{c.mlp} MLPs")) if bad]
    return ", ".join(reasons) or "no family holds this configuration"


def _write_hf(parts: ModelParts, family, tmp: Path, layout: dict | None = None) -> None:
    """config.json and model.safetensors in `family`'s names (`layout`: the family's own layout option, if any),
    the tokenizer, and the sentence-transformers files."""
    layout = layout or {}
    (tmp / "config.json").write_text(json.dumps(family.hf_config(parts.config, **layout), indent=2) + "\n")
    sd = family.weights_to_hf({k: v.detach().cpu() for k, v in parts.state_dict.items()}, parts.config, **layout)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(parts, tmp)
    _write_calibration(parts.calibration, tmp / CALIBRATION_FILE)
    if not (tmp / "tokenizer_config.json").exists():
        (tmp / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": family.tokenizer_class, "model_max_length": parts.tokenizer.max_length})
        )
    _write_st_modules(parts, tmp, "sentence_transformers.models.Transformer")


def _write_st_modules(parts: ModelParts, tmp: Path, first_type: str) -> None:
    """modules.json, Pooling, Normalize and the sentence-transformers configs (`st_config.write_st_modules`)."""
    write_st_modules(tmp, first_type, hidden_size=parts.config.hidden_size, pooling=parts.pooling,
                     normalize=parts.normalize, max_length=parts.tokenizer.max_length, prompts=parts.prompts or {},
                     default_prompt_name=parts.default_prompt_name, include_prompt=parts.include_prompt,
                     similarity_fn_name=parts.similarity_fn_name,
                     version=__version__)
