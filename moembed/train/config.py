"""The training configuration: one typed, validated YAML document per run, with `key=value` overrides.

    stage: contrastive            # mlm | contrastive | finetune
    model: path/to/init           # a model directory, or a preset name (moembed.model.presets) for from-scratch training
    data: [{path: train.jsonl, query_prefix: "search_query: ", document_prefix: "search_document: "}]
    batch_size: 256               # global batch (all ranks together)
    loss: {temperature: 0.02}
    optim: {lr: 2.0e-5, schedule: linear, warmup_steps: 400}
    steps: 1000

Every section forbids unknown keys; `load_config` turns any schema error into one MoembedError line naming the key
(e.g. `optim.lr: Input should be a valid number`) before any data or weights are touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moembed.data.config import SamplerConfig, SourceConfig
from moembed.errors import MoembedError, config_error
from moembed.fileio import read_yaml
from moembed.losses.config import LossConfig

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OptimConfig(_Strict):
    lr: float = Field(2e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)  # max global grad norm; null disables clipping
    schedule: Literal["constant", "linear", "cosine", "inverse_sqrt", "wsd"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    decay_fraction: float = Field(0.2, gt=0, le=1)  # wsd: the last fraction of steps decays linearly
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # floor of linear/cosine/wsd decay, as a fraction of lr
    router_lr_scale: float = Field(1.0, gt=0)  # the MoE routers' peak lr as a multiple of lr (optim.param_groups)


class CheckpointConfig(_Strict):
    dir: str | None = None  # default: <output_dir>/checkpoints
    every: int = Field(1000, ge=1)
    keep_last: int = Field(2, ge=1)


class EvalConfig(_Strict):
    every: int = Field(0, ge=0)  # 0: never
    tasks: list[str] = []  # BEIR-style task directories (moembed.eval)
    batch_size: int = Field(64, ge=1)


class MLMConfig(_Strict):
    mask_prob: float = Field(0.3, gt=0, lt=1)  # nomic-embed-v1 §4.1: 30% instead of BERT's 15%
    seq_len: int = Field(128, ge=8)  # packed sequence length (Nomic v2 Table 2: 2048)
    lang_alpha: float = Field(0.3, gt=0, le=1)  # p(lang) ∝ n^α (Nomic v2 Table 2, XLM-R)
    to_rotary: bool = False  # convert an absolute-position model to rotary first (Nomic v2 §4.1)
    aux_loss_coef: float = Field(0.0, ge=0)  # MoE load balancing during MLM


class TrainConfig(_Strict):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    stage: Literal["mlm", "contrastive", "finetune"] = "contrastive"
    model: str
    tokenizer: str | None = None  # tokenizer directory for preset (from-scratch) models
    model_config_overrides: dict[str, Any] = {}  # keyword arguments of the preset builder
    data: list[SourceConfig] = Field(min_length=1)
    sampler: SamplerConfig = SamplerConfig()
    batch_size: int = Field(32, ge=1)
    chunk_size: int | None = Field(None, ge=1)  # GradCache chunk (Gao et al. 2021); null: plain step
    # Keep each MLP's (and expert's) fc1 output for backward, not its activation's, and recompute the activation
    # there: one (tokens, intermediate) tensor less per MLP for one elementwise pass (moembed.model.recompute).
    recompute_activations: bool = True
    max_query_length: int = Field(64, ge=2)
    max_doc_length: int = Field(256, ge=2)
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    steps: int = Field(ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # auto: cuda, then mps, else cpu (moembed.devices)
    bf16: bool = False
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_every: int = Field(10, ge=1)
    eval: EvalConfig = EvalConfig()
    output_dir: str
    skip_bad: bool = False
    # Steps with a non-finite loss or gradient (on any rank) that are skipped, every rank together, before the run
    # stops at the next one; 0: stop at the first (loop.Trainer.train_step).
    skip_nonfinite: int = Field(0, ge=0)
    mlm: MLMConfig = MLMConfig()

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        names = [s.label for s in self.data]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"data: duplicate source names {dup}; give each a distinct `name`")
        if self.chunk_size is not None and self.chunk_size > self.batch_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must not exceed batch_size ({self.batch_size})")
        if self.stage == "mlm" and self.loss.balance_window > 1:
            raise ValueError("loss.balance_window: the mlm stage balances each step's batch (mlm.aux_loss_coef); the "
                             "window is for the contrastive stages")
        return self

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.output_dir) / "checkpoints"


# ---- loading --------------------------------------------------------------------------------------------------


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise MoembedError(f"override {item!r}: expected key=value (e.g. optim.lr=1e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _set(doc: dict, path: list[str], value: Any, item: str) -> None:
    node: Any = doc
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise MoembedError(f"override {item!r}: {'.'.join(path[:i + 1])}: no such list item")
            part = int(part)
        elif not isinstance(node, dict):
            raise MoembedError(f"override {item!r}: {'.'.join(path[:i])} is not a section")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}
            node = node[part]


def load_config(path: str | Path | None, overrides: list[str] | None = None, base: dict | None = None) -> TrainConfig:
    """Read a YAML config (or start from `base`), apply dotted `key=value` overrides, validate.

    Override values are parsed as YAML (`optim.lr=1e-4`, `bf16=true`, `loss.matryoshka_dims=[768,256]`);
    list items are addressed by index (`data.0.weight=2`). Errors name the file and the key.
    """
    where = str(path) if path is not None else "config"
    doc: Any = dict(base or {})
    if path is not None:
        doc = read_yaml(path)
    if not isinstance(doc, dict):
        raise MoembedError(f"{where}: expected a mapping of keys at the top level")
    for item in overrides or []:
        keys, value = _parse_override(item)
        _set(doc, keys, value, item)
    try:
        return TrainConfig.model_validate(doc)
    except ValidationError as e:
        raise config_error(e, where) from None
