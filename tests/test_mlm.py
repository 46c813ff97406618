"""MLM stage: 80/10/10 masking at 30%, packing, logits only at masked positions, α-sampling, absolute → rotary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import chatterbot_pairs, write_texts

from moembed.data.sources import SourceStats, TextSource
from moembed.errors import MoembedError
from moembed.data.config import SourceConfig
from moembed.model.convert.rotary import to_rotary
from moembed.train.config import load_config
from moembed.train.mlm import (
    IGNORE,
    MLMModel,
    PackedTextStream,
    Packer,
    mask_tokens,
)


def test_masking_rate_and_80_10_10():
    g = torch.Generator().manual_seed(0)
    special = [0, 101, 102]
    ids = torch.randint(1000, 30000, (64, 512), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    inputs, labels = mask_tokens(ids, 0.3, 103, 30522, special, g)
    sel = labels != IGNORE
    maskable = ids.numel() - 2 * 64
    assert abs(sel.sum().item() / maskable - 0.3) < 0.01
    assert not sel[:, 0].any() and not sel[:, -1].any()  # special tokens are never selected
    assert torch.equal(labels[sel], ids[sel])
    n = sel.sum().item()
    masked = (inputs[sel] == 103).sum().item() / n
    kept = (inputs[sel] == ids[sel]).sum().item() / n
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01  # the other ~10% are random tokens
    assert torch.equal(inputs[~sel], ids[~sel])


def _texts(tmp_path, lang="english", name="en"):
    texts = [a for _, a in chatterbot_pairs(lang)]
    return write_texts(tmp_path / f"{name}.jsonl", texts), texts


def test_packing_rows_are_the_concatenated_documents(tmp_path, minilm):
    path, texts = _texts(tmp_path)
    tok = minilm.tokenizer
    packer = Packer(TextSource(SourceConfig(path=str(path), shuffle_block=0), SourceStats()), tok, 40)
    rows = [packer.row() for _ in range(30)]
    assert all(len(r) == 40 for r in rows)
    keep = tok.max_length
    tok.set_max_length(100_000)
    stream = [i for ids in tok.encode_ids(texts[:200])[0] for i in ids]
    tok.set_max_length(keep)
    assert [i for r in rows for i in r] == stream[: 30 * 40]
    assert tok.max_length == keep


def test_language_sampling_alpha_and_stream_state(tmp_path, minilm):
    en, en_texts = _texts(tmp_path)
    de, de_texts = _texts(tmp_path, "german", "de")

    def make(seed=0):
        stats = SourceStats()
        srcs = [TextSource(SourceConfig(path=str(p), name=n), stats) for p, n in ((en, "en"), (de, "de"))]
        return PackedTextStream(srcs, minilm.tokenizer, 4, 32, 0.3, seed, stats)

    s = make()
    ratio = (len(en_texts) / len(de_texts)) ** 0.3
    assert s.sampler.probs[0] / s.sampler.probs[1] == pytest.approx(ratio)
    for _ in range(3):
        _, ids = s.next()
        assert ids.shape == (4, 32)
    state = s.state()
    want = [s.next() for _ in range(4)]
    s2 = make(seed=99)
    s2.load_state(state)
    got = [s2.next() for _ in range(4)]
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))


def test_logits_only_at_masked_positions_and_tied_decoder(make_tiny):
    emb = make_tiny("bert", moe={"num_experts": 2, "top_k": 1, "layers": [1]})
    model = MLMModel(emb, aux_loss_coef=0.01)
    seen = []
    model.head.dense.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    ids = torch.randint(1000, 2000, (3, 16))
    labels = torch.full_like(ids, IGNORE)
    labels[0, 2], labels[1, 5], labels[2, 7], labels[2, 8] = 11, 12, 13, 14
    out = model.loss(model(ids, labels))
    assert seen == [4] and out.num_masked == 4 and out.aux > 0
    out.loss.backward()
    word = emb.encoder.embeddings.word.weight
    assert word.grad is not None and word.grad[[11, 12, 13, 14]].abs().sum() > 0  # decoder = word embeddings
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_to_rotary_keeps_every_weight_but_positions(make_tiny):
    emb = make_tiny("bert")
    rot = to_rotary(emb)
    assert rot.config.position == "rotary" and rot.encoder.embeddings.position is None
    old, new = emb.encoder.state_dict(), rot.encoder.state_dict()
    assert set(old) - set(new) == {"embeddings.position.weight"} and set(new) <= set(old)
    assert all(torch.equal(old[k], new[k]) for k in new)
    rot.encode(["still embeds text"])
    with pytest.raises(MoembedError, match="already uses rotary"):
        to_rotary(rot)


def test_mlm_run_then_continue_as_rotary(tmp_path, minilm_path):
    from safetensors.torch import load_file

    from moembed.model.embedder import Embedder
    from moembed.train.loop import Trainer, train
    from moembed.train.plots import read_metrics

    en, _ = _texts(tmp_path)
    de, _ = _texts(tmp_path, "german", "de")
    base = [f"tokenizer={minilm_path}", f"data.0.path={en}", f"data.1.path={de}", "steps=2"]
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "mlm.yaml"
    first = train(load_config(tiny, base + [f"output_dir={tmp_path / 'a'}"]), progress=False)
    assert (first / "mlm_head.safetensors").exists()
    recs = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert len(recs) == 2 and all(0.2 < r["masked"] / (4 * 32) < 0.4 for r in recs)
    cont = [f"model={first}", "mlm.to_rotary=true", f"output_dir={tmp_path / 'b'}", "steps=1"]
    cfg = load_config(tiny, base + cont)
    head = load_file(str(first / "mlm_head.safetensors"))
    t = Trainer(cfg, progress=False)  # continues with the saved head, on a rotary copy of the encoder
    assert all(torch.equal(v, t.module.head.state_dict()[k]) for k, v in head.items())
    second = train(cfg, progress=False)
    a, b = Embedder.load(first), Embedder.load(second)
    assert a.config.position == "absolute" and b.config.position == "rotary"
