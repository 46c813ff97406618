"""NomicBERT checkpoints: transformers' NomicBertModel (parity, export, upcycling) and the published layout of
nomic-embed-text-v2-moe (packed w1/w2 experts, one shared bias after the weighted sum, fp32 router softmax, top-2
without renormalisation, MoE on every second layer), checked against an independent implementation of the
published equations, forward and backward; read → finetune → write back → read; bad checkpoints."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moembed.errors import MoembedError
from nomic_helpers import save_tiny_nomic
from moembed.model.embedder import Embedder
from moembed.model.families import converter_for, exporter_for
from moembed.model.families.nomic_bert import CONVERTER
from moembed.model.io import export_sentence_transformers

TEXTS = ["a first sentence", "another, somewhat longer, sentence about routing tokens to experts", "short", ""]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, dst / f)


def _batch(emb: Embedder, texts=TEXTS):
    b = emb.tokenizer(texts)
    return b.input_ids, b.attention_mask


def _mean_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(h.dtype).unsqueeze(-1)  # (B, T, 1)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


# ---- transformers' NomicBertModel -----------------------------------------------------------------------------


@pytest.fixture
def hf_nomic(tmp_path, minilm_path):
    """A tiny random transformers NomicBertModel saved with save_pretrained (LayerNorms perturbed too)."""
    path = tmp_path / "hf"
    return save_tiny_nomic(path, minilm_path), path


def test_transformers_nomic_bert_parity_forward_and_backward(hf_nomic):
    model, path = hf_nomic
    emb = Embedder.load(path)
    c = emb.config
    assert (c.position, c.mlp, c.bias, c.rope_base, c.layer_norm_eps) == ("rotary", "swiglu", False, 500.0, 1e-5)
    assert not c.dynamic_ntk and c.type_vocab_size == 2
    ids, mask = _batch(emb)
    assert not mask.all()  # padding in the batch
    ref = model(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # (B, T, d)
    out = emb.encoder(ids, mask).last_hidden_state
    torch.testing.assert_close(out[mask], ref[mask], atol=1e-5, rtol=1e-4)  # float32 rounding of other kernels
    cos = F.cosine_similarity(_mean_pool(out, mask), _mean_pool(ref, mask))
    assert cos.min().item() >= 0.99999
    assert emb.pooling == "mean"  # a bare checkpoint pools by mean, as sentence-transformers pools it
    ours = emb.encode(TEXTS, normalize=True)
    assert (ours * F.normalize(_mean_pool(ref, mask), dim=-1).detach().numpy()).sum(1).min() >= 0.99999

    # Backward: the same loss on both; transformers' gradients, renamed by the converter, equal moembed's.
    r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref[mask] * r[mask]).sum().backward()
    (out[mask] * r[mask]).sum().backward()
    theirs = CONVERTER.weights_from_hf({n: p.grad for n, p in model.named_parameters()}, c)
    mine = {n: p.grad for n, p in emb.encoder.named_parameters()}
    assert set(theirs) == set(mine)
    for n in mine:
        torch.testing.assert_close(mine[n], theirs[n], atol=1e-5, rtol=1e-4, msg=n)


def test_transformers_module_names_are_read_too(hf_nomic):
    """Checkpoints named after transformers' modules (layers.{i}.self_attn.q_proj, ...) give the same weights."""
    model, path = hf_nomic
    cfg = json.loads((path / "config.json").read_text())
    conv = converter_for(cfg, path)
    config = conv.config_from_hf(cfg, path)
    native = conv.weights_from_hf({n: p.detach() for n, p in model.state_dict().items()}, config)
    published = conv.weights_from_hf(load_file(str(path / "model.safetensors")), config)
    assert set(native) == set(published) and all(torch.equal(native[k], published[k]) for k in native)


def test_transformers_nomic_bert_exports_back_and_loads_without_moembed(hf_nomic, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    model, path = hf_nomic
    emb = Embedder.load(path)
    assert CONVERTER.layouts(emb.config) == ["transformers", "published"]
    assert exporter_for(emb.config) is CONVERTER
    export_sentence_transformers(emb, tmp_path / "st")
    modules = json.loads((tmp_path / "st" / "modules.json").read_text())
    assert modules[0]["type"] == "sentence_transformers.models.Transformer"
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert type(st[0].auto_model).__name__ == "NomicBertModel"
    assert (st.encode(TEXTS) * emb.encode(TEXTS)).sum(1).min() >= 0.99999

    auto = AutoModel.from_pretrained(tmp_path / "st").eval()
    ids, mask = _batch(emb)
    with torch.no_grad():
        torch.testing.assert_close(auto(input_ids=ids, attention_mask=mask.long()).last_hidden_state[mask],
                                   model(input_ids=ids, attention_mask=mask.long()).last_hidden_state[mask])
    again = Embedder.load(tmp_path / "st")
    np.testing.assert_array_equal(again.encode(TEXTS), emb.encode(TEXTS))


def test_upcycling_a_transformers_nomic_bert_reproduces_its_embeddings(hf_nomic):
    from moembed.model.convert.upcycle import upcycle

    dense = Embedder.load(hf_nomic[1])
    moe = upcycle(dense, num_experts=4, top_k=2, every=2, offset=1)
    assert moe.config.moe_layers() == [1] and moe.config.mlp == "swiglu"
    np.testing.assert_allclose(moe.encode(TEXTS), dense.encode(TEXTS), atol=1e-6)


def test_exporter_for_nomic_configs(make_tiny):
    assert exporter_for(make_tiny("nomic").config) is None  # Dynamic NTK: transformers' differs past the length
    assert exporter_for(make_tiny("nomic", dynamic_ntk=False).config) is CONVERTER
    assert exporter_for(make_tiny("nomic", dynamic_ntk=False, moe={"num_experts": 2, "top_k": 1}).config) is None


# ---- the published nomic-embed-text-v2-moe layout -------------------------------------------------------------

D, HEADS, INNER, LAYERS, E, K = 32, 4, 48, 4, 4, 2


def published_config(**changes) -> dict:
    """config.json as the published nomic-embed-text-v2-moe writes it (tiny sizes)."""
    cfg = {
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
        "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                     "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
        "vocab_size": 30522, "n_embd": D, "n_head": HEADS, "n_inner": INNER, "n_layer": LAYERS,
        "n_positions": 64, "max_trained_positions": 64, "activation_function": "gelu",
        "qkv_proj_bias": True, "mlp_fc1_bias": True, "mlp_fc2_bias": True,
        "rotary_emb_fraction": 1.0, "rotary_emb_base": 10000, "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None, "rotary_scaling_factor": None, "prenorm": False, "parallel_block": False,
        "use_rms_norm": False, "causal": False, "layer_norm_epsilon": 1e-5, "type_vocab_size": 1,
        "pad_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "num_experts": E, "moe_top_k": K, "moe_every_n_layers": 2, "moe_normalize_expert_weights": False,
        "num_shared_experts": 0, "expert_choice_router": False, "ffn_div": 1, "moe_impl": "megablocks",
        "moe_resid_pdrop": 0.0,
    }
    cfg.update(changes)
    return cfg


def published_weights(seed: int = 0, vocab: int = 30522) -> dict[str, torch.Tensor]:
    """A random state dict with the published tensor names and shapes (MoE on layers 1 and 3)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.1: torch.randn(*s, generator=g) * std  # noqa: E731
    sd = {"embeddings.word_embeddings.weight": r(vocab, D, std=0.5), "embeddings.token_type_embeddings.weight": r(1, D),
          "emb_ln.weight": 1 + r(D), "emb_ln.bias": r(D)}
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        sd.update({p + "attn.Wqkv.weight": r(3 * D, D, std=0.3), p + "attn.Wqkv.bias": r(3 * D),
                   p + "attn.out_proj.weight": r(D, D, std=0.2), p + "attn.out_proj.bias": r(D),
                   p + "norm1.weight": 1 + r(D), p + "norm1.bias": r(D),
                   p + "norm2.weight": 1 + r(D), p + "norm2.bias": r(D)})
        if i % 2 == 1:
            sd.update({p + "mlp.router.layer.weight": r(E, D, std=0.5), p + "mlp.experts.bias": r(D),
                       p + "mlp.experts.mlp.w1": r(E * INNER, D, std=0.2),
                       p + "mlp.experts.mlp.w2": r(E * INNER, D, std=0.2)})
        else:
            sd.update({p + "mlp.fc1.weight": r(INNER, D, std=0.2), p + "mlp.fc1.bias": r(INNER),
                       p + "mlp.fc2.weight": r(D, INNER, std=0.2), p + "mlp.fc2.bias": r(D)})
    return sd


def write_published(path: Path, minilm_path: Path, sd=None, cfg=None) -> Path:
    """A sentence-transformers directory around a published-layout checkpoint, as the released model ships."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg or published_config(), indent=2))
    save_file(sd if sd is not None else published_weights(), str(path / "model.safetensors"))
    _copy_tokenizer(minilm_path, path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": D,
                                                                "pooling_mode_mean_tokens": True}))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "search_query: ", "passage": "search_document: "}}))
    return path


def reference_moe(x, router, w1, w2, bias, top_k=K):
    """The published MoE layer from its equations: p = softmax(x W_r) in float32 over all experts; the top-k
    p are the weights, NOT renormalised; y = Σ_j p_j · (GELU(x W1_e^T) W2_e) + b, W1_e / W2_e the e-th (i, d)
    row blocks of the packed w1 / w2. Every expert is computed for every token; the unchosen get weight 0."""
    n_exp = router.shape[0]
    probs = (x.float() @ router.float().T).softmax(-1)  # (N, E)
    top, idx = probs.topk(top_k, -1)  # (N, k)
    weights = torch.zeros_like(probs).scatter(1, idx, top)  # (N, E)
    w1e, w2e = w1.view(n_exp, -1, x.shape[-1]), w2.view(n_exp, -1, x.shape[-1])  # (E, i, d) each
    h = F.gelu(torch.einsum("nd,eid->nei", x, w1e))  # (N, E, i)
    y = torch.einsum("nei,eid->ned", h, w2e)  # (N, E, d)
    return torch.einsum("ne,ned->nd", weights.to(y.dtype), y) + bias


def reference_forward(sd, cfg, ids, mask):
    """The published NomicBERT encoder (post-LayerNorm, rotary on whole heads, halves rotated) on its own tensors."""
    d, heads, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hd, (B, T) = d // heads, ids.shape
    ln = lambda x, n: F.layer_norm(x, (d,), sd[n + ".weight"], sd[n + ".bias"], eps)  # noqa: E731
    lin = lambda x, n: F.linear(x, sd[n + ".weight"], sd.get(n + ".bias"))  # noqa: E731
    x = ln(sd["embeddings.word_embeddings.weight"][ids] + sd["embeddings.token_type_embeddings.weight"][0], "emb_ln")
    inv = 1.0 / cfg["rotary_emb_base"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)  # (T, hd/2)
    cos, sin = ang.cos().float(), ang.sin().float()

    def rotate(t):  # (B, H, T, hd): channel j pairs with j + hd/2
        a, b = t[..., : hd // 2], t[..., hd // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        q, k, v = lin(x, p + "attn.Wqkv").view(B, T, 3, heads, hd).unbind(2)  # each (B, T, H, hd)
        q, k, v = rotate(q.transpose(1, 2)), rotate(k.transpose(1, 2)), v.transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)  # (B, H, T, T)
        a = s.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1) @ v  # (B, H, T, hd)
        x = ln(x + lin(a.transpose(1, 2).reshape(B, T, d), p + "attn.out_proj"), p + "norm1")
        if p + "mlp.router.layer.weight" in sd:
            m = reference_moe(x.reshape(-1, d), sd[p + "mlp.router.layer.weight"], sd[p + "mlp.experts.mlp.w1"],
                              sd[p + "mlp.experts.mlp.w2"], sd[p + "mlp.experts.bias"], cfg["moe_top_k"]).view(B, T, d)
        else:
            m = lin(F.gelu(lin(x, p + "mlp.fc1")), p + "mlp.fc2")
        x = ln(x + m, p + "norm2")
    return x


@pytest.mark.parametrize("mode", ["auto", "loop", "reference", "grouped"])
def test_published_moe_checkpoint_matches_reference_forward_and_backward(tmp_path, minilm_path, mode, monkeypatch):
    from moe_reference import use_reference
    from spy import calls_of

    from moembed.model import backends
    from moembed.model.fast.experts import grouped_support

    if mode == "grouped" and not grouped_support(torch.device("cpu"), torch.float32).usable:
        pytest.skip("this torch has no usable torch._grouped_mm on the CPU")  # the other modes still run
    path = write_published(tmp_path / "v2", minilm_path)
    emb = Embedder.load(path)
    c = emb.config
    assert c.moe_layers() == [1, 3] and (c.mlp, c.bias, c.type_vocab_size, c.layer_norm_eps) == ("gelu", True, 1, 1e-5)
    assert (c.moe.renormalize, c.moe.expert_bias, c.moe.output_bias, c.moe.top_k) == (False, False, True, K)
    assert (emb.pooling, emb.normalize, emb.prompts["query"]) == ("mean", True, "search_query: ")
    if mode == "reference":
        use_reference(emb.encoder)
    elif mode != "auto":  # "auto": as loaded
        backends.use_experts(emb.encoder, mode)
    grouped_support(torch.device("cpu"), torch.float32)  # probed before the calls are counted
    grouped = calls_of(monkeypatch, torch, "_grouped_mm")

    sd = {k: v.requires_grad_() for k, v in load_file(str(path / "model.safetensors")).items()}
    ids, mask = _batch(emb)
    ref = reference_forward(sd, published_config(), ids, mask)
    out = emb.encoder(ids, mask).last_hidden_state
    torch.testing.assert_close(out[mask], ref[mask], atol=1e-5, rtol=1e-4)  # float32 rounding of other kernels
    assert bool(grouped) == (mode == "grouped" or (mode == "auto" and emb.backend.path("moe") == "grouped"))

    r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref[mask] * r[mask]).sum().backward()
    (out[mask] * r[mask]).sum().backward()
    mine = CONVERTER.weights_to_hf({n: p.grad for n, p in emb.encoder.named_parameters()}, c, layout="published")
    assert set(mine) == set(sd)
    for n, t in sd.items():
        scale = t.grad.abs().max().item()  # float32 sums over the batch: compare relative to the largest entry
        torch.testing.assert_close(mine[n], t.grad, atol=1e-5 * scale, rtol=1e-4, msg=n)
    assert sd["encoder.layers.1.mlp.experts.bias"].grad.abs().sum() > 0


def test_moe_block_options_follow_the_published_equations(make_tiny):
    """moembed's MoE block with renormalize off, no expert biases and a shared output bias, against
    `reference_moe` on the packed tensors: outputs and every gradient, in every dispatch mode."""
    from moe_reference import ReferenceMoE

    from moembed.model import backends
    from moembed.model.fast import swapped
    from moembed.model.moe import MoEBlock

    emb = make_tiny("bert", hidden_size=D, intermediate_size=INNER, num_layers=2,
                    moe={"num_experts": E, "top_k": K, "renormalize": False, "expert_bias": False, "output_bias": True})
    block = emb.encoder.layers[1].mlp
    assert isinstance(block, MoEBlock) and block.experts.fc1_bias is None and block.output_bias is not None
    with torch.no_grad():
        block.output_bias.normal_()
        block.router.weight.normal_(std=0.5)
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(2))
    w1 = block.experts.fc1_weight.detach().reshape(E * INNER, D).requires_grad_()
    w2 = block.experts.fc2_weight.detach().transpose(1, 2).reshape(E * INNER, D).requires_grad_()
    router, bias = block.router.weight.detach().requires_grad_(), block.output_bias.detach().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = reference_moe(xr, router, w1, w2, bias)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    (ref * g).sum().backward()
    for mode in ("loop", "reference", "grouped"):
        run = swapped(block, ReferenceMoE) if mode == "reference" else backends.use_experts(block, mode)
        block.zero_grad()
        xm = x.clone().requires_grad_()
        out = run(xm)[0]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=mode)
        (out * g).sum().backward()
        torch.testing.assert_close(xm.grad, xr.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(block.router.weight.grad, router.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(block.output_bias.grad, bias.grad)
        torch.testing.assert_close(block.experts.fc1_weight.grad.reshape(E * INNER, D), w1.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(block.experts.fc2_weight.grad.transpose(1, 2).reshape(E * INNER, D), w2.grad,
                                   atol=1e-5, rtol=1e-4)
    assert (block.route(x).gates.sum(-1) < 1 - 1e-4).all()  # the top-2 probabilities as is, not renormalised


def write_back(emb: Embedder, out: Path, layout="published") -> Path:
    """The encoder written in a NomicBERT layout with its tokenizer and sentence-transformers files."""
    from moembed.model.io import _write_st_modules

    out.mkdir()
    (out / "config.json").write_text(json.dumps(CONVERTER.hf_config(emb.config, layout=layout), indent=2))
    sd = CONVERTER.weights_to_hf(emb.encoder.state_dict(), emb.config, layout=layout)
    save_file(sd, str(out / "model.safetensors"))
    _copy_tokenizer(emb.source_dir, out)
    _write_st_modules(emb.parts(), out, "sentence_transformers.models.Transformer")
    return out


def test_published_round_trip_gives_identical_tensors_and_embeddings(tmp_path, minilm_path):
    path = write_published(tmp_path / "v2", minilm_path)
    emb = Embedder.load(path)
    out = write_back(emb, tmp_path / "back")
    original, written = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(written) == set(original)
    for k in original:
        assert torch.equal(written[k], original[k]), k
    cfg, src = json.loads((out / "config.json").read_text()), published_config()
    assert {k: cfg[k] for k in src if k in cfg} == {k: src[k] for k in src if k in cfg}
    assert not set(src) - set(cfg)  # every published key written back
    back = Embedder.load(out)
    assert back.config == emb.config and back.prompts == emb.prompts
    np.testing.assert_array_equal(back.encode(TEXTS, prompt_name="query"), emb.encode(TEXTS, prompt_name="query"))


def test_finetune_a_published_moe_checkpoint_and_write_it_back(tmp_path, minilm_path):
    from train_helpers import chatterbot_pairs, write_pairs

    from moembed.train.config import load_config
    from moembed.train.loop import train

    path = write_published(tmp_path / "v2", minilm_path)
    pairs = write_pairs(tmp_path / "pairs.jsonl", chatterbot_pairs()[:64], negatives=3)
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "finetune.yaml"
    cfg = load_config(tiny, [f"model={path}", "model_config_overrides={}", f"data=[{{path: {pairs}, name: a, "
                             "negatives_field: negatives}]", f"output_dir={tmp_path / 'run'}", "steps=2",
                             "checkpoint.every=2"])
    trained = Embedder.load(train(cfg, progress=False))
    before = Embedder.load(path)
    assert trained.config == before.config and "published" in CONVERTER.layouts(trained.config)
    bias = "layers.1.mlp.output_bias"
    assert not torch.equal(trained.encoder.state_dict()[bias], before.encoder.state_dict()[bias])  # it trained
    back = Embedder.load(write_back(trained, tmp_path / "back"))
    np.testing.assert_array_equal(back.encode(TEXTS), trained.encode(TEXTS))


# ---- bad input --------------------------------------------------------------------------------------------------


def test_mismatching_tensor_names_the_tensor_and_both_shapes(tmp_path, minilm_path):
    sd = published_weights()
    sd["encoder.layers.3.mlp.experts.mlp.w1"] = torch.zeros((E - 1) * INNER, D)
    path = write_published(tmp_path / "bad", minilm_path, sd=sd)
    with pytest.raises(MoembedError) as e:
        Embedder.load(path)
    msg = str(e.value)
    assert str(path) in msg and "'encoder.layers.3.mlp.experts.mlp.w1'" in msg
    assert f"({(E - 1) * INNER}, {D})" in msg and f"({E * INNER}, {D})" in msg

    sd = published_weights()
    del sd["encoder.layers.1.mlp.experts.bias"]
    with pytest.raises(MoembedError, match=r"missing tensor 'encoder.layers.1.mlp.experts.bias'"):
        Embedder.load(write_published(tmp_path / "missing", minilm_path, sd=sd))


def test_mismatching_transformers_checkpoint_names_the_tensor(hf_nomic):
    _, path = hf_nomic
    sd = load_file(str(path / "model.safetensors"))
    sd["encoder.layers.1.mlp.fc12.weight"] = sd["encoder.layers.1.mlp.fc12.weight"][:40]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(MoembedError, match=r"'encoder.layers.1.mlp.fc12.weight' has shape \(40, 32\), "
                                           r"(but \S+/)?config.json implies \(48, 32\)"):
        Embedder.load(path)


@pytest.mark.parametrize("change, words", [
    ({"rotary_emb_fraction": 0.5}, "rotary_emb_fraction"),
    ({"mlp_fc2_bias": False}, "mlp_fc2_bias"),
    ({"activation_function": "swiglu"}, "MoE layers with activation_function 'swiglu'"),
    ({"prenorm": True}, "prenorm"),
    ({"moe_normalize_expert_weights": 2.0}, "moe_normalize_expert_weights"),
    ({"moe_top_k": 9}, "top_k"),
])
def test_unsupported_published_configs_name_the_key(tmp_path, minilm_path, change, words):
    path = write_published(tmp_path / "bad", minilm_path, cfg=published_config(**change))
    with pytest.raises(MoembedError) as e:
        Embedder.load(path)
    assert str(path / "config.json") in str(e.value) and words in str(e.value)


def test_export_cli_writes_a_moe_checkpoint_in_the_published_layout(tmp_path, minilm_path):
    """`moembed export --format huggingface` of a NomicBERT MoE model: transformers' classes hold no MoE layers, so
    the model is written in the layout it was read from, tensor for tensor, and reads back to identical embeddings."""
    import subprocess
    import sys

    path = write_published(tmp_path / "v2", minilm_path)
    out = tmp_path / "exported"
    run = subprocess.run([sys.executable, "-m", "moembed.cli.main", "export", str(path), "--format", "huggingface",
                          "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    original, written = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(written) == set(original) and all(torch.equal(written[k], original[k]) for k in original)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts"], cfg["moe_every_n_layers"]) == ("nomic_bert", E, 2)
    np.testing.assert_array_equal(Embedder.load(out).encode(TEXTS), Embedder.load(path).encode(TEXTS))
