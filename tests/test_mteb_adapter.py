"""The MTEB adapter against mteb's own protocol objects (TaskMetadata, PromptType) and evaluator, offline."""

from __future__ import annotations

import json

import mteb
import numpy as np
import pytest
from mteb.mocks.mock_tasks.bitext_mining import MockBitextMiningTask  # noqa: E402
from mteb.mocks.mock_tasks.classification import MockClassificationTask  # noqa: E402
from mteb.mocks.mock_tasks.clustering import MockClusteringTask  # noqa: E402
from mteb.mocks.mock_tasks.pair_classification import MockPairClassificationTask  # noqa: E402
from mteb.mocks.mock_tasks.reranking import MockRerankingTask  # noqa: E402
from mteb.mocks.mock_tasks.retrieval import MockRetrievalTask  # noqa: E402
from mteb.mocks.mock_tasks.sts import MockSTSTask  # noqa: E402
from mteb.models.models_protocols import EncoderProtocol  # noqa: E402
from mteb.types import PromptType  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from moembed.eval import evaluate  # noqa: E402
from moembed.eval.mteb_adapter import MtebEncoder  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder:
    """A model that records the prompt name of every encode call."""

    name, dim = "recorder", 8
    prompts = {"search_query": "q: ", "search_document": "d: ", "classification": "c: ", "clustering": "k: "}

    def __init__(self):
        self.calls = []

    def encode(self, texts, prompt_name=None, prompt=None, *, truncate_dim=None, precision="float32", batch_size=32):
        self.calls.append((prompt_name, list(texts)))
        return np.ones((len(texts), self.dim), np.float32)


def _loader(texts):
    return DataLoader([{"text": t} for t in texts], batch_size=2)  # batches {"text": [...]}, as mteb sends


@pytest.mark.parametrize(
    "task,prompt_type,expected",
    [
        (MockRetrievalTask, PromptType.query, "search_query"),
        (MockRetrievalTask, PromptType.document, "search_document"),
        (MockRerankingTask, PromptType.query, "search_query"),
        (MockRerankingTask, PromptType.document, "search_document"),
        (MockClassificationTask, None, "classification"),
        (MockClusteringTask, None, "clustering"),
        (MockSTSTask, None, "classification"),
        (MockPairClassificationTask, None, "classification"),
        (MockBitextMiningTask, None, "classification"),
    ],
)
def test_prefix_per_task_type_and_prompt_type(task, prompt_type, expected):
    model = Recorder()
    enc = MtebEncoder(model)
    texts = ["one", "two", "three"]
    out = enc.encode(
        _loader(texts), task_metadata=task.metadata, hf_split="test", hf_subset="default", prompt_type=prompt_type
    )
    assert out.shape == (3, 8)
    assert model.calls == [(expected, texts)]


def test_model_without_prompt_gets_no_prefix():
    model = Recorder()
    model.prompts = {"search_query": "q: "}
    enc = MtebEncoder(model)
    enc.encode(_loader(["a"]), task_metadata=MockClassificationTask.metadata, hf_split="test", hf_subset="default")
    assert model.calls == [(None, ["a"])]


def test_real_prefix_reaches_the_tokenizer(make_tiny):
    emb = make_tiny("bert")
    enc = MtebEncoder(emb)
    got = enc.encode(
        _loader(["a cat"]),
        task_metadata=MockRetrievalTask.metadata,
        hf_split="test",
        hf_subset="default",
        prompt_type=PromptType.document,
    )
    np.testing.assert_array_equal(got, emb.encode(["a cat"], prompt_name="search_document"))
    assert not np.allclose(got, emb.encode(["a cat"]))


def test_protocol_and_real_mteb_run_match_moembed(make_tiny, tmp_path):
    """mteb.evaluate on its offline mock retrieval task gives the nDCG@10 moembed computes on the same data."""
    emb = make_tiny("bert")
    enc = MtebEncoder(emb)
    assert isinstance(enc, EncoderProtocol)
    res = mteb.evaluate(enc, [MockRetrievalTask()], cache=None, show_progress_bar=False)
    mteb_ndcg = res.task_results[0].scores["test"][0]["ndcg_at_10"]

    task = MockRetrievalTask()
    task.load_data()
    split = task.dataset["default"]["test"]
    d = tmp_path / "mock"
    (d / "qrels").mkdir(parents=True)
    (d / "corpus.jsonl").write_text(
        "".join(
            json.dumps({"_id": r["id"], "title": r.get("title", ""), "text": r["text"]}) + "\n" for r in split["corpus"]
        )
    )
    (d / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": r["id"], "text": r["text"]}) + "\n" for r in split["queries"])
    )
    rows = [f"{q}\t{doc}\t{s}" for q, docs in split["relevant_docs"].items() for doc, s in docs.items()]
    (d / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    ours = evaluate(emb, [d])[0].scores["ndcg_at_10"]
    assert ours == pytest.approx(mteb_ndcg, abs=1e-5)


def _local_sts_task():
    """An STS task built here, in mteb's own task class: real-looking pairs with 0..5 gold scores."""
    from datasets import Dataset, DatasetDict
    from mteb.abstasks.sts import AbsTaskSTS
    from mteb.abstasks.task_metadata import TaskMetadata

    pairs = [
        ("A man is playing a guitar.", "A man plays the guitar.", 5.0),
        ("A woman is slicing onions.", "Someone cuts an onion.", 4.2),
        ("The cat sleeps on the sofa.", "A dog runs in the park.", 0.4),
        ("Stocks fell sharply on Monday.", "Markets dropped at the start of the week.", 3.8),
        ("Two children build a sandcastle.", "Kids are playing on the beach.", 3.1),
        ("The train left the station late.", "A chef prepares a salad.", 0.0),
        ("He is reading a newspaper.", "A man reads the news.", 4.5),
        ("Rain is expected tomorrow.", "The weather will be sunny all week.", 1.2),
    ]

    class LocalSTS(AbsTaskSTS):
        metadata = TaskMetadata(
            name="MoembedLocalSTS", type="STS", main_score="cosine_spearman", description="pairs built in a test",
            reference="https://example.org", dataset={"path": "NA", "revision": "NA"}, category="t2t",
            eval_splits=["test"], eval_langs=["eng-Latn"], date=("2024-01-01", "2024-01-02"), dialect=["Written"],
            domains=[], task_subtypes=[], license="cc-by-4.0", annotations_creators="derived", modalities=["text"],
            sample_creation="found", bibtex_citation="",
        )
        min_score, max_score = 0, 5

        def load_data(self, num_proc=None, **kwargs):
            s1, s2, score = zip(*pairs)
            self.dataset = DatasetDict({"test": Dataset.from_dict(
                {"sentence1": list(s1), "sentence2": list(s2), "score": list(score)})})
            self.data_loaded = True

    return LocalSTS(), pairs


@pytest.mark.parametrize("fn", ["cosine", "dot"])
def test_mteb_evaluate_on_a_local_sts_task_uses_the_models_similarity(make_tiny, fn):
    """mteb.evaluate runs its own STS evaluator through the adapter's encode and similarity_pairwise: its
    "spearman" (the model's similarity) and "cosine_spearman" equal what moembed computes on the same pairs."""
    from scipy.stats import spearmanr

    emb = make_tiny("bert")
    emb.normalize = False  # raw vectors, so that dot and cosine rank differently
    emb.similarity_fn_name = fn
    task, pairs = _local_sts_task()
    res = mteb.evaluate(MtebEncoder(emb), [task], cache=None, show_progress_bar=False)
    scores = res.task_results[0].scores["test"][0]
    s1, s2, gold = zip(*pairs)
    a = emb.encode(list(s1), prompt_name="classification")
    b = emb.encode(list(s2), prompt_name="classification")
    own = emb.similarity_pairwise(a, b).numpy()
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert scores["spearman"] == pytest.approx(spearmanr(gold, own)[0], abs=1e-9)
    assert scores["cosine_spearman"] == pytest.approx(spearmanr(gold, cos)[0], abs=1e-9)
    if fn == "dot":
        assert scores["spearman"] != pytest.approx(scores["cosine_spearman"], abs=1e-6)


def test_encoder_from_a_directory_as_mteb_constructs_it(make_tiny, tmp_path):
    make_tiny("bert").save(tmp_path / "m")
    enc = MtebEncoder(str(tmp_path / "m"), None, device="cpu")
    assert isinstance(enc, EncoderProtocol) and enc.model.dim == 32
    fn = enc.mteb_model_meta.similarity_fn_name
    assert getattr(fn, "value", fn) == "cosine"
