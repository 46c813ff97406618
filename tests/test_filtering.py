"""Consistency filtering: removes injected noise with a real teacher, resumes, handles bad input; teachers load."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from typer.testing import CliRunner

import moembed.data.curate as curate_mod
from moembed.cli.main import app
from moembed.data.corpora import read_dataset
from moembed.data.curate import CurateConfig, curate
from moembed.data.filtering import consistency_keep, positive_rank
from moembed.data.splits import clean_pairs
from moembed.errors import MoembedError


def _write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _wordnet_rows(n, seed=0):
    pairs, _ = clean_pairs(read_dataset("wordnet"))
    rng = random.Random(seed)
    return [{"query": p.query, "document": p.document, "source": p.source, "lang": p.lang, "id": i}
            for i, p in enumerate(rng.sample(pairs, n))]


@pytest.mark.real
def test_filter_removes_shuffled_documents_with_minilm(tmp_path, minilm):
    """20% of the news bodies are rotated among their pairs; top-2 filtering must catch them."""
    pairs, _ = clean_pairs(p for p in read_dataset("news") if p.query)
    by_doc = {}
    for p in pairs:
        by_doc.setdefault(p.document, p)  # one pair per article: its title
    rng = random.Random(0)
    rows = [{"query": p.query, "document": p.document, "source": "news", "id": i}
            for i, p in enumerate(rng.sample(list(by_doc.values()), 250))]
    noisy = sorted(rng.sample(range(len(rows)), len(rows) // 5))
    docs = [rows[i]["document"] for i in noisy]
    for i, d in zip(noisy, docs[1:] + docs[:1]):  # a rotation: every noisy pair gets another pair's body
        rows[i]["document"] = d
    old = minilm.tokenizer.max_length
    minilm.tokenizer.set_max_length(48)  # titles and leads decide the match; keeps the test fast on CPU
    try:
        report = curate(_write(tmp_path / "news.jsonl", rows), tmp_path / "kept.jsonl", minilm,
                        CurateConfig(shard_size=1000, top_k=2, bf16=True), show_progress=False)
    finally:
        minilm.tokenizer.set_max_length(old)
    kept = {json.loads(x)["id"] for x in (tmp_path / "kept.jsonl").read_text().splitlines()}
    dropped_noisy = sum(i not in kept for i in noisy) / len(noisy)
    kept_clean = sum(i in kept for i in range(len(rows)) if i not in set(noisy)) / (len(rows) - len(noisy))
    print(f"noisy dropped {dropped_noisy:.3f}, clean kept {kept_clean:.3f}")
    assert dropped_noisy >= 0.9 and kept_clean >= 0.8
    assert report["sources"]["news"]["kept"] == len(kept) and report["pairs"] == len(rows)


def test_keep_rule_on_synthetic_embeddings():
    docs = np.eye(4, dtype=np.float32)
    q = np.array([[1, 0.5, 0.2, 0], [0, 0, 1, 0.9], [0.1, 1, 0.2, 0.3]], np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    own = np.array([2, 3, 1])  # ranks: 3rd, 2nd, 1st
    assert consistency_keep(q, docs, own, top_k=2, backend="exact").tolist() == [False, True, True]
    assert consistency_keep(q, docs, own, top_k=1, backend="faiss").tolist() == [False, False, True]
    assert consistency_keep(q, docs, own, top_k=3).all()
    assert positive_rank(q, docs, own, top_k=4, backend="exact").tolist() == [2, 1, 0]
    assert positive_rank(q, docs, own, top_k=2, backend="faiss").tolist() == [2, 1, 0]  # capped at k: not in top 2
    tied = np.array([[1, 1, 0, 0]], np.float32) / np.sqrt(2)  # documents 0 and 1 tie: neither is above the other
    assert positive_rank(tied, docs, np.array([1]), top_k=2).tolist() == [0]


def test_search_scoring_the_own_document_a_little_higher_does_not_push_it_down(monkeypatch):
    """FAISS and the exact search sum in another order than the own-score einsum: a few ulps more for the pair's
    own document must not count it as a document above itself."""
    import moembed.data.filtering as filtering

    docs = np.eye(3, dtype=np.float32)
    q = np.array([[0.6, 0.8, 0]], np.float32)  # own document 1 first (0.8), document 0 second (0.6)

    def search(queries, d, k, backend):
        from moembed.data.search import search_exact

        scores, idx = search_exact(queries, d, k)
        return np.where(idx == 1, scores + 1e-5, scores), idx

    monkeypatch.setattr(filtering, "search", search)
    assert positive_rank(q, docs, np.array([1]), top_k=1).tolist() == [0]
    assert consistency_keep(q, docs, np.array([1]), top_k=1).tolist() == [True]


def test_resumed_run_equals_uninterrupted(tmp_path, make_tiny, monkeypatch):
    emb = make_tiny(seed=1)
    data = _write(tmp_path / "pairs.jsonl", _wordnet_rows(90))
    cfg = CurateConfig(shard_size=30, top_k=3)
    full = curate(data, tmp_path / "full.jsonl", emb, cfg, show_progress=False)

    real = curate_mod._search_shard
    calls = []

    def crash_on_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return real(*args, **kw)

    monkeypatch.setattr(curate_mod, "_search_shard", crash_on_second)
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="killed"):
        curate(data, tmp_path / "resumed.jsonl", emb, cfg, work_dir=work, show_progress=False)
    assert not (tmp_path / "resumed.jsonl").exists()  # nothing half-written
    assert (work / "shard-00000.jsonl").exists() and not (work / "shard-00001.json").exists()
    monkeypatch.setattr(curate_mod, "_search_shard", real)
    again = curate(data, tmp_path / "resumed.jsonl", emb, cfg, work_dir=work, show_progress=False)
    assert again["resumed_shards"] == 1 and again["shards"] == 3
    assert (tmp_path / "resumed.jsonl").read_bytes() == (tmp_path / "full.jsonl").read_bytes()
    assert again["sources"] == full["sources"] and 0 < full["kept"] < 90


def test_bad_input_named_or_skipped_and_counted(tmp_path, make_tiny):
    emb = make_tiny()
    rows = _wordnet_rows(12)
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "{not json")
    lines.insert(6, json.dumps({"query": "only a query"}))
    lines.insert(8, json.dumps({"query": "  ", "document": "empty query"}))
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = CurateConfig(shard_size=100, top_k=2)
    with pytest.raises(MoembedError, match=r"bad\.jsonl:4: invalid JSON"):
        curate(data, tmp_path / "out.jsonl", emb, cfg, show_progress=False)
    del lines[3]
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(MoembedError, match=r"bad\.jsonl:6: missing key 'document'"):
        curate(data, tmp_path / "out.jsonl", emb, cfg, show_progress=False)
    report = curate(data, tmp_path / "out.jsonl", emb, cfg, skip_bad=True, show_progress=False)
    assert report["bad_lines"] == 1 and report["bad_line_numbers"] == [6]
    assert report["dropped_empty"] == 1 and report["pairs"] == 12
    assert not (tmp_path / "out.jsonl.work").exists()  # the default work dir goes once the output is complete


def test_cli_filter_with_saved_model(tmp_path, make_tiny):
    model_dir = tmp_path / "model"
    make_tiny(seed=2).save(model_dir)
    data = _write(tmp_path / "pairs.jsonl", _wordnet_rows(40, seed=4))
    res = CliRunner().invoke(app, ["filter", str(data), "--teacher", str(model_dir), "--shard-size", "20",
                                   "--top-k", "5", "--out", str(tmp_path / "kept.jsonl")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "kept.jsonl.report.json").read_text())
    kept = (tmp_path / "kept.jsonl").read_text().splitlines()
    assert report["shards"] == 2 and report["kept"] == len(kept) and report["sources"]["wordnet"]["pairs"] == 40
    # --max-length: the teacher sees the first tokens only (here the word and one token of its gloss)
    res = CliRunner().invoke(app, ["filter", str(data), "--teacher", str(model_dir), "--shard-size", "20",
                                   "--top-k", "5", "--max-length", "3", "--out", str(tmp_path / "cut.jsonl")])
    assert res.exit_code == 0, res.output
    cut = (tmp_path / "cut.jsonl").read_text().splitlines()
    api = tmp_path / "api.jsonl"
    curate(data, api, str(model_dir), CurateConfig(shard_size=20, top_k=5, max_length=3), show_progress=False)
    assert cut == api.read_text().splitlines() and cut != kept


def test_sentence_transformers_teacher_fallback(tmp_path, minilm_path):
    """A non-BERT sentence-transformers directory (tiny random DistilBERT) serves as a teacher."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertModel

    from moembed.data.teacher import SentenceTransformerTeacher, embed, load_teacher

    torch.manual_seed(0)
    hf = tmp_path / "hf"
    DistilBertModel(DistilBertConfig(vocab_size=30522, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).save_pretrained(hf)
    AutoTokenizer.from_pretrained(str(minilm_path)).save_pretrained(hf)
    word = models.Transformer(str(hf), max_seq_length=32)
    st = SentenceTransformer(modules=[word, models.Pooling(32, "mean")], device="cpu")
    st.save(str(tmp_path / "st"))

    teacher = load_teacher(tmp_path / "st")
    assert isinstance(teacher, SentenceTransformerTeacher) and teacher.dim == 32
    texts = ["a small dog", "the stock market fell", "a puppy"]
    x = embed(teacher, texts, "document")
    ref = st.encode(texts, convert_to_numpy=True)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    assert x.shape == (3, 32) and np.allclose(x, ref, atol=1e-5)
    with pytest.raises(MoembedError, match="missing: no such directory; moembed reads models from local directories"):
        load_teacher(tmp_path / "missing")
    short = load_teacher(tmp_path / "st", max_length=4)  # texts cut as training would cut them
    assert short.model.max_seq_length == 4
    cut = embed(short, ["the stock market fell sharply today"], "document")
    assert np.allclose(cut, embed(short, ["the stock market"], "document"), atol=1e-5)  # [CLS] 3 tokens [SEP]


def test_teacher_max_length_cuts_but_never_lengthens(tiny_dir):
    from moembed.data.teacher import embed, load_teacher

    own = load_teacher(tiny_dir).max_length
    assert load_teacher(tiny_dir, max_length=own * 4).max_length == own
    short = load_teacher(tiny_dir, max_length=5)
    assert short.max_length == 5
    long_text = "the stock market fell sharply today in heavy trading"
    assert np.allclose(embed(short, [long_text], "document"), embed(short, ["the stock market"], "document"),
                       atol=1e-6)
    assert not np.allclose(embed(load_teacher(tiny_dir), [long_text], "document"),
                           embed(short, [long_text], "document"), atol=1e-3)


def test_shard_embeddings_are_reused_by_mining(tmp_path, make_tiny, monkeypatch):
    from moembed.data.mining import MiningConfig

    emb = make_tiny(seed=5)
    data = _write(tmp_path / "pairs.jsonl", _wordnet_rows(40, seed=6))
    work = tmp_path / "work"
    curate(data, tmp_path / "kept.jsonl", emb, CurateConfig(shard_size=20, top_k=2, cache_embeddings=True),
           work_dir=work, show_progress=False)
    assert len(list(work.glob("shard-*.emb.npz"))) == 2

    def no_teacher(*a, **k):
        raise AssertionError("the teacher ran again")

    monkeypatch.setattr(curate_mod, "embed", no_teacher)
    cfg = CurateConfig(shard_size=20, top_k=None, mining=MiningConfig(num_negatives=2, margin=None),
                       cache_embeddings=True)
    report = curate(data, tmp_path / "mined.jsonl", emb, cfg, work_dir=work, show_progress=False)
    mined = [json.loads(x) for x in (tmp_path / "mined.jsonl").read_text().splitlines()]
    assert report["kept"] == 40 and all(len(r["negatives"]) == 2 for r in mined)
