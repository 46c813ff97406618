"""sentence-transformers' module configs of a model directory: read every version's format, write one all read.

A sentence-transformers directory is a Hugging Face checkpoint plus `modules.json` (Transformer → Pooling →
optionally Normalize) and the configs of those modules:

    1_Pooling/config.json              the pooling mode, in one of two formats:
        2.x–5.x  {"word_embedding_dimension": d, "pooling_mode_cls_token": false, "pooling_mode_mean_tokens": true,
                  "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken", "include_prompt"}
        6.x      {"embedding_dimension": d, "pooling_mode": "mean", "include_prompt": true}
        (no boolean set means mean, as sentence-transformers reads it; several set, or a list of modes, means
        their vectors concatenated, which moembed refuses)
        include_prompt false: a prompt's tokens are left out of the pooling (`moembed.model.prompts`)
    2_Normalize/                       L2 normalisation of the pooled vector (a config file or none)
    sentence_bert_config.json          max_seq_length (6.x leaves it out: tokenizer_config.json's model_max_length)
    config_sentence_transformers.json  prompts, default_prompt_name, similarity_fn_name, model_type

A directory without modules.json (a bare Hugging Face checkpoint) is pooled as sentence-transformers builds it for
an encoder: mean pooling over all tokens, no normalisation, no prompts (`BARE`).

Written (`write_st_modules`): `word_embedding_dimension`, `include_prompt` and the booleans, which 6.x reads silently
(as `embedding_dimension` and one `pooling_mode`), plus the `pooling_mode` string, which 3.x–5.x also take (it
overrides their booleans) except "mean_sqrt_len_tokens", their assertion refuses: that mode is written as its boolean
only. The module names are `sentence_transformers.models.*`, which every version resolves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moembed.errors import MoembedError
from moembed.model.pooling import ST_POOLING
from moembed.model.similarity import SIMILARITY_FNS

# sentence-transformers 2.x–5.x boolean keys, in the order its Pooling concatenates them, → its mode names
LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
MOEMBED_TO_ST = {v: k for k, v in ST_POOLING.items()}
SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")
BARE = "bare checkpoint: mean, as sentence-transformers pools a directory without modules.json"


@dataclass
class StSettings:
    """What a directory's sentence-transformers files say (or a bare checkpoint's defaults)."""

    pooling: str = "mean"  # moembed's name (`moembed.model.pooling.POOLINGS`)
    origin: str = BARE  # where the pooling came from, as `moembed info` shows it
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str = "cosine"
    max_seq_length: int | None = None
    embedding_dimension: int | None = None  # as the pooling config states it, checked against the encoder
    include_prompt: bool = True  # False: a prompt's tokens are not pooled (`moembed.model.prompts`)


def read_json(path: Path):
    """A JSON file's value; a missing or malformed file is a MoembedError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MoembedError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoembedError(f"{path}: not valid JSON ({e})") from None


def read_st_settings(path: Path) -> StSettings:
    """The sentence-transformers settings of directory `path`; without modules.json, a bare checkpoint's."""
    if not (path / "modules.json").exists():
        return StSettings()
    pool_dir, normalize = _read_modules(path / "modules.json")
    out = _read_pooling(path / pool_dir / "config.json")
    out.normalize = normalize
    if (path / "sentence_bert_config.json").exists():
        out.max_seq_length = _read_max_length(path / "sentence_bert_config.json")
    if (path / "config_sentence_transformers.json").exists():
        _read_st_config(path / "config_sentence_transformers.json", out)
    return out


def _read_modules(file: Path) -> tuple[str, bool]:
    """(the Pooling module's directory, whether a Normalize follows) from modules.json; any other layout raises."""
    modules = read_json(file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise MoembedError(f"{file}: expected a list of module objects")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    for i, (m, kind) in enumerate(zip(modules, kinds)):
        if kind not in SUPPORTED_MODULES:
            raise MoembedError(f"{file}: module {i} has type {m.get('type')!r}, which moembed does not read; "
                               f"supported: {' → '.join(SUPPORTED_MODULES)} (Normalize optional)")
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise MoembedError(f"{file}: modules {' → '.join(kinds) or 'none'}; moembed reads Transformer → Pooling, "
                           "optionally → Normalize")
    pool_dir = modules[1].get("path")
    if not isinstance(pool_dir, str) or not pool_dir:
        raise MoembedError(f"{file}: module 1 (Pooling) has no 'path'")
    return pool_dir, len(kinds) == 3


def _read_pooling(file: Path) -> StSettings:
    """Either pooling format (module docstring) → moembed's mode; combinations and unknown modes raise."""
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise MoembedError(f"{file}: expected a JSON object")
    supported = ", ".join(ST_POOLING)
    if "pooling_mode" in cfg:
        key, mode = "pooling_mode", cfg["pooling_mode"]
        if isinstance(mode, list) and len(mode) == 1:
            mode = mode[0]
        if isinstance(mode, list):
            raise MoembedError(f"{file}: pooling_mode {mode!r} concatenates several poolings, which moembed does "
                               f"not support; one of: {supported}")
    else:  # every key the legacy booleans name is a mode moembed has
        keys = [k for k in LEGACY_KEYS if cfg.get(k)]
        if len(keys) > 1:
            raise MoembedError(f"{file}: {', '.join(keys)} are all true: concatenated poolings are not supported; "
                               "set one of them")
        # none set: sentence-transformers pools by mean
        key, mode = (keys[0], LEGACY_KEYS[keys[0]]) if keys else ("no pooling_mode_* set", "mean")
    if not isinstance(mode, str) or mode not in ST_POOLING:
        raise MoembedError(f"{file}: {key}: pooling mode {mode!r} is not supported; supported: {supported}")
    include_prompt = cfg.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise MoembedError(f"{file}: include_prompt: expected true or false, got {include_prompt!r}")
    dim = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
        raise MoembedError(f"{file}: embedding_dimension: expected an integer, got {dim!r}")
    return StSettings(pooling=ST_POOLING[mode], origin=f"{file.parent.name}/{file.name} ({key})",
                      embedding_dimension=dim, include_prompt=include_prompt)


def _read_max_length(file: Path) -> int | None:
    value = read_json(file)
    value = value.get("max_seq_length") if isinstance(value, dict) else None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise MoembedError(f"{file}: max_seq_length: expected a positive integer, got {value!r}")
    return value


def _read_st_config(file: Path, out: StSettings) -> None:
    """Prompts, default prompt name and similarity function of config_sentence_transformers.json into `out`."""
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise MoembedError(f"{file}: expected a JSON object")
    kind = cfg.get("model_type", "SentenceTransformer")
    if kind != "SentenceTransformer":
        raise MoembedError(f"{file}: model_type {kind!r}: moembed reads SentenceTransformer models (dense "
                           "embeddings) only")
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise MoembedError(f"{file}: prompts: expected an object of names to prefix strings")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise MoembedError(f"{file}: default_prompt_name {default!r} names no prompt; prompts: "
                           f"{', '.join(prompts) or 'none'}")
    sim = cfg.get("similarity_fn_name") or "cosine"
    if sim not in SIMILARITY_FNS:
        raise MoembedError(f"{file}: similarity_fn_name {sim!r} is not supported; supported: "
                           f"{', '.join(SIMILARITY_FNS)}")
    out.prompts, out.default_prompt_name, out.similarity_fn_name = dict(prompts), default, sim


def tokenizer_max_length(path: Path) -> int | None:
    """tokenizer_config.json's model_max_length (sentence-transformers 6.x keeps max_seq_length there), or None."""
    file = path / "tokenizer_config.json"
    if not file.exists():
        return None
    value = read_json(file)
    value = value.get("model_max_length") if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def write_st_modules(out: Path, first_type: str, *, hidden_size: int, pooling: str, normalize: bool,
                     max_length: int, prompts: dict[str, str] | None, default_prompt_name: str | None,
                     similarity_fn_name: str, version: str, include_prompt: bool = True) -> None:
    """modules.json (the first module in the root, then Pooling and Normalize) and the module configs, in the
    format every sentence-transformers version reads (module docstring)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": first_type},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    mode = MOEMBED_TO_ST[pooling]
    (out / "1_Pooling").mkdir()
    cfg = {"word_embedding_dimension": hidden_size, **{k: m == mode for k, m in LEGACY_KEYS.items()}}
    if mode != "mean_sqrt_len_tokens":  # the one mode 3.x–5.x do not take as a string
        cfg["pooling_mode"] = mode
    cfg["include_prompt"] = include_prompt
    (out / "1_Pooling" / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length, "do_lower_case": False}))
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "SentenceTransformer", "prompts": prompts, "default_prompt_name": default_prompt_name,
        "similarity_fn_name": similarity_fn_name, "__version__": {"moembed": version},
    }, indent=2) + "\n")
