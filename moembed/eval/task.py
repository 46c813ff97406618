"""A loaded task, and what every task type defines (as MTEB's task classes do).

Task types live one per module (retrieval, sts, classification, clustering, pair_classification, reranking),
each a `TaskType` subclass; `moembed.eval.registry` lists them. Adding a task type is one module with its class
and one entry in the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from moembed.eval.encoding import EmbeddingCache, View, encode, pairwise


PROTOCOLS = ("mteb", "legacy")


@dataclass(frozen=True)
class Protocol:
    """How classification, clustering and pair classification are scored (task.json `protocol` and its settings).

    "mteb" (the default) follows MTEB 2's task classes so that scores compare with MTEB's: classification fits
    logistic regression (max_iter 100) on `n_experiments` undersampled training sets of `samples_per_label`
    texts per label; clustering runs MTEB 2's bootstrapped mini-batch k-means on the raw embeddings,
    `n_experiments` samples of `cluster_sample_size` texts; pair classification reports the best AP over the
    similarity functions. "legacy" is moembed's earlier protocol (see each type's module). The seed defaults to
    MTEB's (42) and to 0 for legacy.
    """

    name: str = "mteb"
    seed: int | None = None
    n_experiments: int = 10  # classification: undersampled training sets; clustering: bootstrap samples
    samples_per_label: int = 8  # classification: training texts per label in each experiment
    cluster_sample_size: int = 16_384  # clustering: texts drawn (with replacement) for each bootstrap sample

    @property
    def random_seed(self) -> int:
        return self.seed if self.seed is not None else (42 if self.name == "mteb" else 0)


@dataclass
class Task:
    """A loaded task. `data` holds the validated content, as the task type's `read` returns it:

    retrieval: corpus {id: text}, queries {id: text}, qrels {qid: {did: int}};
    sts / pair_classification: rows [(s1, s2, score_or_label)];
    classification / clustering: test [(text, label)], train [(text, label)] or None;
    reranking: rows [(query, positives, negatives)].
    """

    name: str
    type: str
    split: str
    path: Path
    data: dict[str, Any] = field(default_factory=dict)
    protocol: Protocol = Protocol()  # used by the types that have `protocols`


@dataclass(frozen=True)
class RunOptions:
    """Search settings (retrieval): exact FAISS search, corpus chunk and query block of the bounded-memory search."""

    use_faiss: bool = False
    chunk_size: int = 10_000
    query_block: int = 256


class TaskType:
    """One kind of task: how its directory is recognised and read, how a model is scored, its main score and the
    prompt names its texts are encoded with (nomic-embed-v1 §5: search prefixes for retrieval-like tasks,
    "classification" for symmetric ones)."""

    name: ClassVar[str]
    main_score: ClassVar[str]  # MTEB's main score of the type
    query_prompt: ClassVar[str]  # prompt name of queries (or of every text of a symmetric task)
    document_prompt: ClassVar[str]  # prompt name of documents / candidates
    detect_files: ClassVar[tuple[str, ...]] = ()  # a directory holding any of these files is of this type
    detect_keys: ClassVar[frozenset[str] | None] = None  # else: the first record of <split>.jsonl has these keys
    protocols: ClassVar[tuple[str, ...]] = ()  # scoring protocols a task.json may choose (`Protocol`); () for none

    def read(self, path: Path, split: str) -> dict[str, Any]:
        """The validated content of a task directory (errors name the file and line)."""
        raise NotImplementedError

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions) -> dict[str, float]:
        """Scores of `model` on a loaded task of this type."""
        raise NotImplementedError

    def texts(self, data: dict[str, Any]) -> list[str]:
        """The task's texts that set int8 ranges when a model has no calibration (documents first)."""
        raise NotImplementedError


class SentencePairType(TaskType):
    """A task on rows (sentence1, sentence2, gold) scored by the similarity of each pair (STS, pair classification)."""

    def similarities(self, model, task: Task, view: View, cache: EmbeddingCache | None) -> np.ndarray:
        """The model's similarity of every row's two sentences, (n,)."""
        rows = task.data["rows"]
        a = encode(model, [r[0] for r in rows], self.query_prompt, view, cache)
        b = encode(model, [r[1] for r in rows], self.document_prompt, view, cache)
        return pairwise(model, a, b)

    def texts(self, data: dict[str, Any]) -> list[str]:
        return [r[0] for r in data["rows"]] + [r[1] for r in data["rows"]]
