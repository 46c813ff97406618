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
plots/*.png, and the final model in the moembed format in model/, with an int8 calibration sample of its own
training texts (`moembed.model.calibration`) and a model card giving the recipe and the data (`train.card`).
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
from moembed.heap import allocator
from moembed.model import backends
from moembed.model.recompute import set_recompute
from moembed.train.build import build_model, check_paths
from moembed.train.card import training_card
from moembed.train.checkpoint import CheckpointManager, rng_state
from moembed.train.config import TrainConfig
from moembed.train.optim import build_optimizer
from moembed.train.row_grads import RowGradients
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


def update_balance_biases(blocks) -> None:
    """Auxiliary-loss-free balancing (`MoEConfig.balance_rate`): each block's selection bias moves by
    u · sign(mean load − load), the load counted over this step's forward passes on every rank."""
    from moembed.losses.moe_aux import balance_bias_step

    for m in blocks:
        counts = dist.all_reduce_sum(m.balance_counts.clone())  # (E,) all ranks
        m.balance_bias += balance_bias_step(counts, m.balance_rate).to(m.balance_bias)


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
        set_recompute(self.module, cfg.recompute_activations)
        self.embedder = self.stage.embedder(self.module)
        self.stream = self.stage.build_stream(self.embedder.tokenizer, self.stats, self.rank, self.world)
        self.module.to(self.device).train()
        # grouped expert matmuls where torch has the kernel for this device and precision (moembed.model.backends)
        backends.for_training(self.module, self.device, torch.bfloat16 if cfg.bf16 else torch.float32)
        self.optimizer, self.scheduler = build_optimizer(self.module, cfg.optim, cfg.steps)
        # Embedding tables' gradients from the rows each step looked up, written after its backward (bitwise the
        # same; train/row_grads.py). One process only: the gradient sync of several waits on autograd's own path.
        self.row_grads = RowGradients(self.module) if self.world == 1 else None
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint.keep_last)
        self.step, self.last_ckpt, self.skipped = 0, None, 0
        torch.manual_seed(cfg.seed + self.rank)  # dropout differs per rank, reproducibly

    def train_step(self) -> tuple[dict, int]:
        """Forward, backward, gradient sync, the non-finite check, clip, optimizer and scheduler step.

        Returns (record, items). A step whose loss or gradients are not finite on any rank updates no rank: every
        rank takes the same decision from the same all-reduced numbers (`_nonfinite`). Within the
        `skip_nonfinite` budget the step is skipped (its batch is consumed, the schedule advances, weights and
        optimizer state stay; the record is an event "skipped"); beyond it every rank raises the same
        MoembedError naming the step, the rank(s) and the last good checkpoint.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.row_grads is not None:
            self.row_grads.discard()  # sums left by a step that raised
        balancing = [m for m in self.module.modules() if getattr(m, "balance_rate", 0) > 0]
        for m in balancing:
            m.balance_counts.zero_()
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.cfg.bf16 else nullcontext()
        with amp:
            rec, items = self.stage.step(self.module, self.stream, self.device, self.step, self.rank)
        if self.row_grads is not None:
            self.row_grads.flush()
        rank_loss = rec.pop("rank_loss", rec["loss"])
        params = [p for p in self.module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])  # averaged gradients: the global norm
        own = dist.local_gradient_norm(self.module)  # before averaging; None in one process (where it is `total`)
        problem = self._nonfinite(rank_loss, total if own is None else own, total)
        if problem is not None:
            return self._skip_or_stop(problem, rec["source"]), items
        if self.cfg.optim.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.optim.grad_clip, total)
        rec["grad_norm"] = float(total)
        rec["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        update_balance_biases(balancing)
        self.step += 1
        return rec, items

    def _nonfinite(self, rank_loss: float, own_norm: torch.Tensor, total: torch.Tensor) -> tuple[str, list[int]] | None:
        """(what is not finite, on which ranks), or None when every rank's loss and gradients are finite.

        One all-reduce (sum) of a (W, 3) table in which each rank fills its row — its own loss, the norm of its own
        gradients before averaging, the norm after — carries every rank's values to every rank exactly (x + 0 = x,
        NaN and inf included), so all ranks decide alike. A NaN loss on one rank reaches the others' gradients
        through the gathered embeddings, so a bad loss is reported before bad gradients."""
        values = torch.zeros(self.world, 3, dtype=torch.float32, device=self.device)  # (W, 3)
        values[self.rank, 0] = rank_loss
        values[self.rank, 1] = own_norm.detach().float().to(self.device)
        values[self.rank, 2] = total.detach().float().to(self.device)
        rows = dist.all_reduce_sum(values).tolist()
        for col, what in ((0, "loss"), (1, "gradient norm")):
            bad = [r for r, row in enumerate(rows) if not math.isfinite(row[col])]
            if bad:
                ranks = ", ".join(map(str, bad))
                return f"{what} is {rows[bad[0]][col]} on rank{'s' if len(bad) > 1 else ''} {ranks}", bad
        if not all(math.isfinite(row[2]) for row in rows):  # finite on each rank, overflowing in the average
            return f"gradient norm is {rows[0][2]} after averaging over ranks", list(range(self.world))
        return None

    def _skip_or_stop(self, problem: tuple[str, list[int]], source: str) -> dict:
        what, ranks = problem
        if self.skipped < self.cfg.skip_nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            self.skipped += 1
            log.warning("step %d skipped on every rank: %s (source %r; %d of skip_nonfinite=%d)",
                        self.step, what, source, self.skipped, self.cfg.skip_nonfinite)
            return {"event": "skipped", "source": source, "reason": what, "ranks": ranks, "skipped": self.skipped}
        where = self.last_ckpt or "none written yet"
        budget = f" ({self.skipped} earlier step(s) skipped, skip_nonfinite={self.cfg.skip_nonfinite})" \
            if self.cfg.skip_nonfinite else ""
        raise MoembedError(
            f"step {self.step + 1}: {what} (source {source!r}); training stopped on every rank before updating "
            f"the weights{budget}. Last good checkpoint: {where}"
        )

    # ---- checkpoints, eval, outputs -----------------------------------------------------------------------------

    def resume(self) -> int | None:
        latest = self.ckpt.latest()
        if latest is None:
            return None
        r = self.ckpt.load(latest, self.module, self.optimizer, self.scheduler, self.rank)
        self.stream.load_state(r.data_state)
        self.stage.load_state(r.meta.get("stage_state", {}))
        self.step, self.last_ckpt, self.skipped = r.step, latest, int(r.meta.get("skipped", 0))
        log.info("resuming from %s (step %d)", latest, r.step)
        return r.step

    def save_checkpoint(self) -> None:
        rngs = dist.all_gather_object(rng_state())
        if self.main:
            meta = {"stage": self.stage.name, "world_size": self.world, "skipped": self.skipped,
                    "stage_state": self.stage.state()}
            self.ckpt.save(self.step, self.module, self.optimizer, self.scheduler, self.stream.state(), meta, rngs)
        dist.barrier()
        self.last_ckpt = self.ckpt.path(self.step)  # on every rank: a stop names it alike on all

    def evaluate(self) -> dict:
        from moembed.eval import evaluate

        self.embedder.eval()
        try:
            results = evaluate(self.embedder, self.cfg.eval.tasks, batch_size=self.cfg.eval.batch_size)
        finally:
            self.module.train()
        return {r.task_name: r.main_score for r in results}

    def calibrate(self) -> None:
        """Store an int8 calibration sample of the run's own training texts (drawn by its seed) with the model. A
        sample that cannot be embedded leaves the model without one, with a warning: the trained model is saved."""
        from moembed.data.calibration import training_sample

        emb = self.embedder
        emb.calibration = None  # a starting model's sample no longer fits the trained weights
        tok, keep = emb.tokenizer, emb.tokenizer.max_length
        if emb.config.position == "absolute":  # a preset's tokenizer may allow more tokens than its position table
            tok.set_max_length(min(keep, emb.config.max_position))
        try:
            queries, documents = training_sample(self.cfg.data, self.cfg.seed, texts=self.cfg.stage == "mlm")
            emb.calibrate(queries + documents)  # each text with its source's prefix, as trained
        except (MoembedError, ValueError, RuntimeError) as e:
            log.warning("no int8 calibration stored (%s); `moembed calibrate MODEL TEXTS` adds one", e)
            return
        finally:
            tok.set_max_length(keep)
        log.info("int8 calibration: %d texts of the training data", len(queries) + len(documents))

    def finish(self) -> Path:
        final = self.out / "model"
        if self.row_grads is not None:
            self.row_grads.remove()
        if self.main:
            self.embedder.eval()
            self.calibrate()
            self.embedder.save(final, card=training_card(self.cfg, _source_sizes(self.stream), self.stats,
                                                         self.embedder.config.moe is not None))
            self.stage.write_extras(self.module, final)
        dist.barrier()
        return final


def _source_sizes(stream) -> dict[str, int]:
    """Records per source label, as the sampler counted them (pair streams hold sources, MLM streams packers)."""
    sources = getattr(stream, "sources", None) or [p.source for p in getattr(stream, "packers", [])]
    return {s.name: s.size for s in sources}


def _write_config(cfg: TrainConfig, out: Path) -> None:
    with atomic_path(out / "config.yaml") as tmp:
        tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), encoding="utf-8")


def train(cfg: TrainConfig, progress: bool = True, resume: bool = True) -> Path:
    """Run (or resume) training; returns the final model directory. Raises MoembedError on bad input, or on every
    rank together on a non-finite loss or gradient beyond the `skip_nonfinite` budget.

    Under torchrun: joins the process group (nccl on CUDA, gloo otherwise) and starts every rank from rank 0's
    weights.

    The process's allocator policy is left as the caller has it: the commands that own their process (`moembed
    train`, the quickstart's training stages under `moembed quickstart`) run this under `moembed.heap.bounded_heap`."""
    dist.init_from_env("nccl" if train_device(cfg.device).type == "cuda" else "gloo")
    t = Trainer(cfg, progress)
    dist.broadcast_parameters(t.module)
    if not resume and t.ckpt.latest() is not None:
        raise MoembedError(f"{t.ckpt.dir}: holds checkpoints of an earlier run; remove it or resume instead of --fresh")
    start = t.resume() if resume else None
    if t.main:
        t.out.mkdir(parents=True, exist_ok=True)
        _write_config(cfg, t.out)
        log.info("memory allocator: %s", allocator())  # mimalloc under the `moembed` command (moembed.heap)
    metrics = Metrics(t.out / "metrics.jsonl", start if start is not None else 0, t.main)
    bar = tqdm(total=cfg.steps, initial=t.step, desc=cfg.stage, unit="step", disable=not t.progress)
    rate = None
    try:
        while t.step < cfg.steps:
            t0 = time.perf_counter()
            rec, items = t.train_step()
            dt = time.perf_counter() - t0
            if rec.get("event") == "skipped":  # always recorded; no loss, rate or progress figures
                metrics.write({"step": t.step, **rec, "time": time.time()})
            else:
                rate = items / dt if rate is None else 0.9 * rate + 0.1 * items / dt
                unit = t.stage.rate_unit
                rec = {"step": t.step, **rec, unit: items / dt, "time": time.time()}
                if t.step % cfg.log_every == 0 or t.step == cfg.steps:
                    metrics.write(rec)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}",
                                **{unit.split("_")[0] + "/s": f"{rate:.1f}"})
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
