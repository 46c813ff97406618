"""The trainer: config validation, schedules, end-to-end tiny runs, exact resume after SIGKILL, NaN stop, plots."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import chatterbot_pairs, write_pairs

from moembed.errors import MoembedError
from moembed.train.config import OptimConfig, load_config
from moembed.train.optim import lr_multiplier

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny"


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    p = chatterbot_pairs()
    return write_pairs(d / "a.jsonl", p[:400], negatives=3), write_pairs(d / "b.jsonl", p[400:700], negatives=3, seed=1)


def _overrides(minilm_path, out, a, b=None):
    o = [f"tokenizer={minilm_path}", f"data.0.path={a}", f"output_dir={out}"]
    return o + ([f"data.1.path={b}"] if b else [])


# ---- config -------------------------------------------------------------------------------------------------


RECIPES = ["nomic-v1-contrastive", "nomic-v1-finetune", "nomic-v2-moe-pretrain", "nomic-v2-moe-finetune",
           "arctic-matryoshka", "mlm-nomic", "tiny/contrastive", "tiny/finetune", "tiny/mlm"]


def test_all_shipped_configs_validate():
    for name in RECIPES:
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.steps >= 1, name


def test_config_errors_name_the_key(tmp_path):
    base = TINY / "contrastive.yaml"
    with pytest.raises(MoembedError, match=r"optim\.lr: .*number"):
        load_config(base, ["optim.lr=fast"])
    with pytest.raises(MoembedError, match=r"loss\.tempertaure: unknown key"):
        load_config(base, ["loss.tempertaure=0.1"])
    with pytest.raises(MoembedError, match=r"data\.0\.formt: unknown key"):
        load_config(base, ["data.0.formt=jsonl"])
    with pytest.raises(MoembedError, match=r"data\.5: no such list item"):
        load_config(base, ["data.5.path=x"])
    with pytest.raises(MoembedError, match="expected key=value"):
        load_config(base, ["steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(base.read_text() + "learning_rate: 0.1\n")
    with pytest.raises(MoembedError, match=rf"{bad}: learning_rate: unknown key"):
        load_config(bad)
    bad.write_text(base.read_text().replace("steps: 6", "steps: six"))
    with pytest.raises(MoembedError, match=r"steps: .*integer"):
        load_config(bad)
    bad.write_text(base.read_text().replace("stage: contrastive", "stage: distill"))
    with pytest.raises(MoembedError, match=r"stage: "):
        load_config(bad)


def test_overrides_parse_yaml_values():
    cfg = load_config(TINY / "contrastive.yaml", ["optim.lr=3e-4", "bf16=true", "loss.matryoshka_dims=[32,16]",
                                                  "data.0.weight=2", "chunk_size=4"])
    assert cfg.optim.lr == 3e-4 and cfg.bf16 is True and cfg.loss.matryoshka_dims == [32, 16]
    assert cfg.data[0].weight == 2.0 and cfg.chunk_size == 4


def test_bad_config_refused_before_any_work(tmp_path, minilm_path, cli):
    out = tmp_path / "run"
    r = cli("train", str(TINY / "contrastive.yaml"), f"output_dir={out}", "optim.betas=[0.9]")
    assert r.returncode == 1 and "optim.betas" in r.stderr
    r = cli("validate", str(TINY / "contrastive.yaml"), f"tokenizer={minilm_path}", "data.0.path=nope.jsonl")
    assert r.returncode == 1 and "data.0.path" in r.stderr
    assert not out.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mimalloc is preloaded on Linux only")
@pytest.mark.parametrize("setting, expected", [(None, "mimalloc"), ("system", "system")])
def test_the_train_command_runs_on_mimalloc(tmp_path, minilm_path, pairs_file, setting, expected):
    # The installed command's entry point (`run`): the training process starts itself again with mimalloc
    # preloaded, and the run says which allocator it got (the library its `malloc` resolves to);
    # MOEMBED_ALLOCATOR=system keeps the C library's.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MOEMBED_ALLOCATOR")}
    if setting:
        env["MOEMBED_ALLOCATOR"] = setting
    cmd = [sys.executable, "-c", "from moembed.cli.main import run; run()", "train", str(TINY / "contrastive.yaml"),
           *_overrides(minilm_path, tmp_path / "run", pairs_file[0]), "steps=1", "--quiet"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"memory allocator: {expected}" in proc.stderr
    assert (tmp_path / "run" / "model").is_dir()


# ---- schedules ------------------------------------------------------------------------------------------------


def test_schedules():
    S = 100
    lin = OptimConfig(schedule="linear", warmup_steps=10)
    assert lr_multiplier(0, S, lin) == pytest.approx(0.1) and lr_multiplier(9, S, lin) == 1.0
    assert lr_multiplier(10, S, lin) == 1.0 and lr_multiplier(55, S, lin) == pytest.approx(0.5)
    cos = OptimConfig(schedule="cosine", warmup_steps=0, min_lr_ratio=0.1)
    assert lr_multiplier(50, S, cos) == pytest.approx(0.55) and lr_multiplier(99, S, cos) > 0.1
    inv = OptimConfig(schedule="inverse_sqrt", warmup_steps=4)
    assert lr_multiplier(15, S, inv) == pytest.approx(0.5)
    wsd = OptimConfig(schedule="wsd", warmup_steps=0, decay_fraction=0.2)
    assert [lr_multiplier(s, S, wsd) for s in (0, 79)] == [1.0, 1.0]
    assert lr_multiplier(90, S, wsd) == pytest.approx(0.5)


# ---- runs -----------------------------------------------------------------------------------------------------


def test_finetune_run_with_moe_gradcache_matryoshka_and_plots(tmp_path, minilm_path, pairs_file):
    from moembed.model.embedder import Embedder
    from moembed.train.loop import train
    from moembed.train.plots import read_metrics

    task = tmp_path / "task"  # a small BEIR-style retrieval task for the evaluation every 2 steps
    (task / "qrels").mkdir(parents=True)
    held_out = chatterbot_pairs()[1500:1540]
    (task / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "title": "", "text": a}) + "\n"
                                               for i, (_, a) in enumerate(held_out)))
    (task / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": q}) + "\n"
                                                for i, (q, _) in enumerate(held_out)))
    (task / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                             "".join(f"q{i}\td{i}\t1\n" for i in range(len(held_out))))
    out = tmp_path / "ft"
    cfg = load_config(TINY / "finetune.yaml", _overrides(minilm_path, out, *pairs_file) +
                      ["steps=4", "eval.every=2", f"eval.tasks=[{task}]"])
    final = train(cfg, progress=False)
    emb = Embedder.load(final)
    assert emb.config.moe is not None and emb.encode(["what is a wavelength"]).shape == (1, 32)
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(set(r["per_dim"]) == {"32", "16"} and len(r["expert_load"]) == 1 for r in recs)
    assert {r["source"] for r in recs} <= {"a", "b"}
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [2, 4] and all(0 < e["eval"]["task"] <= 1 for e in evals)
    for name in ("loss.png", "lr.png", "expert_load.png"):
        assert (out / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000004"]  # keep_last: 1


def test_nan_loss_stops_with_message_and_keeps_last_checkpoint(tmp_path, minilm_path, pairs_file, monkeypatch):
    import moembed.train.step as step_mod
    from moembed.train.checkpoint import CheckpointManager
    from moembed.train.loop import Trainer, train

    real, calls = step_mod.contrastive_step, []

    def poisoned(*a, **k):
        res = real(*a, **k)
        calls.append(1)
        if len(calls) == 3:
            res.loss = res.rank_loss = float("nan")
        return res

    monkeypatch.setattr(step_mod, "contrastive_step", poisoned)
    out = tmp_path / "nan"
    cfg = load_config(TINY / "contrastive.yaml", _overrides(minilm_path, out, pairs_file[0]))
    with pytest.raises(MoembedError, match=r"step 3: loss is nan on rank 0 .*Last good checkpoint: .*step-00000002"):
        train(cfg, progress=False)
    mgr = CheckpointManager(out / "checkpoints")
    assert mgr.latest().name == "step-00000002" and not (out / "model").exists()
    t = Trainer(cfg, progress=False)  # the checkpoint restores cleanly
    assert t.resume() == 2


def test_nonfinite_step_is_skipped_within_budget_and_the_count_survives_resume(tmp_path, minilm_path, pairs_file,
                                                                              monkeypatch):
    import moembed.train.step as step_mod
    from moembed.train.loop import Trainer, train

    real, calls = step_mod.contrastive_step, []

    def poisoned(*a, **k):
        res = real(*a, **k)
        calls.append(1)
        if len(calls) in (2, 4):  # step 2 is skipped (budget 1); step 4 exceeds the budget
            res.loss = res.rank_loss = float("inf")
        return res

    monkeypatch.setattr(step_mod, "contrastive_step", poisoned)
    out = tmp_path / "skip"
    cfg = load_config(TINY / "contrastive.yaml", _overrides(minilm_path, out, pairs_file[0]) + ["skip_nonfinite=1",
                                                                                                  "steps=3"])
    train(cfg, progress=False)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in recs if r.get("event") == "skipped"]
    assert [(r["step"], r["reason"], r["ranks"]) for r in skipped] == [(2, "loss is inf on rank 0", [0])]
    assert all("grad_norm" in r for r in recs if "loss" in r)
    t = Trainer(cfg.model_copy(update={"steps": 5}), progress=False)
    assert t.resume() == 3 and t.skipped == 1  # the budget is spent, also after a resume
    with pytest.raises(MoembedError, match=r"step 4: loss is inf on rank 0 .*1 earlier step\(s\) skipped"):
        train(cfg.model_copy(update={"steps": 5}), progress=False)


KILL_SEED = 18


def test_sigkill_and_resume_is_bit_identical(tmp_path, minilm_path, pairs_file, monkeypatch):
    """Dropout on, hard negatives drawn at random: model, optimizer, RNG and data position must all be restored.

    The run kills itself (SIGKILL) inside the checkpoint save of a seeded step, at a seeded interpreter event of that
    save (tests/kill_helpers.py), anywhere in it or within its final swap: the same seed always kills at the same
    instant, whatever the machine's load."""
    from moembed.train.loop import train

    steps = 14
    opts = [f"steps={steps}", "batch_size=12", "loss.num_hard_negatives=1"]
    rng = random.Random(KILL_SEED)
    kill_step = rng.randint(3, 9)
    # a save of this run is ~31,000 interpreter events, ~650 of them from the swap on (measured): stay inside
    anchor, k = rng.choice([("-", rng.randint(1, 25_000)), ("_replace_dir", rng.randint(1, 500))])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the killed subprocess runs with one thread; same kernels, same bits
    try:
        train(load_config(TINY / "contrastive.yaml", opts + _overrides(minilm_path, tmp_path / "ref", pairs_file[0])),
              progress=False)

        out = tmp_path / "killed"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(ROOT / "tests" / "kill_helpers.py"), "train", str(kill_step), anchor, str(k),
               "train", str(TINY / "contrastive.yaml"), "--quiet", *opts, *_overrides(minilm_path, out, pairs_file[0])]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"not killed (seed {KILL_SEED}): {proc.stderr[-2000:]}"
        assert not (out / "model").exists()
        done = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*"))
        assert done and done[-1] in (kill_step - 1, kill_step)  # the save struck: complete or absent, never half

        cfg = load_config(TINY / "contrastive.yaml", opts + _overrides(minilm_path, out, pairs_file[0]))
        train(cfg, progress=False)  # resumes from the latest checkpoint
    finally:
        torch.set_num_threads(threads)
    a = load_file(str(tmp_path / "ref" / "model" / "model.safetensors"))
    b = load_file(str(out / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in ("time", "pairs_per_s")} for x in lines]

    assert records("ref") == records("killed")  # same losses, sources and learning rates at every step


def test_a_bf16_moe_run_on_grouped_experts_resumes_bit_identical(tmp_path, minilm_path, pairs_file, monkeypatch):
    """Under bf16 autocast the grouped experts run on bf16 casts of their weights, kept between the passes of a step;
    the trainer's fused AdamW updates the weights without bumping their versions. Every step must still see the
    weights of the step before: a run stopped after step 3 and resumed (casts made afresh from the checkpoint) equals
    a straight run only if the straight run renewed its casts after every step."""
    from spy import calls_of

    from moembed.model.fast.experts import GroupedExperts
    from moembed.train.loop import Trainer, train

    opts = ["steps=6", "bf16=true", "checkpoint.every=3",
            "model_config_overrides={hidden_dropout: 0.1, attention_dropout: 0.1, moe: {num_experts: 4, top_k: 2}}"]
    grouped = calls_of(monkeypatch, torch, "_grouped_mm")
    train(load_config(TINY / "contrastive.yaml", opts + _overrides(minilm_path, tmp_path / "ref", pairs_file[0])),
          progress=False)
    assert grouped  # the experts ran as grouped matmuls (bf16 casts), not as the loop

    real = Trainer.train_step

    def interrupted(self):
        if self.step == 4:
            raise KeyboardInterrupt  # step 5 never starts: the checkpoint of step 3 is the latest
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    cfg = load_config(TINY / "contrastive.yaml", opts + _overrides(minilm_path, tmp_path / "cut", pairs_file[0]))
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    monkeypatch.setattr(Trainer, "train_step", real)
    built = calls_of(monkeypatch, GroupedExperts, "from_plain")
    train(cfg, progress=False)  # resumes from step 3
    assert built  # a new trainer, new experts, no cast kept from the interrupted run

    a = load_file(str(tmp_path / "ref" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# ---- data checked before step 1 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def late_break(tmp_path_factory):
    """5,000 pairs whose line 4,000 is broken JSON, 4,500 holds a lone surrogate and 4,700 lacks its document."""
    base = chatterbot_pairs()
    lines = [json.dumps({"query": f"{q} ({i})", "document": a}) for i, (q, a) in
             ((i, base[i % len(base)]) for i in range(5000))]
    lines[3999] = lines[3999][:-7]
    lines[4499] = '{"query": "q \\ud800", "document": "d"}'
    lines[4699] = '{"query": "q"}'
    path = tmp_path_factory.mktemp("late") / "pairs.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_line_broken_late_in_the_data_stops_validate_and_train_before_step_1(tmp_path, minilm_path, late_break,
                                                                               monkeypatch, cli):
    from moembed.train.loop import train

    args = [str(TINY / "contrastive.yaml"), *_overrides(minilm_path, tmp_path / "run", late_break)]
    r = cli("validate", *args)
    err = r.stderr
    assert r.returncode == 1 and "training data: 3 malformed record(s) of 5000" in err
    assert f"{late_break}:4000: invalid JSON" in err and f"{late_break}:4700: missing field 'document'" in err
    assert f"{late_break}:4500: not valid Unicode (lone surrogate U+D800 at character 2)" in err
    steps = []
    monkeypatch.setattr("moembed.train.loop.Trainer.train_step", lambda self: steps.append(1))
    with pytest.raises(MoembedError, match=rf"{late_break}:4000: invalid JSON"):
        train(load_config(args[0], args[1:] + ["steps=600", "checkpoint.every=100"]), progress=False)
    assert not steps and not (tmp_path / "run").exists()  # no step, no checkpoint, no output directory


def test_skip_bad_counts_them_up_front_and_trains_on_the_rest(tmp_path, minilm_path, late_break, cli, caplog):
    args = [str(TINY / "contrastive.yaml"), *_overrides(minilm_path, tmp_path / "run", late_break), "skip_bad=true"]
    r = cli("validate", *args)
    assert r.returncode == 0, r.stderr
    assert "data: 5000 records in 1 source(s) checked in" in r.stdout
    caplog.clear()
    r = cli("train", *args, "steps=2", "--quiet")
    assert r.returncode == 0, r.stderr
    skipped = [m for m in caplog.messages if m.startswith("skip_bad: 3 malformed record(s) will be skipped:")]
    assert len(skipped) == 1 and f"{late_break}:4500: not valid Unicode" in skipped[0]
    assert (tmp_path / "run" / "model").is_dir()
