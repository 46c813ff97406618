"""The words of the quickstart report: settings, the recipe's decisions, data tables and README (the model cards' are
`report.quickstart_card`'s, written by `moembed.model.card`).

`decisions(ctx, stages)` gathers what the recipe chose for the user — split sizes, how many pairs consistency
filtering kept per source, negatives per query, steps, learning rate — and the data-scale warning; the report and
the model card state them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moembed.recipes.context import RecipeContext

# Below this many training pairs the report warns that the MoE is not expected to beat the dense control:
# nomic-embed-v2-moe §7.2 saw an MoE underperform its parameter-equivalent dense model even with 100M
# contrastive pairs ("MoE models tend to underperform dense models under limited training regimes").
MOE_DATA_SCALE = 1_000_000

# What benchmarks/moe_vs_dense.py measured at each preset's default scale (BENCHMARKS.md and docs/moe.md, "MoE vs
# dense"): the scale, then per upcycling the MoE − dense control gap, mean nDCG@10 ×100 over the held-out test sets
# (mean over seeds, min, max, seeds), the dense model and each MoE trained on the same data, steps and batches;
# then what larger scales showed, where they were measured.
MEASURED_GAP: dict[str, tuple[str, dict[str, tuple[float, float, float, int]], str]] = {
    "english": ("--size small, 120 steps × batch 32", {
        "copies (8 experts, top-2)": (-0.01, -0.06, 0.04, 2),
        "virtual groups (G = 4, 8 experts, top-4, the dense model's active parameters)": (-0.14, -0.28, 0.00, 2),
    }, "with 29k and 133k pairs (batch 256 and 1024, on a GPU) the gap stayed negative, -0.2 to -0.4 in-domain and "
       "-0.9 to -2.4 on the dev suite, and fitted against the pairs seen it widens; at the default scale on an AMX "
       "Xeon in bf16, copies gave -0.04 (dev suite -0.47), eight virtual groups (32 experts, top-4) +0.04 (dev "
       "suite -0.29) and routers trained at 20 times the learning rate -0.65 (dev suite "
       "-0.98), two groups whose routers start by source (upcycling.router_init: sources) -0.17 (dev suite -0.44), 3 "
       "seeds each; but all these bf16 runs trained the experts on a cast of their first weights (fixed since), and "
       "run again with the fix on a Zen 4 EPYC copies gave +0.01 (dev suite +0.23), groups -0.15 (dev suite +0.26), "
       "routers by source -0.07 (dev suite +0.08) and with the load balanced over 16 steps -0.25 (dev suite +0.13), "
       "eight groups +0.01 (dev suite -0.46) and routers at 20 times the learning rate -0.87 (dev suite -1.10), 3 "
       "seeds each, and with 29k pairs at batch 256 copies gave -0.03 and groups -0.12 (dev suite +0.23 and +0.04, 3 "
       "seeds each), where the GPU's runs had -0.21 and -0.26 (dev suite -1.00 and -0.88), and at four times the "
       "batch on the default pool (128 × 30) copies gave +0.11 and groups -0.12 (dev suite +0.17 and +0.22, 3 seeds "
       "each): fitted on the copies without the defect the gap is flat in pairs seen"),
    "multilingual": ("--size small, 30 pretraining steps × batch 64, then 60 × 32", {
        "copies (8 experts, top-2)": (-0.00, -0.02, 0.01, 2),
        "virtual groups (G = 4, 8 experts, top-4, the dense model's active parameters)": (-0.08, -0.24, 0.07, 2),
    }, "on the English dev suite +0.2 and +0.4, within a point (AVX2, float32); on an AMX Xeon in bf16 groups gave "
       "-0.49 over 3 seeds, and with the batches doubled (the same pairs seen) every option fell behind on every seed, "
       "-0.51 to -0.55 (dev suite -0.14 to -0.39); with four times the steps (the pools seen once) groups gave -0.50 "
       "(dev suite -0.19, 3 seeds), and with a four times larger pool (--size medium) at the default steps -0.50 "
       "(dev suite +0.25, 3 seeds); eight virtual groups (32 experts, top-4) at the default scale gave -0.72 (dev suite "
       "-0.11, 3 seeds), and two groups whose routers start by language (upcycling.router_init: sources) -0.17 (dev "
       "suite +0.39, 3 seeds; with the four times larger pool -0.28, dev suite +0.15), still behind on every "
       "seed; copies gave -0.56 there, with routers by language or without (dev suite -0.46 and +0.04, 3 seeds); on a "
       "Zen 4 EPYC in bf16 routers by language gave -0.14 (dev suite +0.41), -0.41 over four times the steps (dev "
       "suite -0.26), and, with the load balanced over the last 16 steps (train.balance_window), -0.26 (dev suite "
       "+0.60) and -0.27 over four times the steps (dev suite +0.06), 3 seeds each; groups with the four times "
       "larger pool over six times the steps gave -0.47 (dev suite -0.26), routers by language -0.43 (dev suite "
       "-0.44) and with the window -0.28 (dev suite -0.22), 3 seeds each; fitted against the pairs seen, no "
       "option's gap closes beyond its noise; but all these bf16 runs trained the experts on a cast of their first "
       "weights (fixed since), and run again with the fix routers by language with the window gave -0.10 (dev "
       "suite +0.46), and -0.07 (dev suite +0.18) with the four times larger pool over six times the steps, 3 seeds "
       "each, and -0.04 (dev suite +0.30, 2 seeds) with that pool seen whole; with the batches doubled groups gave "
       "-0.38 (dev suite +0.11) and routers by language with the window -0.24 (dev suite +0.55) and "
       "copies +0.00 (dev suite +0.06), 3 seeds each, and at the default scale copies gave +0.08 (dev suite +0.16, "
       "ahead on every seed by 0.01 to 0.19), groups -0.06 (dev suite +0.36), groups whose routers start by language "
       "+0.11 (dev suite +0.27) and copies with such routers -0.09 (dev suite -0.59), eight groups -0.58 (dev suite "
       "+0.19), eight groups whose routers start by language -0.52 (dev suite -0.72), noisy copies -0.05 (dev suite "
       "+0.03) and raw gates -1.56 (dev suite -0.10), 3 seeds each: the copies lead their control there, by less "
       "than a fifth of a point (groups with routers by language by as much, within the seeds' spread), and over "
       "four times the steps tie it, +0.05 (dev suite +0.12, 3 seeds), where groups fall behind, -0.39 (dev suite "
       "-0.09, 3 seeds), and routers by language too, -0.24 (dev suite -0.01, 3 seeds)"),
}


def measured_gap(preset: str) -> str:
    """The measured MoE − dense gaps of `preset`'s recipe in words, for the report's verdict and warning."""
    at, gaps, beyond = MEASURED_GAP[preset]
    parts = [f"{name}: {m:+.2f} [{lo:+.2f}, {hi:+.2f}] over {n} seed{'s' * (n > 1)}"
             for name, (m, lo, hi, n) in gaps.items()]
    return (f"At this recipe's default scale ({at}) benchmarks/moe_vs_dense.py measured MoE − dense nDCG@10 ×100 "
            f"of {'; '.join(parts)}; {beyond} (docs/moe.md, \"MoE vs dense\").")


def base_label(ctx: RecipeContext) -> str:
    return f"{'all-MiniLM-L6-v2' if not ctx.cfg.base else ctx.base.name} (base)"


def decisions(ctx: RecipeContext, stages: dict) -> dict:
    c, t = ctx.cfg, ctx.cfg.train
    data, curate = stages.get("data", {}), stages.get("curate", {})
    user = data.get("user")
    sources = (curate.get("filter") or {}).get("sources", {})
    trained = sum(curate.get("train_sources", {}).values())
    seen = t.steps * t.batch_size
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
            f"({seen:,} examples seen in {t.steps} steps). {measured_gap(c.preset)} nomic-embed-v2-moe §7.2 saw an "
            "MoE model underperform its dense counterpart even with 100M contrastive pairs: MoE needs data scale. At "
            "this scale the dense model is the safer choice.")
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

