"""Model cards: the README.md every model directory moembed writes carries (save, train, upcycle, every export).

    card = build_card(parts, "onnx", CardInfo(datasets=["msmarco"], results=[...]))   # huggingface_hub.ModelCard
    write_card(parts, out_dir, "moembed")                                             # README.md in out_dir

The YAML front matter is what model hubs index (`huggingface_hub.ModelCardData`): library_name, pipeline_tag
sentence-similarity, tags, base_model, language, datasets, and the model's own evaluation as `model-index` results
when there is one. The body gives the architecture (total and active parameters; experts, top-k and MoE layers),
how to load the directory in its format, and the training recipe, data and evaluation table when known.

What a writer knows beyond the model (`CardInfo`) is passed in; what it does not know is inherited from the card
of the directory the model was read from (`parts.source_dir`): a model saved, exported or finetuned from a
moembed model keeps its base model, languages, datasets and recipe. A base model read from a Hugging Face or
sentence-transformers directory becomes the card's `base_model` (its card's title, else the directory's name), in
its card's languages.
A README.md in the target that moembed did not write is kept beside the card as README.orig.md (and logged).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

log = logging.getLogger("moembed")

CARD_TAG = "moembed"  # marks a card moembed wrote (its tags), so that its metadata is inherited, never a user's
KEPT_README = "README.orig.md"
SECTIONS = ("Training", "Data")  # body sections a derived model inherits
FORMAT_LIBRARY = {"moembed": "moembed", "sentence-transformers": "sentence-transformers",
                  "huggingface": "transformers", "onnx": "sentence-transformers"}


@dataclass
class CardInfo:
    """What a writer knows beyond the model itself; empty fields are inherited from the source's card."""

    base_model: str | None = None
    languages: list[str] = field(default_factory=list)  # ISO 639-1 codes, or ["multilingual"]
    datasets: list[str] = field(default_factory=list)
    summary: str | None = None  # a paragraph under the title
    training: str | None = None  # markdown: the recipe (stages, steps, learning rate, loss)
    data: str | None = None  # markdown: the training data
    # the model's own evaluation, MTEB-like entries {"task_name", "main_score", "dim", "precision"} (model-index)
    results: list[dict] = field(default_factory=list)
    metric: str = "ndcg_at_10"  # what main_score is
    evaluation: str | None = None  # markdown table of that evaluation
    sections: dict[str, str] = field(default_factory=dict)  # further sections, heading → markdown


def parameter_counts(config, named: dict) -> tuple[int, int]:
    """(total, active per token) of encoder tensors `named` (name → tensor; integer buffers are not parameters):
    in an MoE layer only top_k of num_experts experts run for each token."""
    sizes = {n: t.numel() for n, t in named.items() if t.is_floating_point()}
    total = sum(sizes.values())
    if config.moe is None:
        return total, total
    expert = sum(v for n, v in sizes.items() if ".mlp.experts" in n)
    return total, total - expert + expert * config.moe.top_k // config.moe.num_experts


def architecture(parts) -> list[tuple[str, str]]:
    """(what, value) rows describing the encoder of `parts` (io.ModelParts)."""
    c = parts.config
    total, active = parameter_counts(c, parts.state_dict)
    rows = [("family", f"{c.hf_model_type or 'moembed'} ({c.family}-style layers, {c.mlp} MLP, {c.position} positions)"),
            ("layers x hidden", f"{c.num_layers} x {c.hidden_size} ({c.num_heads} heads, MLP {c.intermediate_size})"),
            ("parameters", f"{total:,} total, {active:,} active per token"),
            ("embedding dimension", str(c.hidden_size)),
            ("pooling", f"{parts.pooling}{', L2-normalised' if parts.normalize else ''}"
                        f"{'' if parts.include_prompt else ', prompt tokens left out'}"),
            ("similarity", parts.similarity_fn_name),
            ("max length", f"{parts.tokenizer.max_length} tokens"),
            ("vocabulary", str(c.vocab_size))]
    if c.moe is not None:
        m = c.moe
        rows.append(("mixture of experts", f"{m.num_experts} experts, top-{m.top_k}, "
                     f"{'renormalised gates' if m.renormalize else 'softmax gates'}, MoE layers "
                     f"{', '.join(str(i + 1) for i in c.moe_layers())} of {c.num_layers}"))
    if c.move is not None:
        rows.append(("MoVE", f"{c.move.num_experts} vocabulary experts over {c.move.base_vocab_size} base tokens"))
    if parts.prompts:
        rows.append(("prompts", ", ".join(f"{k}=`{v}`" for k, v in parts.prompts.items())))
    return rows


def table(header: tuple[str, ...], rows: list[tuple]) -> str:
    """A markdown table (the recipes and data of `moembed train` / `moembed upcycle` cards)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows])


def usage(fmt: str, parts) -> str:
    """How to load a directory of this format, as a fenced Python block."""
    from moembed.model.families import exporter_for

    if fmt == "moembed":
        code = 'from moembed import Embedder\n\nmodel = Embedder.load("PATH")\nvectors = model.encode(["a text"])'
    elif fmt == "onnx":
        code = ('from sentence_transformers import SentenceTransformer\n\n'
                'model = SentenceTransformer("PATH", backend="onnx")  # onnx/model.onnx; the int8 graph:\n'
                '# SentenceTransformer("PATH", backend="onnx", model_kwargs={"file_name": "model_qint8_quantized.onnx"})\n'
                'vectors = model.encode(["a text"])\n\n'
                '# or ONNX Runtime alone: inputs input_ids, attention_mask; output sentence_embedding (pooled)\n'
                'import onnxruntime as ort\nsession = ort.InferenceSession("PATH/onnx/model.onnx")')
    elif fmt == "huggingface":
        code = 'from transformers import AutoModel, AutoTokenizer\n\nmodel = AutoModel.from_pretrained("PATH")'
    else:
        # an encoder no transformers class holds is written with moembed's own module (io.export_sentence_transformers)
        extra = ", trust_remote_code=True" if exporter_for(parts.config) is None else ""
        code = f'from sentence_transformers import SentenceTransformer\n\nmodel = SentenceTransformer("PATH"{extra})'
        code += '\nvectors = model.encode(["a text"])'
    return f"```python\n{code}\n```"


def build_card(parts, fmt: str, info: CardInfo | None = None):
    """The `huggingface_hub.ModelCard` of a model in format `fmt` (a key of FORMAT_LIBRARY)."""
    from huggingface_hub import ModelCard, ModelCardData

    info = merge(info or CardInfo(), inherited(parts))
    c = parts.config
    tags = [CARD_TAG, "sentence-transformers", "feature-extraction", "sentence-similarity", "text-embeddings"]
    tags += ["mixture-of-experts", "moe"] if c.moe is not None else []
    tags += ["onnx"] if fmt == "onnx" else []
    data = ModelCardData(library_name=FORMAT_LIBRARY[fmt], pipeline_tag="sentence-similarity", tags=tags,
                         base_model=info.base_model, language=info.languages or None, datasets=info.datasets or None,
                         license=None, model_name=parts.name, eval_results=_eval_results(parts.name, info) or None)
    body = [f"# {parts.name}", info.summary or _default_summary(parts, info, fmt),
            "## Architecture", "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in architecture(parts)),
            "## Usage", usage(fmt, parts)]
    for title, text in (("Training", info.training), ("Data", info.data), ("Evaluation", info.evaluation),
                        *info.sections.items()):
        if text:
            body += [f"## {title}", text.strip()]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(body) + "\n")


def _default_summary(parts, info: CardInfo, fmt: str) -> str:
    kind = "A sparse Mixture-of-Experts" if parts.config.moe is not None else "A"
    base = f", from [{info.base_model}]" if info.base_model else ""
    where = {"moembed": "in moembed's format", "sentence-transformers": "in sentence-transformers' format",
             "huggingface": "in its family's Hugging Face layout", "onnx": "as an ONNX graph"}[fmt]
    return f"{kind} text-embedding model{base}, written by moembed {where}."


def _eval_results(name: str, info: CardInfo) -> list:
    """model-index entries: one per task at the full dimension in float32 (the headline numbers)."""
    from huggingface_hub import EvalResult

    if not info.results:
        return []
    full = max(int(e.get("dim") or 0) for e in info.results)
    out = []
    for e in info.results:
        if (e.get("dim") or full) != full or e.get("precision", "float32") != "float32":
            continue
        task = str(e["task_name"])
        out.append(EvalResult(task_type="retrieval", dataset_type=task, dataset_name=task, metric_type=info.metric,
                              metric_value=round(float(e["main_score"]), 5), task_name="Retrieval"))
    return out


# ---- inheritance from the source directory --------------------------------------------------------------------


def merge(info: CardInfo, base: CardInfo) -> CardInfo:
    """`info` with its empty fields taken from `base`."""
    empty = {k: getattr(base, k) for k in CardInfo.__dataclass_fields__ if not getattr(info, k) and getattr(base, k)}
    return replace(info, **empty)


def inherited(parts) -> CardInfo:
    """What the card of `parts.source_dir` says (a moembed card), or its base model (any other directory)."""
    src = parts.source_dir
    if src is None:
        return CardInfo()
    card = read_card(src / "README.md")
    if card is None:  # a model moembed did not write: the model itself is the base, in its card's languages
        return _foreign(src)
    d = card.data
    sections = split_sections(card.text)
    return CardInfo(base_model=d.get("base_model"), languages=_as_list(d.get("language")),
                    datasets=_as_list(d.get("datasets")), training=sections.get("Training"), data=sections.get("Data"))


def read_card(path: Path):
    """The moembed card at `path`, or None (absent, unreadable, or not written by moembed)."""
    from huggingface_hub import ModelCard

    if not path.is_file():
        return None
    try:
        card = ModelCard.load(path)
    except Exception:  # noqa: BLE001 - a README that is no card is simply not inherited from
        return None
    return card if CARD_TAG in (card.data.get("tags") or []) else None


def _foreign(src: Path) -> CardInfo:
    """A source moembed did not write: its name (its card's title, else its directory's name) and languages."""
    from huggingface_hub import ModelCard

    name, languages = src.resolve().name, []
    try:
        card = ModelCard.load(src / "README.md")
        title = next((ln[2:].strip() for ln in card.text.splitlines() if ln.startswith("# ")), "")
        name = title if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", title) else name
        languages = _as_list(card.data.get("language"))
    except Exception:  # noqa: BLE001 - no README, or one that is no card: the directory's name
        pass
    return CardInfo(base_model=name, languages=languages)


def _as_list(value) -> list[str]:
    return [] if not value else [value] if isinstance(value, str) else list(value)


def split_sections(text: str) -> dict[str, str]:
    """A markdown body's `## ` sections, heading → text."""
    out, title, lines = {}, None, []
    for line in text.splitlines():
        if line.startswith("## "):
            if title is not None:
                out[title] = "\n".join(lines).strip()
            title, lines = line[3:].strip(), []
        elif title is not None:
            lines.append(line)
    if title is not None:
        out[title] = "\n".join(lines).strip()
    return out


# ---- writing --------------------------------------------------------------------------------------------------


def write_card(parts, tmp: Path, fmt: str, info: CardInfo | None = None, target: Path | None = None) -> None:
    """README.md in the directory being written (`tmp`, renamed onto `target` afterwards). A README.md already in
    `target` that moembed did not write is copied into the new directory as README.orig.md, with a warning; a
    README.orig.md kept so before is carried over."""
    if target is not None and (target / "README.md").is_file() and read_card(target / "README.md") is None:
        (tmp / KEPT_README).write_bytes((target / "README.md").read_bytes())
        log.warning("%s: README.md was not written by moembed; kept as %s, the model card replaces it",
                    target, KEPT_README)
    elif target is not None and (target / KEPT_README).is_file() and not (tmp / KEPT_README).exists():
        (tmp / KEPT_README).write_bytes((target / KEPT_README).read_bytes())
    (tmp / "README.md").write_text(str(build_card(parts, fmt, info)), encoding="utf-8")
