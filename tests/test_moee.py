"""MoEE: HS / RW extraction from tiny random Hugging Face MoE LMs and moembed MoE encoders, combinations, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.moee import (
    PROMPTS,
    ExtractConfig,
    MoEEModel,
    SumModel,
    load_moee,
    resolve_prompt,
)
from moembed.moee.combine import combine
from moembed.moee.hf import load_hf_moe

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "away", "in", "park", "big", "small", "red", "blue", "house", "tree", "bird", "sang", "song", "this", "sentence", "means", "one", "word", "describe", "style", "of", "following"]
TEXTS = ["the cat sat on the mat", "a dog", "the big red bird sang a small song in the park",
         "blue house", "a small tree"]

# family → (config class name, expected 0-based MoE layers, config kwargs)
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=128)
DEEPSEEK = dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, num_key_value_heads=4)
FAMILIES = {
    "olmoe": ("OlmoeConfig", [0, 1], 4, dict(num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", [1], 8, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                  shared_expert_intermediate_size=32, decoder_sparse_step=1,
                                                  mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", [0, 1], 4, dict(num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", [1], 6, DEEPSEEK),
    "deepseek_v3": ("DeepseekV3Config", [1], 6, DEEPSEEK),
}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS + list('":-,.()'))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    """A saved tiny random model + tokenizer per family."""
    import transformers

    tok = _tokenizer()
    dirs = {}
    for family, (cls_name, _, _, kw) in FAMILIES.items():
        torch.manual_seed(0)
        cfg = getattr(transformers, cls_name)(**{**COMMON, **kw}, pad_token_id=0, bos_token_id=2, eos_token_id=3)
        lm = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # larger router weights than the default init: routing then differs between tokens
            for name, p in lm.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
        path = tmp_path_factory.mktemp(family)
        lm.save_pretrained(path)
        tok.save_pretrained(path)
        dirs[family] = path
    return dirs


@pytest.fixture(scope="module")
def sources(lm_dirs):
    return {f: load_hf_moe(p, dtype="float32") for f, p in lm_dirs.items()}


# ---- Hugging Face MoE language models ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_and_rw_blocks_are_distributions(sources, family):
    src = sources[family]
    _, layers, experts, _ = FAMILIES[family]
    assert src.moe_layers == layers
    for pooling in ("last", "mean"):
        src.extract = ExtractConfig(rw_pooling=pooling, hs_pooling=pooling)
        f = src.features(TEXTS, batch_size=2)
        assert f.hs.shape == (len(TEXTS), 32) and f.rw.shape == (len(TEXTS), len(layers) * experts)
        blocks = f.rw.reshape(len(TEXTS), len(layers), experts)  # (n, L_moe, E)
        torch.testing.assert_close(blocks.sum(-1), torch.ones(len(TEXTS), len(layers)))
        assert (blocks >= 0).all() and torch.isfinite(f.hs).all()
    src.extract = ExtractConfig()


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_unpadded_reference(sources, family):
    """Last-token RW and HS equal those read off a plain single-text forward of the causal LM."""
    src = sources[family]
    text = TEXTS[2]
    ids = torch.tensor([src.token_ids([text])[0]])
    with torch.no_grad():
        out = src.lm(input_ids=ids, output_router_logits=True, output_hidden_states=True)
    ref_rw = torch.cat([torch.softmax(z.float(), -1)[-1] for z in out.router_logits])  # last token of each layer
    ref_hs = out.hidden_states[-1][0, -1]
    f = src.features(TEXTS, batch_size=8)  # the text sits in a padded batch
    torch.testing.assert_close(f.rw[2], ref_rw, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(f.hs[2], ref_hs, atol=1e-5, rtol=1e-4)


def test_table5_variants_match_reference(sources):
    """Mean-over-tokens RW, and HS averaged over all layers and tokens, against a plain unpadded forward."""
    src = sources["olmoe"]
    src.extract = ExtractConfig(rw_pooling="mean", hs_pooling="mean", hs_layers="all")
    try:
        f = src.features(TEXTS, batch_size=8)
    finally:
        src.extract = ExtractConfig()
    ids = torch.tensor([src.token_ids([TEXTS[0]])[0]])
    with torch.no_grad():
        out = src.lm(input_ids=ids, output_router_logits=True, output_hidden_states=True)
    ref_rw = torch.cat([torch.softmax(z.float(), -1).mean(0) for z in out.router_logits])
    ref_hs = torch.stack(out.hidden_states[1:]).mean(0)[0].mean(0)  # (L, 1, T, d) → (d,)
    torch.testing.assert_close(f.rw[0], ref_rw, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(f.hs[0], ref_hs, atol=1e-5, rtol=1e-4)


MEAN_ALL = dict(rw_pooling="mean", hs_pooling="mean", hs_layers="all")


@pytest.mark.parametrize("family,variant", [(f, {}) for f in FAMILIES] + [("qwen2_moe", MEAN_ALL), ("deepseek_v3", MEAN_ALL)])
def test_batch_independence(sources, family, variant):
    """A text's features are the same alone and in a batch of texts of other lengths."""
    src = sources[family]
    src.extract = ExtractConfig(**variant)
    together = src.features(TEXTS, batch_size=len(TEXTS))
    for i, t in enumerate(TEXTS):
        alone = src.features([t])
        torch.testing.assert_close(together.rw[i], alone.rw[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(together.hs[i], alone.hs[0], atol=1e-5, rtol=1e-4)
    src.extract = ExtractConfig()


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_left_padding_invariance(sources, family):
    src = sources[family]
    ids = src.token_ids([TEXTS[0]])
    plain = src.forward(*src.left_pad(ids))
    input_ids, mask = src.left_pad(ids)
    pad = torch.full((1, 5), src.pad_id)
    padded = src.forward(torch.cat([pad, input_ids], 1), torch.cat([torch.zeros(1, 5, dtype=torch.bool), mask], 1))
    torch.testing.assert_close(padded.rw, plain.rw, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(padded.hs, plain.hs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_hooks_capture_equals_model_outputs(sources, family):
    src = sources[family]
    own = src.features(TEXTS, batch_size=3)
    src.capture = "hooks"
    try:
        hooked = src.features(TEXTS, batch_size=3)
    finally:
        src.capture = "outputs"
    torch.testing.assert_close(hooked.rw, own.rw)


def test_rw_differs_between_texts(sources):
    """Routing carries information: different texts get different RW (guards against a constant extraction)."""
    f = sources["olmoe"].features(TEXTS)
    assert torch.cdist(f.rw, f.rw)[~torch.eye(len(TEXTS), dtype=torch.bool)].min() > 1e-4


def test_bf16_default_load(lm_dirs):
    src = load_hf_moe(lm_dirs["olmoe"], prompt="prompteol")
    assert next(src.lm.parameters()).dtype == torch.bfloat16
    f = src.features(TEXTS[:2])
    assert f.rw.dtype == torch.float32 and torch.isfinite(f.hs).all()
    torch.testing.assert_close(f.rw.reshape(2, 2, 4).sum(-1), torch.ones(2, 2), atol=1e-3, rtol=0)


def test_empty_text_is_an_error(lm_dirs, tmp_path):
    src = load_hf_moe(lm_dirs["olmoe"], dtype="float32")
    src.tokenizer._tokenizer.post_processor = None  # no BOS: an empty text has no tokens at all
    with pytest.raises(MoembedError, match=r"texts\[1\]"):
        src.features(["a cat", ""])


def test_unsupported_family_names_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(MoembedError, match="llama"):
        load_hf_moe(tmp_path)


# ---- combinations -----------------------------------------------------------------------------------------------


def test_concat_and_sum_follow_their_definitions(sources):
    src = sources["olmoe"]
    f = src.features(TEXTS)
    hs, rw = f.hs.numpy(), f.rw.numpy()
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    concat = MoEEModel(src, "concat").encode(TEXTS)
    np.testing.assert_allclose(concat, np.concatenate([unit(hs), unit(rw)], 1), atol=1e-6)
    np.testing.assert_allclose(MoEEModel(src, "rw").encode(TEXTS), unit(rw), atol=1e-6)
    model = SumModel(src, alpha=0.7)
    e = model.encode(TEXTS, batch_size=2)
    assert model.dim == e.shape[1] == 32 + 8 and model.split == 32
    sim = model.similarity(e[:2], e)
    expected = unit(hs[:2]) @ unit(hs).T + 0.7 * unit(rw[:2]) @ unit(rw).T
    assert sim.shape == (2, len(TEXTS))
    np.testing.assert_allclose(sim, expected, atol=1e-5)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v2"])
def test_raw_concat_is_the_papers_concatenation(sources, family):
    """MoEE §3.3: e_final = [e_HS ; e_RW] with e_HS the last layer's hidden state at the last token (eq. 1) and e_RW
    the per-layer softmax of the router logits there, concatenated (eq. 2-3): read off one plain forward per text,
    nothing rescaled (unlike "concat", whose blocks are unit length)."""
    src = sources[family]
    model = MoEEModel(src, "concat_raw")
    got = model.encode(TEXTS, batch_size=2)
    assert got.shape == (len(TEXTS), model.dim) and model.dim == src.hs_dim + src.rw_dim
    for i, text in enumerate(TEXTS):
        ids = torch.tensor([src.token_ids([text])[0]])
        with torch.no_grad():
            out = src.lm(input_ids=ids, output_router_logits=True, output_hidden_states=True)
        e_hs = out.hidden_states[-1][0, -1]  # (d_HS,)
        e_rw = torch.cat([torch.softmax(z.float(), -1)[-1] for z in out.router_logits])  # (L_moe · E,)
        np.testing.assert_allclose(got[i], torch.cat([e_hs, e_rw]).numpy(), atol=1e-5, rtol=1e-4)
    norms = np.linalg.norm(got[:, : src.hs_dim], axis=1)
    assert not np.allclose(norms, 1.0)  # the HS block keeps its own scale
    normalised = MoEEModel(src, "concat").encode(TEXTS)
    assert not np.allclose(got, normalised, atol=1e-3)


def test_sum_model_is_batch_independent_and_rejects_dim_precision(sources):
    model = SumModel(sources["mixtral"], alpha=1.0)
    batched = model.encode(TEXTS, batch_size=len(TEXTS))
    np.testing.assert_allclose(model.encode(TEXTS[3]), batched[3], atol=1e-5)
    with pytest.raises(MoembedError, match="^truncate_dim"):
        model.encode(TEXTS, truncate_dim=8)
    with pytest.raises(MoembedError, match="^precision"):
        model.encode(TEXTS, precision="int8")
    assert model.prompts == {} and isinstance(model.name, str)


def test_cache_hash_follows_mode_and_settings(sources):
    src = sources["olmoe"]
    hs, rw = MoEEModel(src, "hs").settings_key(), MoEEModel(src, "rw").settings_key()
    assert hs != rw and hs == MoEEModel(src, "hs").settings_key()
    src.extract = ExtractConfig(rw_pooling="mean")
    try:
        assert MoEEModel(src, "hs").settings_key() != hs
    finally:
        src.extract = ExtractConfig()


def test_load_moee_modes(lm_dirs):
    m = load_moee(lm_dirs["qwen2_moe"], mode="sum", alpha=2.0, bf16=False)
    assert isinstance(m, SumModel) and m.alpha == 2.0 and m.dim == 32 + 8
    assert load_moee(lm_dirs["qwen2_moe"], mode="rw", bf16=False).encode(TEXTS[:2]).shape == (2, 8)
    with pytest.raises(MoembedError, match="mode"):
        load_moee(lm_dirs["qwen2_moe"], mode="max")


# ---- prompts ----------------------------------------------------------------------------------------------------


def test_prompts():
    assert len(PROMPTS) == 10 and PROMPTS["none"] == "*sent*"
    assert resolve_prompt("prompteol").replace("*sent*", "hi") == 'This sentence: "hi" means in one word: "'
    assert resolve_prompt("Summarise *sent* now") == "Summarise *sent* now"
    assert resolve_prompt(None) == "*sent*"
    with pytest.raises(MoembedError, match="prompt"):
        resolve_prompt("no placeholder here")


def test_prompt_changes_embedding(sources):
    src = sources["olmoe"]
    bare = src.features(TEXTS[:1], prompt="none")
    eol = src.features(TEXTS[:1], prompt="prompteol")
    assert not torch.allclose(bare.hs, eol.hs)


# ---- CLI --------------------------------------------------------------------------------------------------------


def test_cli_writes_npy(lm_dirs, tmp_path):
    from typer.testing import CliRunner

    from moembed.cli.main import app

    inp = tmp_path / "texts.jsonl"
    inp.write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    out = tmp_path / "out.npy"
    args = ["moee", str(lm_dirs["olmoe"]), str(inp), "--out", str(out), "--mode", "concat",
            "--prompt", "prompteol", "--no-bf16", "--batch-size", "2"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    x = np.load(out)
    assert x.shape == (len(TEXTS), 32 + 8) and x.dtype == np.float32
    ref = load_moee(lm_dirs["olmoe"], mode="concat", prompt="prompteol", bf16=False).encode(TEXTS)
    np.testing.assert_allclose(x, ref, atol=1e-5)
    bad = CliRunner().invoke(app, [a if a != "concat" else "sum" for a in args])
    assert bad.exit_code == 2 and "'--mode'" in bad.output and "concat_raw" in bad.output  # the choices, named


# ---- moembed's own MoE encoders ---------------------------------------------------------------------------------


@pytest.fixture
def tiny_moe(make_tiny):
    from moembed.model.config import MoEConfig

    return make_tiny("nomic", moe=MoEConfig(num_experts=4, top_k=2))


def test_encoder_rw_is_token_mean_of_routing(tiny_moe):
    from moembed.moee.encoder import EncoderMoESource

    src = EncoderMoESource(tiny_moe)
    n_layers = len(tiny_moe.config.moe_layers())
    f = src.features(TEXTS, batch_size=2)
    assert f.rw.shape == (len(TEXTS), n_layers * 4) and f.hs.shape == (len(TEXTS), tiny_moe.dim)
    torch.testing.assert_close(f.rw.reshape(len(TEXTS), n_layers, 4).sum(-1), torch.ones(len(TEXTS), n_layers))
    # reference: one text, no padding, mean of softmax over its tokens
    batch = tiny_moe.tokenizer([TEXTS[2]])
    with torch.no_grad():
        out = tiny_moe(batch.input_ids, batch.attention_mask)
    ref = torch.cat([torch.softmax(z.float(), -1).mean(0) for z in out.encoder.router_logits])
    torch.testing.assert_close(f.rw[2], ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(f.hs[2], out.embeddings[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(src.features([TEXTS[2]]).rw[0], f.rw[2], atol=1e-5, rtol=1e-4)


def test_encoder_sum_model_and_cli(tiny_moe, tmp_path):
    from typer.testing import CliRunner

    from moembed.cli.main import app
    from moembed.moee.encoder import EncoderMoESource

    model = SumModel(EncoderMoESource(tiny_moe), alpha=0.5)
    f = model.features(TEXTS)
    e = model.encode(TEXTS, prompt_name="search_query")
    np.testing.assert_allclose(e[:, : model.split], combine(model.features(TEXTS, "search_query"), "hs").numpy(), atol=1e-6)
    hs, rw = combine(f, "hs").numpy(), combine(f, "rw").numpy()
    e0 = model.encode(TEXTS)
    np.testing.assert_allclose(model.similarity(e0, e0), hs @ hs.T + 0.5 * rw @ rw.T, atol=1e-5)
    path = tmp_path / "enc"
    tiny_moe.save(path)
    inp = tmp_path / "t.txt"
    inp.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "rw.npy"
    res = CliRunner().invoke(app, ["moee", str(path), str(inp), "-o", str(out), "--plain", "--mode", "rw",
                                   "--no-bf16"])
    assert res.exit_code == 0, res.output
    np.testing.assert_allclose(np.load(out), rw, atol=1e-5)
    bad = CliRunner().invoke(app, ["moee", str(path), str(inp), "-o", str(out), "--plain", "--pooling", "last"])
    assert isinstance(bad.exception, MoembedError) and "--pooling" in str(bad.exception)


def test_dense_encoder_is_rejected(make_tiny):
    from moembed.moee.encoder import EncoderMoESource

    with pytest.raises(MoembedError, match="no MoE layers"):
        EncoderMoESource(make_tiny("bert"))
