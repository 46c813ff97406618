"""What the model card of a trained model says of its training (`moembed.model.card`): the recipe and the data.

The recipe is the resolved training config in a table (stage, initial model, loss, steps, batch, optimiser,
lengths, MoE losses) with the whole config.yaml beside it, so the run can be repeated; the data is each source's
file, its records (as the sampler counted them) and how many of them training read.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from moembed.data.sources import SourceStats
from moembed.model.card import CardInfo, table
from moembed.train.config import TrainConfig


def training_card(cfg: TrainConfig, sizes: dict[str, int], stats: SourceStats, moe: bool) -> CardInfo:
    """The CardInfo of the model `moembed train` saves. sizes: records per source label (as the sampler counted
    them); stats: what the run read; moe: whether the model has MoE layers (its auxiliary losses are named)."""
    return CardInfo(datasets=[s.label for s in cfg.data], training=recipe(cfg, moe), data=data(cfg, sizes, stats))


def recipe(cfg: TrainConfig, moe: bool) -> str:
    """The recipe table and the full config (markdown)."""
    loss, o = cfg.loss, cfg.optim
    if cfg.stage == "mlm":
        objective = (f"masked language modelling, {cfg.mlm.mask_prob:.0%} of tokens masked, sequences of "
                     f"{cfg.mlm.seq_len}")
    else:
        objective = (f"InfoNCE, temperature {loss.temperature}, {loss.num_hard_negatives} hard negatives per query"
                     f"{', symmetric' if loss.symmetric else ''}"
                     f"{f', Matryoshka dimensions {loss.matryoshka_dims}' if loss.matryoshka_dims else ''}")
    rows = [("stage", f"`{cfg.stage}`"), ("initial model", f"`{cfg.model}`"), ("loss", objective),
            ("steps", cfg.steps),
            ("batch size", f"{cfg.batch_size}{f' (GradCache chunks of {cfg.chunk_size})' if cfg.chunk_size else ''}"),
            ("learning rate", f"{o.lr:g}, {o.schedule} schedule, {o.warmup_steps} warm-up steps, weight decay "
                              f"{o.weight_decay:g}"),
            ("seed", cfg.seed)]
    if cfg.stage != "mlm":
        rows.append(("max length", f"queries {cfg.max_query_length}, documents {cfg.max_doc_length} tokens"))
    if moe:
        coef = cfg.mlm.aux_loss_coef if cfg.stage == "mlm" else loss.aux_loss_coef
        rows.append(("MoE losses", f"load balancing α {coef:g}, router z-loss {loss.z_loss_coef:g}"))
    config = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).strip()
    return (f"Trained with `moembed train`.\n\n{table(('setting', 'value'), rows)}\n\n"
            f"The config (config.yaml of the run):\n\n```yaml\n{config}\n```")


def data(cfg: TrainConfig, sizes: dict[str, int], stats: SourceStats) -> str:
    """One row per source: its name, file, records and records read (markdown)."""
    rows = [(s.label, f"`{Path(s.path).name}`", f"{sizes.get(s.label, 0):,}", f"{stats.read.get(s.label, 0):,}")
            for s in cfg.data]
    return table(("source", "file", "records", "records read"), rows)
