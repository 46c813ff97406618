"""The training loop shared by the three stages (mlm | contrastive | finetune).

One optimizer step per batch: there is no plain gradient accumulation for the contrastive stages, since
accumulating small batches shrinks the set of in-batch negatives; large contrastive batches come from GradCache
(`chunk_size`). Data parallelism: every rank draws the same global batch and keeps its slice; embeddings are
all-gathered inside the loss so negatives span all ranks; gradients are averaged over ranks after backward
(what DDP does — done explicitly because a GradCache step runs several forward passes per backward).

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
from moembed.errors import MoembedError
from moembed.fileio import atomic_path
from moembed.model.tokenizer import Batch, TextTokenizer
from moembed.train.build import (
    build_model,
    build_pair_stream,
    build_text_stream,
    check_paths,
)
from moembed.train.checkpoint import CheckpointManager
from moembed.train.config import TrainConfig
from moembed.train.optim import build_optimizer

log = logging.getLogger("moembed")


def tokenize(tok: TextTokenizer, texts: list[str], max_length: int, device: torch.device) -> Batch:
    """Tokenise with a temporary max length (queries and documents have their own)."""
    keep = tok.max_length
    tok.set_max_length(max_length)
    try:
        b = tok(texts)
    finally:
        tok.set_max_length(keep)
    return Batch(b.input_ids.to(device), b.attention_mask.to(device), b.token_type_ids.to(device), b.truncated)


def _scalar(x) -> float | None:
    if x is None:
        return None
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def expert_load(counts) -> list[list[float]]:
    """Per MoE layer, the fraction of routing assignments each expert received."""
    out = []
    for c in counts or ():
        c = c.detach().float().cpu()
        out.append((c / c.sum().clamp_min(1)).tolist())
    return out


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
    """One run's model, optimizer, scheduler, data stream and checkpoints; `train()` drives it step by step."""

    def __init__(self, cfg: TrainConfig, progress: bool = True):
        check_paths(cfg)
        dist.init_from_env()
        self.cfg, self.rank, self.world = cfg, dist.rank(), dist.world_size()
        self.main = self.rank == 0
        self.progress = progress and self.main
        self.device = torch.device(f"cuda:{dist.local_rank()}" if torch.cuda.is_available() else "cpu")
        self.out = Path(cfg.output_dir)
        self.stats = SourceStats()
        self.embedder = build_model(cfg)
        if cfg.stage == "mlm":
            from moembed.train.mlm import MLMModel

            self.module = MLMModel(self.embedder, cfg.mlm.aux_loss_coef)
            head = Path(cfg.model) / "mlm_head.safetensors"
            if head.exists():  # continuing MLM from a model this stage saved: keep its prediction head
                from safetensors.torch import load_file

                self.module.head.load_state_dict(load_file(str(head)))
            self.stream = build_text_stream(cfg, self.embedder.tokenizer, self.stats, self.rank, self.world)
        else:
            self.module = self.embedder
            self.stream = build_pair_stream(cfg, self.stats, self.rank, self.world)
        self.module.to(self.device).train()
        dist.broadcast_parameters(self.module)
        self.optimizer, self.scheduler = build_optimizer(self.module, cfg.optim, cfg.steps)
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint.keep_last)
        self.step, self.last_ckpt = 0, None
        torch.manual_seed(cfg.seed + self.rank)  # dropout differs per rank, reproducibly

    # ---- one step --------------------------------------------------------------------------------------------

    def _contrastive(self) -> tuple[dict, int]:
        from moembed.train.step import contrastive_step

        b = self.stream.next()
        tok, cfg = self.embedder.tokenizer, self.cfg
        q = tokenize(tok, b.queries, cfg.max_query_length, self.device)
        d = tokenize(tok, b.documents, cfg.max_doc_length, self.device)
        n = tokenize(tok, b.negatives, cfg.max_doc_length, self.device) if b.negatives else None
        # Gradients come back averaged over ranks; false negatives are found by document text.
        res = contrastive_step(self.module, q, d, n, cfg.loss, cfg.chunk_size, doc_ids=b.documents + (b.negatives or []))
        rec = {"source": b.source, "loss": _scalar(res.loss)}
        for key in ("contrastive", "aux", "z"):
            rec[key] = _scalar(getattr(res, key, None))
        per_dim = getattr(res, "per_dim", None)
        if per_dim:
            rec["per_dim"] = {str(k): _scalar(v) for k, v in dict(per_dim).items()}
        rec["expert_load"] = expert_load(getattr(res, "expert_counts", None))
        return rec, cfg.batch_size

    def _mlm(self) -> tuple[dict, int]:
        from moembed.train.mlm import mask_id, mask_tokens, special_ids

        name, ids = self.stream.next()
        tok = self.embedder.tokenizer
        # Masks come from a generator seeded by (seed, step, rank): identical after a resume, different per rank.
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step * 101 + self.rank)
        inputs, labels = mask_tokens(ids, self.cfg.mlm.mask_prob, mask_id(tok), self.embedder.config.vocab_size,
                                     special_ids(tok), g)
        out = self.module(inputs.to(self.device), labels.to(self.device))
        with dist.synchronised_gradients(self.module) as last_backward, last_backward():
            out.loss.backward()
        rec = {"source": name, "loss": _scalar(out.loss), "mlm": _scalar(out.mlm), "aux": _scalar(out.aux),
               "masked": out.num_masked, "expert_load": expert_load(out.expert_counts)}
        return rec, self.cfg.batch_size * self.cfg.mlm.seq_len

    def train_step(self) -> tuple[dict, int]:
        """Forward, backward, checks, gradient sync, clip, optimizer and scheduler step. Returns (record, items)."""
        self.optimizer.zero_grad(set_to_none=True)
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.cfg.bf16 else nullcontext()
        with amp:
            rec, items = self._mlm() if self.cfg.stage == "mlm" else self._contrastive()
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
        rngs = dist.all_gather_object(_rng())
        if self.main:
            meta = {"stage": self.cfg.stage, "world_size": self.world}
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
            if self.cfg.stage == "mlm":
                from safetensors.torch import save_file

                with atomic_path(final / "mlm_head.safetensors") as tmp:
                    save_file({k: v.detach().cpu().contiguous() for k, v in self.module.head.state_dict().items()},
                              str(tmp))
        dist.barrier()
        return final


def _rng() -> dict:
    from moembed.train.checkpoint import rng_state

    return rng_state()


def _write_config(cfg: TrainConfig, out: Path) -> None:
    with atomic_path(out / "config.yaml") as tmp:
        tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), encoding="utf-8")


def train(cfg: TrainConfig, progress: bool = True, resume: bool = True) -> Path:
    """Run (or resume) training; returns the final model directory. Raises MoembedError on bad input or NaN loss."""
    t = Trainer(cfg, progress)
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
            unit = "tokens_per_s" if cfg.stage == "mlm" else "pairs_per_s"
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
