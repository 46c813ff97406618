"""The words of the quickstart report: settings, the recipe's decisions, data tables and README (the model cards' are
`report.quickstart_card`'s, written by `moembed.model.card`).

`decisions(ctx, stages)` gathers what the recipe chose for the user — split sizes, how many pairs consistency
filtering kept per source, negatives per query, steps, learning rate — and the data-scale warning; the report and
the model card state them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from moembed.recipes.context import RecipeContext

# Below this many training pairs the report warns that the MoE is not expected to beat the dense control:
# nomic-embed-v2-moe §7.2 saw an MoE underperform its parameter-equivalent dense model even with 100M
# contrastive pairs ("MoE models tend to underperform dense models under limited training regimes").
MOE_DATA_SCALE = 1_000_000


class Gap(NamedTuple):
    """One upcycling's MoE − dense gap, nDCG@10 ×100: mean, min and max over seeds."""

    test: tuple[float, float, float]  # the recipe's held-out test sets (mean over sets)
    dev: tuple[float, float, float]  # the built-in dev suite: tasks outside the training domains
    seeds: int


# What benchmarks/moe_vs_dense.py measured for each preset's recipe (docs/moe.md, "MoE vs dense", the table of runs
# with the experts' casts renewed every step; BENCHMARKS.md): the default scale and the machine, the gap of the
# default upcycling and of its two alternatives at the dense model's active parameters there, each trained on the
# same data, steps and batches as its dense control; then, in words, the other options and the larger scales.
MEASURED_GAP: dict[str, tuple[str, dict[str, Gap], str]] = {
    "english": ("--size small, 120 steps × batch 32; Zen 4 EPYC, bf16", {
        "copies (8 experts, top-2, the default)": Gap((0.01, -0.02, 0.02), (0.23, 0.06, 0.35), 3),
        "virtual groups (G = 4, 8 experts, top-4: the dense model's active parameters)":
            Gap((-0.15, -0.28, -0.06), (0.26, 0.09, 0.38), 3),
        "virtual groups with routers by source (upcycling.router_init: sources)":
            Gap((-0.07, -0.23, 0.05), (0.08, -0.07, 0.18), 3),
    }, "the other options there tie or trail (eight groups +0.01, raw gates -1.15); with four times the batch "
       "(128 × 30) copies gave +0.11 and groups -0.12 (dev suite +0.17 and +0.22), with 29k pairs at batch 256 -0.03 "
       "and -0.12 (dev suite +0.23 and +0.04), 3 seeds each, at batch 1024 copies +0.13 and groups +0.01 (dev suite "
       "+0.24 and -0.17, 3 and 2 seeds), and copies with 133k pairs (batch 256 × 500) +0.03 (dev suite -0.06, 2 "
       "seeds; groups -0.10, dev suite -0.22): fitted against the pairs seen the copies' gap is flat, and no option "
       "measured leads its control by a point"),
    "multilingual": ("--size small, 30 pretraining steps × batch 64, then 60 × 32; Zen 4 EPYC, bf16", {
        "copies (8 experts, top-2, the default)": Gap((0.08, 0.01, 0.19), (0.16, 0.01, 0.37), 3),
        "virtual groups (G = 4, 8 experts, top-4: the dense model's active parameters)":
            Gap((-0.06, -0.16, 0.08), (0.36, 0.25, 0.45), 3),
        "virtual groups with routers by language (upcycling.router_init: sources)":
            Gap((0.11, -0.00, 0.22), (0.27, -0.07, 0.59), 3),
    }, "the other options there trail (eight groups -0.58, raw gates -1.56); over four times the steps (15,360 "
       "pairs) copies gave +0.05, groups -0.39 and routers by language -0.24 (dev suite +0.12, -0.09 and -0.01), "
       "3 seeds each, and with a four times larger pool, the load balanced over 16 steps, routers by language "
       "-0.07 over six times the steps and -0.04 over the pool seen whole (dev suite +0.18 and +0.30; 3 and 2 "
       "seeds): fitted against the pairs seen no option's gap closes beyond its noise"),
}


def _spread(m: float, lo: float, hi: float) -> str:
    return f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def measured_gap(preset: str) -> str:
    """The measured MoE − dense gaps of `preset`'s recipe in words, for the report's verdict and warning."""
    at, gaps, beyond = MEASURED_GAP[preset]
    parts = [f"{name} {_spread(*g.test)} / {_spread(*g.dev)} over {g.seeds} seeds" for name, g in gaps.items()]
    return (f"At this recipe's default scale ({at}) benchmarks/moe_vs_dense.py measured MoE − dense nDCG@10 ×100 on "
            f"the held-out test sets / the dev suite, mean [min, max] over seeds: {'; '.join(parts)}; {beyond} "
            "(docs/moe.md, \"MoE vs dense\").")


def base_label(ctx: RecipeContext) -> str:
    return f"{'all-MiniLM-L6-v2' if not ctx.cfg.base else ctx.base.name} (base)"


def decisions(ctx: RecipeContext, stages: dict) -> dict:
    c, t = ctx.cfg, ctx.cfg.train
    data, curate = stages.get("data", {}), stages.get("curate", {})
    user = data.get("user")
    sources = (curate.get("filter") or {}).get("sources", {})
    trained = sum(curate.get("train_sources", {}).values())
    pretrained = sum((curate.get("pretrain_sources") or {}).values())  # the larger, looser pool of stage 1
    pre = c.pretrain
    seen = t.steps * t.batch_size + (pre.steps * pre.batch_size if pre else 0)  # both stages, as the study counts
    steps = f"{pre.steps} pretraining and {t.steps} finetuning steps" if pre else f"{t.steps} steps"
    out = {
        "split": ({"documents": user["documents"], "pairs": user["pairs"], "duplicates_dropped": user["duplicates"]}
                  if user else {k: v for k, v in data.get("datasets", {}).items()}),
        "kept_per_source": {s: {"pairs": v["pairs"], "kept": v["kept"]} for s, v in sorted(sources.items())},
        "trained_per_source": curate.get("train_sources", {}),
        "too_small_sources": curate.get("too_small", {}),
        "filter_top_k": curate.get("filter_top_k", c.filter_top_k),
        "pretrained_per_source": curate.get("pretrain_sources"),
        "pretrain_too_small": curate.get("pretrain_too_small", {}),
        "negatives": {"mode": curate.get("negatives_mode"), "per_query": curate.get("negatives_per_query"),
                      "mined": c.num_negatives, "margin": c.margin, "drawn_per_step": t.hard_negatives},
        "steps": t.steps, "batch_size": t.batch_size, "lr": t.lr, "warmup_steps": t.warmup_steps,
        "pretrain": c.pretrain.model_dump() if c.pretrain else None, "sampler_alpha": c.sampler_alpha,
        "processes": c.nproc, "training_pairs": trained, "examples_seen": seen,
    }
    if trained < MOE_DATA_SCALE:
        out["warning"] = (
            f"the data is too small for the MoE to be expected to help: {trained:,} training pairs "
            f"({f'{pretrained:,} in the pretraining pool; ' if pretrained else ''}{seen:,} examples seen in {steps}). "
            f"{measured_gap(c.preset)} "
            "nomic-embed-v2-moe §7.2 saw an MoE model underperform its dense counterpart even with 100M contrastive "
            "pairs: MoE needs data scale. At this scale the dense model, as good and faster to encode, is the safer "
            "choice.")
    return out


def languages(summary: dict, test_sets: dict) -> str:
    """Per language (monolingual test sets) and per language pair (cross-lingual ones): nDCG@10 ×100 of base, dense
    and MoE at full dimension, with the finetuned models' change against the base, and what that says."""
    groups: dict[str, list[str]] = {}
    for name, t in test_sets.items():
        key = t["query_lang"] if t["query_lang"] == t["doc_lang"] else f"{t['query_lang']}→{t['doc_lang']}"
        groups.setdefault(key, []).append(name)

    def mean(model: str, names: list[str]) -> float:
        xs = [summary[model]["per_task"].get(n, float("nan")) for n in names]
        return 100 * sum(xs) / len(xs)

    lines = ["| language | test sets | base | dense | MoE | dense − base | MoE − base | MoE − dense |",
             "|---|---|---|---|---|---|---|---|"]
    scores = {}
    for key in sorted(groups, key=lambda k: ("→" in k, k)):
        b, d, m = (mean(x, groups[key]) for x in ("base", "dense", "moe"))
        scores[key] = (b, d, m)
        lines.append(f"| {key} | {len(groups[key])} | {b:.1f} | {d:.1f} | {m:.1f} | {d - b:+.1f} | {m - b:+.1f} | {m - d:+.1f} |")
    cross = [v for k, v in scores.items() if "→" in k]
    said = []
    if cross:
        b, d, m = (sum(v[i] for v in cross) / len(cross) for i in range(3))
        kept = "kept" if min(d, m) >= b - 1.0 else "NOT kept"
        said.append(f"Cross-lingual retrieval ({len(cross)} language pairs): base {b:.1f}, dense {d:.1f} ({d - b:+.1f}), "
                    f"MoE {m:.1f} ({m - b:+.1f}) — the base's cross-lingual retrieval is {kept} by finetuning "
                    "(within 1 point or better counts as kept).")
    if "en" in scores:
        b, d, m = scores["en"]
        said.append(f"English: base {b:.1f}, dense {d:.1f} ({d - b:+.1f}), MoE {m:.1f} ({m - b:+.1f}).")
    wins = [k for k, (b, d, m) in scores.items() if m > d + 0.5]
    losses = [k for k, (b, d, m) in scores.items() if m < d - 0.5]
    said.append(f"The MoE model beats the dense control by more than 0.5 points in {len(wins)} of {len(scores)} "
                f"languages / pairs ({', '.join(wins) or 'none'}) and is more than 0.5 points below it in "
                f"{len(losses)} ({', '.join(losses) or 'none'}).")
    return "\n".join(lines) + "\n\n" + " ".join(said)


GROUPS = ("cross-lingual", "non-English", "English", "all")  # the headline of a multilingual run, in this order


def group_of(test_set: dict) -> str:
    """cross-lingual (queries and documents in two languages), English, or non-English (one other language)."""
    if test_set["query_lang"] != test_set["doc_lang"]:
        return "cross-lingual"
    return "English" if test_set["query_lang"] == "en" else "non-English"


def group_members(test_sets: dict) -> dict[str, list[str]]:
    """Each of GROUPS that has test sets → their names ("all": every one), in GROUPS order."""
    members = {g: [n for n, t in test_sets.items() if g == "all" or group_of(t) == g] for g in GROUPS}
    return {g: names for g, names in members.items() if names}


def group_summary(summary: dict, test_sets: dict) -> str:
    """The terminal headline of a run over many languages: per group of test sets (GROUPS), mean nDCG@10 ×100 of
    base, dense and MoE at full dimension in float32, each test set counting once; the per-set and per-language
    tables stay in the report."""
    lines = ["| test sets | n | base | dense | MoE | MoE − dense |", "|---|---|---|---|---|---|"]
    for g, names in group_members(test_sets).items():
        b, d, m = (100 * sum(summary[x]["per_task"].get(n, float("nan")) for n in names) / len(names)
                   for x in ("base", "dense", "moe"))
        lines.append(f"| {g} | {len(names)} | {b:.1f} | {d:.1f} | {m:.1f} | {m - d:+.1f} |")
    return "\n".join(lines)


def _decision_lines(d: dict) -> str:
    lines = []
    split = d["split"]
    if "documents" in split:
        docs, pairs = split["documents"], split["pairs"]
        lines.append(f"- split by document (no document in two splits): train {docs['train']} documents / "
                     f"{pairs['train']} pairs (of {pairs['train_available']} available), dev {docs['dev']} / "
                     f"{pairs['dev']}, test {docs['test']} / {pairs['test']}; {split['duplicates_dropped']} "
                     "duplicate pairs dropped")
    kept = d["kept_per_source"]
    if kept:
        lines.append(f"- consistency filtering (top-{d['filter_top_k']}) kept: " + ", ".join(
            f"{s} {v['kept']}/{v['pairs']} ({100 * v['kept'] / max(v['pairs'], 1):.0f}%)" for s, v in kept.items()))
    pre = d.get("pretrained_per_source")
    if pre is not None:
        lines.append(f"- pretrained on, per source (the top-{d['filter_top_k']} pool, one source per batch): "
                     + ", ".join(f"{s} {n}" for s, n in pre.items()) + f" — {sum(pre.values())} pairs")
        if d["pretrain_too_small"]:
            lines.append("- not pretrained on (fewer pairs than one pretraining batch): " + ", ".join(
                f"{s} {n}" for s, n in d["pretrain_too_small"].items()))
    lines.append(f"- {'finetuned' if pre is not None else 'trained'} on, per source (one source per batch): "
                 + ", ".join(f"{s} {n}" for s, n in d["trained_per_source"].items())
                 + f" — {sum(d['trained_per_source'].values())} pairs")
    if d["too_small_sources"]:
        lines.append(f"- not {'finetuned' if pre is not None else 'trained'} on (fewer pairs than one batch): "
                     + ", ".join(f"{s} {n}" for s, n in d["too_small_sources"].items()))
    n = d["negatives"]
    lines.append(f"- negatives per query: {n['per_query']} on average ({n['mode']}: up to {n['mined']} mined by the "
                 f"teacher, positive-aware margin {n['margin']}), {n['drawn_per_step']} drawn per query in each step")
    if d.get("pretrain"):
        p = d["pretrain"]
        lines.append(f"- pretraining: {p['steps']} steps × batch {p['batch_size']}, learning rate {p['lr']}")
    lines.append(f"- {'finetuning: ' if d.get('pretrain') else ''}{d['steps']} steps × batch {d['batch_size']} "
                 f"({d['processes']} process(es)), learning rate {d['lr']} with {d['warmup_steps']} warmup steps")
    return "\n".join(lines)


def upcycling(c) -> str:
    """The upcycling in words: experts, top-k, groups, gates and the other options that are on."""
    u = c.upcycling
    parts = [f"{c.experts} experts, top-{c.top_k}"]
    if u.granularity > 1:
        parts.append(f"in {c.experts // u.granularity} virtual groups of {u.granularity} slices each 1/{u.granularity} "
                     "of the MLP (He et al. 2024)")
    parts.append("renormalised gates" if u.renormalize else "softmax gates, not renormalised")
    if u.router_init == "kmeans":
        parts.append(f"routers from k-means centroids over {u.kmeans_texts} training texts")
    if u.router_init == "sources":
        parts.append(f"routers that send each training source's tokens to its own group of experts (from "
                     f"{u.kmeans_texts} training texts)")
    if u.reinit:
        parts.append(f"{u.reinit:g} of each expert's hidden units re-drawn (Drop-Upcycling)")
    if u.noise:
        parts.append(f"noise {u.noise:g}")
    if u.balance_rate:
        parts.append(f"auxiliary-loss-free balancing, bias step {u.balance_rate:g}")
    return ", ".join(parts)


def settings(ctx: RecipeContext) -> str:
    c, t = ctx.cfg, ctx.cfg.train
    bf16 = "on" if t.bf16_on(ctx.device.type) else "off"
    teacher = base_label(ctx)[: -len(" (base)")] if ctx.teacher == ctx.base else ctx.teacher.name
    pre = c.pretrain

    def kept(k: int | None) -> str:
        return f"the pairs kept by consistency filtering top-{k}" if k else "every pair (no consistency filtering)"

    pre_k = c.curation_top_k if pre else None
    window = f" over the last {t.balance_window} steps' routing" if t.balance_window > 1 else ""
    stage1 = (f"- stage 1, contrastive pretraining (nomic-embed-v1 §3, no MLM): {pre.steps} steps, batch "
              f"{pre.batch_size}, on {kept(pre_k)}{' (the larger, noisier pool)' if pre_k != c.filter_top_k else ''}"
              f", in-batch negatives only, InfoNCE τ = {pre.temperature}, lr {pre.lr} with {pre.warmup_steps} "
              f"warmup steps, Matryoshka dims {ctx.matryoshka_dims}; then stage 2:\n") if pre else ""
    alpha = (f"- sources (one per language or language pair) sampled with p ∝ n^α, α = {c.sampler_alpha} "
             "(nomic-embed-v2 Table 2)\n") if c.sampler_alpha else ""
    return stage1 + alpha + (
        f"- base: {base_label(ctx)[: -len(' (base)')]} ({ctx.width} wide); MoE: every {c.every}nd MLP upcycled to "
        f"{upcycling(c)} (docs/moe.md, \"Upcycling options\")\n"
        f"- finetuning: {t.steps} steps, batch {t.batch_size} (one source per batch), on {kept(c.filter_top_k)} "
        f"with {t.hard_negatives} mined hard negative(s) per query, InfoNCE τ = {t.temperature}, Matryoshka dims "
        f"{ctx.matryoshka_dims}, load-balancing α = {t.aux_loss_coef}{window} (MoE only), AdamW lr {t.lr} with "
        f"{t.warmup_steps} warmup steps and linear decay, max lengths {t.max_query_length}/{t.max_doc_length} "
        f"tokens, bf16 autocast {bf16}\n"
        f"- data curation: consistency filtering and positive-aware mining ({c.num_negatives} negatives, margin "
        f"{c.margin}) with {teacher} as teacher, one embedding pass\n"
    )


def data_lines(stages: dict) -> str:
    d = stages.get("data", {}).get("datasets", {})
    f = (stages.get("curate", {}).get("filter") or {}).get("sources", {})
    lines = ["| dataset | training pairs built | test queries / documents |", "|---|---|---|"]
    for name, c in d.items():
        test = c.get("test", {})
        lines.append(f"| {name} | {c.get('train')} | {test.get('queries', '?')} / {test.get('documents', test.get('corpus', '?'))} |")
    user = stages.get("data", {}).get("user")
    if user:
        lines += ["", "| input file | records | empty | duplicates | usable pairs |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['read']} | {v['empty']} | {v['duplicate']} | {v['usable']} |" for k, v in user["files"].items()]
    lines += ["", "| source | pairs | kept by consistency filtering |", "|---|---|---|"]
    for s, c in sorted(f.items()):
        lines.append(f"| {s} | {c['pairs']} | {c['kept']} ({100 * c['kept'] / max(c['pairs'], 1):.0f}%) |")
    return "\n".join(lines)


def report(ctx: RecipeContext, table, verdict_text, plots, stages, load_lines, decisions, suite_table,
           language_text=None) -> str:
    secs = sum(v.get("seconds", 0) for v in stages.values())
    warning = f"> **Warning:** {decisions['warning']}\n\n" if decisions.get("warning") else ""
    held_out = ("your test split (documents never seen in training)" if ctx.cfg.user_data
                else "the held-out test sets (documents never seen in training)")
    suite = ("## Built-in dev suite (what finetuning cost or gained elsewhere)\n\nMain score ×100 per task, full "
             f"dimension, float32.\n\n{suite_table}\n\n") if suite_table else ""
    return (
        "# moembed quickstart report\n\n"
        f"Mean nDCG@10 ×100 on {held_out}. Columns per test set are at full dimension in float32; `avg dN` "
        "averages over test sets at Matryoshka dimension N; `avg int8` and `avg binary` at full dimension.\n\n"
        f"{table}\n\n**{verdict_text}**\n\n" + warning
        + (f"## Per language and cross-lingual\n\nnDCG@10 ×100, full dimension, float32; a language pair "
           f"x→y retrieves y documents for x queries.\n\n{language_text}\n\n" if language_text else "") +
        "## What the recipe decided\n\n" + _decision_lines(decisions) + "\n\n" + suite +
        "## Settings\n\n" + settings(ctx) + f"\nTotal time of the stages: {secs / 60:.1f} minutes.\n\n"
        "## Data\n\n" + data_lines(stages) + "\n\n"
        "## Expert load and diagnostics of the finetuned MoE model (test documents; MI label: the test set)\n\n" + "\n".join(f"    {x}" for x in load_lines) + "\n\n"
        "## Plots\n\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n\n"
        "## Files\n\n- `results.json`, `results.md`: every model × test set × dimension × precision\n"
        "- `models/moe`, `models/dense`: moembed format; `models/moe-st`, `models/dense-st`: sentence-transformers format\n"
    )

