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
