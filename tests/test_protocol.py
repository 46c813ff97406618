"""One protocol for "a model that embeds" and one batched-inference loop behind every model that encodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moembed.model.protocol import DerivesViews, EmbeddingModel, OwnSimilarity, Quantizes, own_similarity

TEXTS = ["a short one", "a rather longer text with many more words in it than the others", "mid-length text here",
         "x", "another text of some length"]


# ---- the protocol ---------------------------------------------------------------------------------------------


def test_models_declare_what_they_can_do(make_tiny):
    from moembed.moee import MoEEModel, SumModel
    from moembed.moee.encoder import EncoderMoESource

    emb = make_tiny("bert", moe={"num_experts": 2, "top_k": 1, "layers": [1]})
    assert isinstance(emb, EmbeddingModel) and isinstance(emb, DerivesViews) and isinstance(emb, Quantizes)
    assert not own_similarity(emb)  # its similarity is the cosine eval computes itself
    emb.similarity_fn_name = "dot"
    assert own_similarity(emb)
    emb.similarity_fn_name = "cosine"
    src = EncoderMoESource(emb)
    for m in (MoEEModel(src, "concat"), SumModel(src, 0.5)):
        assert isinstance(m, EmbeddingModel) and not isinstance(m, (DerivesViews, Quantizes))
    assert isinstance(SumModel(src, 0.5), OwnSimilarity) and not isinstance(MoEEModel(src, "rw"), OwnSimilarity)
    assert own_similarity(SumModel(src, 0.5))


def test_sentence_transformers_teacher_is_an_embedding_model(minilm_path):
    from moembed.data.teacher import SentenceTransformerTeacher, Teacher

    t = SentenceTransformerTeacher(minilm_path)
    assert isinstance(t, EmbeddingModel) and isinstance(t, Teacher)
    key = t.settings_key()
    assert len(key) == 16 and key == t.settings_key()
    with torch.no_grad():
        next(t.model.parameters()).add_(1.0)
    assert t.settings_key() != key  # the key follows the weights


def test_settings_key_follows_weights_and_settings(make_tiny):
    emb = make_tiny("nomic")
    key = emb.settings_key()
    assert len(key) == 16 and key == make_tiny("nomic").settings_key()  # same weights and settings: same key
    assert make_tiny("nomic", seed=1).settings_key() != key
    emb.tokenizer.set_max_length(32)
    assert emb.settings_key() != key
    emb.tokenizer.set_max_length(64)
    emb.config.dynamic_ntk = False
    assert emb.settings_key() != key
    emb.config.dynamic_ntk = True
    assert emb.settings_key() == key
    for p in emb.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(emb.parameters(), lr=0.1).step()  # an in-place update: the stored weights hash is stale
    assert emb.settings_key() != key
    key, version = emb.settings_key(), next(emb.parameters())._version
    torch.optim.AdamW(emb.parameters(), lr=0.1, fused=True).step()  # the trainer's: it moves no version counter
    assert next(emb.parameters())._version == version
    assert emb.settings_key() != key


def test_source_dir_is_a_declared_field(make_tiny, minilm_path, tmp_path):
    from moembed.model.convert.rotary import to_rotary
    from moembed.model.embedder import Embedder

    emb = make_tiny("bert")
    assert emb.source_dir is None
    emb = Embedder(emb.encoder, emb.tokenizer, source_dir=str(minilm_path))
    assert emb.source_dir == minilm_path
    assert to_rotary(emb).source_dir == minilm_path  # conversions keep where the tokenizer files are
    emb.save(tmp_path / "m")
    assert emb.source_dir == tmp_path / "m" and (tmp_path / "m" / "vocab.txt").exists()
    assert Embedder.load(tmp_path / "m").source_dir == tmp_path / "m"


def test_parts_round_trip_without_an_embedder(make_tiny, tmp_path):
    from moembed.model.embedder import Embedder
    from moembed.model.io import read_parts, save_parts

    emb = make_tiny("nomic")
    save_parts(emb.parts(), tmp_path / "m")
    parts = read_parts(tmp_path / "m")
    assert parts.config == emb.config and parts.prompts == emb.prompts and parts.weights_path.name == "model.safetensors"
    assert all(torch.equal(parts.state_dict[k], v) for k, v in emb.encoder.state_dict().items())
    np.testing.assert_array_equal(Embedder.from_parts(parts).encode(TEXTS), emb.encode(TEXTS))


# ---- the inference loop ---------------------------------------------------------------------------------------


def test_loop_sorts_longest_first_and_returns_input_order():
    from moembed.model.inference import length_sorted_batches, run_batches

    ids = [[1] * n for n in (3, 9, 1, 9, 5)]
    assert length_sorted_batches([len(x) for x in ids], 2) == [[1, 3], [4, 0], [2]]
    seen, progress = [], []

    def forward(batch):
        seen.append([len(x) for x in batch])
        lengths = torch.tensor([[len(x)] for x in batch], dtype=torch.float64)
        return lengths, 2 * lengths

    a, b = run_batches(ids, 2, forward, (1, 1), lambda done, total: progress.append((done, total)))
    assert seen == [[9, 9], [5, 3], [1]]  # little padding per batch
    assert a[:, 0].tolist() == [3, 9, 1, 9, 5] and b[:, 0].tolist() == [6, 18, 2, 18, 10]  # input order
    assert a.dtype == torch.float32 and progress == [(2, 5), (4, 5), (5, 5)]


def test_embedder_layers_token_ids_embed_ids_encode(make_tiny):
    emb = make_tiny("bert")
    ids, truncated = emb.token_ids(TEXTS, "search_query: ")
    assert (ids, truncated) == emb.tokenizer.encode_ids(["search_query: " + t for t in TEXTS])
    raw = emb.embed_ids(ids)  # one padded forward, not normalised
    assert raw.shape == (len(TEXTS), 32) and raw.dtype == torch.float32
    np.testing.assert_allclose(emb.encode(TEXTS, prompt_name="search_query", normalize_embeddings=False), raw.numpy(), atol=1e-5)
    calls = []
    emb.embed_tensor(TEXTS, batch_size=2, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(2, 5), (4, 5), (5, 5)]


def test_moee_encoder_source_and_probe_run_length_sorted_batches(make_tiny):
    from moembed.model.utilisation import probe
    from moembed.moee.encoder import EncoderMoESource

    emb = make_tiny("bert", moe={"num_experts": 2, "top_k": 1, "layers": [0, 1]})
    src = EncoderMoESource(emb)
    batches = []
    real = src.forward
    src.forward = lambda input_ids, mask: batches.append(mask.sum(1).tolist()) or real(input_ids, mask)
    f = src.features(TEXTS, batch_size=2)
    lengths = [len(x) for x in emb.token_ids(TEXTS)[0]]
    assert batches == [sorted(lengths, reverse=True)[i : i + 2] for i in range(0, 5, 2)]
    np.testing.assert_allclose(f.hs.numpy(), emb.encode(TEXTS, normalize=False), atol=1e-5)
    widths = []
    emb.encoder.register_forward_hook(lambda m, i, o: widths.append(i[0].shape[1]))
    probe(emb, TEXTS, batch_size=2)
    assert widths == sorted(widths, reverse=True) and len(widths) == 3


def test_hf_source_uses_the_same_loop_with_left_padding():
    from moembed.moee.hf import HFMoESource

    class Tok:
        pad_token_id, eos_token_id = 0, 1

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[5] * len(t.split()) for t in texts]}

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Linear(1, 1)
            self.config = type("C", (), {"model_type": "olmoe", "num_hidden_layers": 1, "num_experts": 2,
                                         "hidden_size": 1})()

    src = HFMoESource(LM(), Tok(), "toy")
    padded = []

    def forward(input_ids, mask):
        padded.append(mask.tolist())
        from moembed.moee.extract import Features

        n = mask.sum(1, keepdim=True).float()
        return Features(n, torch.cat([n, -n], 1))

    src.forward = forward
    f = src.features(TEXTS, batch_size=2)
    assert all(row[-1] for batch in padded for row in batch)  # left padding: every last position is a real token
    assert [len(b[0]) for b in padded] == sorted((len(b[0]) for b in padded), reverse=True)
    assert f.hs[:, 0].tolist() == [len(t.split()) for t in TEXTS]  # back in input order


def test_no_progress_bars_or_backend_switches_in_library_code():
    """tqdm stays out of the model package; no library module switches matplotlib's backend or uses pyplot."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "moembed"
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.startswith("matplotlib.pyplot") or n == "pyplot" for n in names), path
                if path.is_relative_to(root / "model"):
                    assert not any(n.startswith("tqdm") for n in names), path
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "use":
                assert getattr(node.func.value, "id", None) != "matplotlib", path


def test_plots_leave_the_matplotlib_backend_alone(tmp_path):
    import json

    import matplotlib

    from moembed.train.plots import write_plots

    before = matplotlib.get_backend()
    recs = [{"step": s, "loss": 1.0 / s, "lr": 0.1, "expert_load": [[0.5, 0.5]]} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    written = write_plots(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert [p.name for p in written] == ["loss.png", "lr.png", "expert_load.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)
    assert matplotlib.get_backend() == before


@pytest.mark.parametrize("bad", [0, -1])
def test_loop_refuses_bad_batch_sizes(bad):
    from moembed.errors import MoembedError
    from moembed.model.inference import length_sorted_batches

    with pytest.raises(MoembedError, match="batch_size"):
        length_sorted_batches([1, 2], bad)
