"""The training loop shared by the stages (mlm | contrastive | finetune; see stages.py).

`train(cfg)` picks the device (`device: auto | cpu | cuda | mps`, under torchrun each process on the GPU of its
LOCAL_RANK), joins the process group once when launched by torchrun, and drives a `Trainer` step by step.
One optimizer step per batch: there is no plain gradient accumulation for the contrastive stages, since
accumulating small batches shrinks the set of in-batch negatives; large contrastive batches come from GradCache
(`chunk_size`). Data parallelism: every rank draws the same global batch and keeps its slice; embeddings are
all-gathered inside the loss so negatives span all ranks; gradients are averaged over ranks in buckets whose
all-reduces overlap the last backward pass (what DDP does — done explicitly because a GradCache step runs several
forward passes per backward; `distributed.GradientSync`).

Outputs in `output_dir`: config.yaml (resolved), metrics.jsonl, checkpoints/step-*/ (atomic, last N kept),
plots/*.png, and the final model in the moembed format in model/.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from moembed import distributed as dist
from moembed.data.sources import SourceStats
from moembed.devices import resolve_device
from moembed.errors import MoembedError
from moembed.fileio import atomic_path
from moembed.train.build import build_model, check_paths
from moembed.train.checkpoint import CheckpointManager, rng_state
from moembed.train.config import TrainConfig
from moembed.train.optim import build_optimizer
from moembed.train.stages import STAGES

log = logging.getLogger("moembed")


def train_device(name: str) -> torch.device:
    """The device of this process for a config's `device`: a bare "cuda" means the GPU of torchrun's LOCAL_RANK."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", dist.local_rank())
    return device


class Metrics:
    """metrics.jsonl: one JSON object per logged step. On resume, records past the checkpoint are dropped."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        kept = []
        if resume_step is not None and path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if rec.get("step", 0) <= resume_step:
                    kept.append(line)
        with atomic_path(path) as tmp:
            tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        self.fh = open(path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        if self.enabled:
            self.fh.write(json.dumps(rec) + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.enabled:
            self.fh.close()


class Trainer:
    """One run's stage, model, optimizer, scheduler, data stream and checkpoints; `train()` drives it step by step.

    Building a Trainer runs no collective: under torchrun, `train()` joins the process group before and
    broadcasts rank 0's weights after.
    """

    def __init__(self, cfg: TrainConfig, progress: bool = True):
        check_paths(cfg)
        self.cfg, self.rank, self.world = cfg, dist.rank(), dist.world_size()
        self.main = self.rank == 0
        self.progress = progress and self.main
        self.device = train_device(cfg.device)
        self.out = Path(cfg.output_dir)
        self.stats = SourceStats()
        self.stage = STAGES[cfg.stage](cfg)
        self.module = self.stage.build_module(build_model(cfg))
        self.embedder = self.stage.embedder(self.module)
        self.stream = self.stage.build_stream(self.embedder.tokenizer, self.stats, self.rank, self.world)
        self.module.to(self.device).train()
        self.optimizer, self.scheduler = build_optimizer(self.module, cfg.optim, cfg.steps)
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint.keep_last)
        self.step, self.last_ckpt = 0, None
        torch.manual_seed(cfg.seed + self.rank)  # dropout differs per rank, reproducibly

    def train_step(self) -> tuple[dict, int]:
        """Forward, backward, checks, gradient sync, clip, optimizer and scheduler step. Returns (record, items)."""
        self.optimizer.zero_grad(set_to_none=True)
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.cfg.bf16 else nullcontext()
        with amp:
            rec, items = self.stage.step(self.module, self.stream, self.device, self.step, self.rank)
        if not math.isfinite(rec["loss"]):
            where = self.last_ckpt or "none written yet"
            raise MoembedError(
                f"step {self.step + 1}: loss is {rec['loss']} (source {rec['source']!r}); training stopped "
                f"before updating the weights. Last good checkpoint: {where}"
            )
        if self.cfg.optim.grad_clip:
            rec["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.optim.grad_clip))
        rec["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return rec, items

    # ---- checkpoints, eval, outputs -----------------------------------------------------------------------------

    def resume(self) -> int | None:
        latest = self.ckpt.latest()
        if latest is None:
            return None
        r = self.ckpt.load(latest, self.module, self.optimizer, self.scheduler, self.rank)
        self.stream.load_state(r.data_state)
        self.step, self.last_ckpt = r.step, latest
        log.info("resuming from %s (step %d)", latest, r.step)
        return r.step

    def save_checkpoint(self) -> None:
        rngs = dist.all_gather_object(rng_state())
        if self.main:
            meta = {"stage": self.stage.name, "world_size": self.world}
            self.last_ckpt = self.ckpt.save(self.step, self.module, self.optimizer, self.scheduler,
                                            self.stream.state(), meta, rngs)
        dist.barrier()

    def evaluate(self) -> dict:
        from moembed.eval import evaluate

        self.embedder.eval()
        try:
            results = evaluate(self.embedder, self.cfg.eval.tasks, batch_size=self.cfg.eval.batch_size)
        finally:
            self.module.train()
        return {r.task_name: r.main_score for r in results}

    def finish(self) -> Path:
        final = self.out / "model"
        if self.main:
            self.embedder.eval().save(final)
            self.stage.write_extras(self.module, final)
        dist.barrier()
        return final


def _write_config(cfg: TrainConfig, out: Path) -> None:
    with atomic_path(out / "config.yaml") as tmp:
        tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), encoding="utf-8")


def train(cfg: TrainConfig, progress: bool = True, resume: bool = True) -> Path:
    """Run (or resume) training; returns the final model directory. Raises MoembedError on bad input or NaN loss.

    Under torchrun: joins the process group (nccl on CUDA, gloo otherwise) and starts every rank from rank 0's
    weights."""
    dist.init_from_env("nccl" if train_device(cfg.device).type == "cuda" else "gloo")
    t = Trainer(cfg, progress)
    dist.broadcast_parameters(t.module)
    if not resume and t.ckpt.latest() is not None:
        raise MoembedError(f"{t.ckpt.dir}: holds checkpoints of an earlier run; remove it or resume instead of --fresh")
    start = t.resume() if resume else None
    if t.main:
        t.out.mkdir(parents=True, exist_ok=True)
        _write_config(cfg, t.out)
    metrics = Metrics(t.out / "metrics.jsonl", start if start is not None else 0, t.main)
    bar = tqdm(total=cfg.steps, initial=t.step, desc=cfg.stage, unit="step", disable=not t.progress)
    rate = None
    try:
        while t.step < cfg.steps:
            t0 = time.perf_counter()
            rec, items = t.train_step()
            dt = time.perf_counter() - t0
            rate = items / dt if rate is None else 0.9 * rate + 0.1 * items / dt
            unit = t.stage.rate_unit
            rec = {"step": t.step, **rec, unit: items / dt, "time": time.time()}
            if t.step % cfg.log_every == 0 or t.step == cfg.steps:
                metrics.write(rec)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", **{unit.split("_")[0] + "/s": f"{rate:.1f}"})
            bar.update(1)
            if t.step % cfg.checkpoint.every == 0 or t.step == cfg.steps:
                t.save_checkpoint()
            if cfg.eval.every and t.step % cfg.eval.every == 0:
                scores = t.evaluate()
                metrics.write({"step": t.step, "eval": scores})
                log.info("step %d eval: %s", t.step, scores)
        metrics.write({"step": t.step, "event": "end", "data": t.stats.as_dict()})
    finally:
        bar.close()
        metrics.close()
    _report_data(t.stats)
    final = t.finish()
    if t.main:
        from moembed.train.plots import write_plots

        write_plots(t.out / "metrics.jsonl", t.out / "plots")
    return final


def _report_data(stats: SourceStats) -> None:
    what = {
        "bad": "malformed records skipped",
        "empty": "records with an empty query, document or text dropped",
        "no_negatives": "records without negatives dropped",
    }
    for kind, text in what.items():
        counts = getattr(stats, kind)
        if sum(counts.values()):
            log.info("%s: %s", text, ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
