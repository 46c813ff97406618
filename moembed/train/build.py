"""Building a run's model and data stream from its TrainConfig (everything checked before training starts)."""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError

from moembed.data.batching import PairBatchStream
from moembed.data.check import DataCheck, check_data
from moembed.data.sources import PairSource, SourceStats, TextSource
from moembed.errors import MoembedError, config_error
from moembed.model.config import EncoderConfig
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder
from moembed.model.presets import PRESETS, build_preset
from moembed.model.tokenizer import TextTokenizer
from moembed.train.config import TrainConfig


def check_paths(cfg: TrainConfig) -> None:
    """Refuse missing model, tokenizer and data paths before any work (errors name the key)."""
    if cfg.model not in PRESETS and not Path(cfg.model).is_dir():
        raise MoembedError(f"model: {cfg.model!r} is neither a model directory nor a preset ({', '.join(PRESETS)})")
    if cfg.model in PRESETS:
        if cfg.tokenizer is None:
            raise MoembedError(f"tokenizer: required when model is the preset {cfg.model!r}")
        if not Path(cfg.tokenizer).is_dir():
            raise MoembedError(f"tokenizer: {cfg.tokenizer}: not a directory")
    for i, s in enumerate(cfg.data):
        if not Path(s.path).exists():
            raise MoembedError(f"data.{i}.path: {s.path}: no such file or directory")
    if cfg.eval.every and not cfg.eval.tasks:
        raise MoembedError("eval.tasks: empty while eval.every is set")
    for i, t in enumerate(cfg.eval.tasks):
        if not Path(t).is_dir():
            raise MoembedError(f"eval.tasks.{i}: {t}: not a task directory")


def check_training_data(cfg: TrainConfig) -> DataCheck:
    """Read every record of every data source before step 1 (moembed.data.check): malformed records raise, all
    of them listed up to a cap, unless `skip_bad` (then counted and skipped)."""
    return check_data(cfg.data, text=cfg.stage == "mlm", skip_bad=cfg.skip_bad)


def preset_config(cfg: TrainConfig, tok: TextTokenizer) -> EncoderConfig:
    """The preset's EncoderConfig with the tokenizer's vocabulary and `model_config_overrides` applied."""
    try:
        return build_preset(cfg.model, tok.vocab_size, cfg.model_config_overrides)
    except ValidationError as e:
        raise config_error(e, "model_config_overrides") from None


def build_model(cfg: TrainConfig) -> Embedder:
    """Load the model to start from, or build a preset from scratch (seeded by `cfg.seed`)."""
    max_len = max(cfg.max_query_length, cfg.max_doc_length)
    if cfg.model not in PRESETS:
        return Embedder.load(cfg.model)
    tok = TextTokenizer.from_dir(Path(cfg.tokenizer), max_length=max_len)
    torch.manual_seed(cfg.seed)
    return Embedder(Encoder(preset_config(cfg, tok)), tok, pooling="mean", name=Path(cfg.output_dir).name,
                    source_dir=cfg.tokenizer)


def build_pair_stream(cfg: TrainConfig, stats: SourceStats, rank: int = 0, world: int = 1) -> PairBatchStream:
    # Every rank passes the same seed, so all ranks read records in the same order and draw the same global batch.
    check_training_data(cfg)  # every record, before the first step and the first checkpoint
    sources = [PairSource(s, stats, cfg.skip_bad, cfg.seed) for s in cfg.data]
    try:
        return PairBatchStream(sources, cfg.batch_size, cfg.loss.num_hard_negatives, cfg.sampler.temperature,
                               cfg.seed, stats, rank, world)
    except ValueError as e:
        raise MoembedError(f"batch_size: {e}") from None


def build_text_stream(cfg: TrainConfig, tok: TextTokenizer, stats: SourceStats, rank: int = 0, world: int = 1):
    from moembed.train.mlm import PackedTextStream

    check_training_data(cfg)  # every record, before the first step and the first checkpoint
    sources = [TextSource(s, stats, cfg.skip_bad, cfg.seed) for s in cfg.data]  # same seed on every rank
    try:
        return PackedTextStream(sources, tok, cfg.batch_size, cfg.mlm.seq_len, cfg.mlm.lang_alpha, cfg.seed, stats,
                                rank, world)
    except ValueError as e:
        raise MoembedError(f"batch_size: {e}") from None
