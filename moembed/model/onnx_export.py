"""ONNX export: an Embedder as one graph that ONNX Runtime and sentence-transformers' `backend="onnx"` run.

    export_onnx(emb, "out/")                     # out/onnx/model.onnx beside the tokenizer and pooling files
    export_onnx(emb, "out/", quantize="int8")    # also out/onnx/model_qint8_quantized.onnx (ORT dynamic int8)

The directory is a sentence-transformers one (modules.json: Transformer, Pooling, Normalize) in the layout its ONNX
backend reads: config.json of a transformers model type (the family's Hugging Face config, so that AutoConfig and
AutoTokenizer read it), the tokenizer files, and onnx/model.onnx. An encoder a family's transformers class holds
(dense BERT, RoBERTa, XLM-R, NomicBERT) also gets its weights in that layout, so `backend="torch"` loads the same
directory; for any other (MoE, MoVE, moembed's own layers) the graph is the only copy of the weights and config.json
only describes the shapes (`moembed_onnx_only`: no model.safetensors, so the torch backend refuses it loudly).

The graph is `ExportGraph`: the encoder's own weights in plain torch ops on the padded (B, T) layout, as
transformers' BERT classes compute, not the layers' forward passes (which remove padding with data-dependent
indices, pick CPU fast paths on ~10 conditions and run C loops that no exporter can trace). Inputs `input_ids` and
`attention_mask` (B, T) int64, both axes dynamic; outputs `last_hidden_state` (B, T, d), zero at padding, and
`sentence_embedding` (B, d), pooled and normalised as the model is. Token types are always 0, as moembed encodes
(one segment per text): the graph has no `token_type_ids` input (Optimum feeds a graph only the inputs it names).

MoE blocks are dropless, as at moembed's inference: the router's top-k, then a loop over the experts in which each
expert gathers its own tokens (`nonzero` on the routing of real tokens), runs on them and adds its gate-weighted
output back (`index_add`): each expert's matmuls over its own rows, k·N rows in all, the work of the layer's `naive` dispatch
(`moe.MoEBlock._forward_naive`), never all experts on all tokens. torch.export carries the data-dependent row
counts as symbolic sizes, so the graph is exported with `torch.onnx.export(..., dynamo=True)`; the TorchScript
exporter would trace one batch's routing into constants. A MoVE embedding layer is exported as its full
(V_l, d) table (`MoVEEmbedding.weight`): at inference each V_l token's embedding depends on the token alone.
Dynamic NTK (rotary models) is in the graph: each sequence's base from its own real length (rope.py, Eq. 5).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.errors import MoembedError
from moembed.fileio import atomic_dir
from moembed.model.activations import MLP_ACTIVATIONS
from moembed.model.card import CardInfo, write_card
from moembed.model.families import FAMILIES, exporter_for
from moembed.model.io import _copy_tokenizer, _write_hf, _write_st_modules
from moembed.model.rope import apply_rope

ONNX_DIR = "onnx"  # sentence-transformers' ONNX backend looks for onnx/model.onnx
ONNX_FILE = "model.onnx"
INT8_FILE = "model_qint8_quantized.onnx"  # the name sentence-transformers' own dynamic int8 export gives
QUANTIZE = ("int8",)
INPUTS = ("input_ids", "attention_mask")
OUTPUTS = ("last_hidden_state", "sentence_embedding")
OPSET = 18
FLOAT_WEIGHTS = ("_router", "_fc2")  # `ExportGraph.w` names whose matmuls stay float32 in the int8 graph


class ExportGraph(nn.Module):
    """An Embedder's forward on the padded layout in plain ops (no packing, no fast path, no C loop).

    forward(input_ids (B, T) int64, attention_mask (B, T) int64) → (last_hidden_state (B, T, d) float32, zero at
    padding; sentence_embedding (B, d) float32, pooled as the model pools, L2-normalised when it normalises).
    Padding tokens are computed by the dense layers (their rows are never read) and routed to no expert.
    """

    def __init__(self, emb):
        super().__init__()
        self.encoder, self.config = emb.encoder, emb.config
        self.pooling, self.normalize = emb.pooling, emb.normalize
        word = self.encoder.embeddings.word
        with torch.no_grad():  # MoVE: the whole V_l table once; a plain table as it is
            self.register_buffer("word_table", word.weight.detach().float().clone(), persistent=False)
        # Every weight matrix transposed, one tensor per expert: each matmul then reads a graph constant of its own
        # (ONNX MatMul), which ONNX Runtime's dynamic quantiser can turn into int8 (not a Gemm, nor a slice of a
        # stacked tensor, which it leaves in float32).
        self.w = nn.ParameterDict()
        for name, weight in self._matrices():
            self.w[name.replace(".", "_")] = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)

    def _matrices(self):
        for i, layer in enumerate(self.encoder.layers):
            yield f"{i}.qkv", layer.qkv.weight
            yield f"{i}.out", layer.out.weight
            if i in self.config.moe_layers():
                yield f"{i}.router", layer.mlp.router.weight
                for e in range(layer.mlp.num_experts):
                    yield f"{i}.e{e}.fc1", layer.mlp.experts.fc1_weight[e]
                    yield f"{i}.e{e}.fc2", layer.mlp.experts.fc2_weight[e]
            else:
                yield f"{i}.fc1", layer.mlp.fc1.weight
                yield f"{i}.fc2", layer.mlp.fc2.weight

    def linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None) -> torch.Tensor:
        """x Wᵀ + b with W stored transposed (`self.w`): (..., in) → (..., out)."""
        y = torch.matmul(x, self.w[name.replace(".", "_")])
        return y if bias is None else y + bias

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = input_ids.shape
        mask = attention_mask.bool()  # (B, T)
        valid = mask.reshape(-1)  # (B·T,)
        x = self.embed(input_ids)  # (B, T, d)
        cos, sin = self.rotary(mask) if self.config.position == "rotary" else (None, None)
        for i, layer in enumerate(self.encoder.layers):
            x = layer.norm1(x + self.linear(self.attention(i, layer, x, mask, cos, sin), f"{i}.out", layer.out.bias))
            if i in self.config.moe_layers():
                m = self.moe(i, layer.mlp, x.reshape(B * T, -1), valid).view(B, T, -1)  # on (B·T, d) rows
            else:
                m = self.mlp(i, layer.mlp, x)
            x = layer.norm2(x + m)
        x = x * mask.unsqueeze(-1).to(x.dtype)  # zeros at padding, as EncoderOutput.last_hidden_state
        return x, self.pool(x, mask)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Word (+ absolute position) (+ token type 0) embeddings and LayerNorm: (B, T) → (B, T, d)."""
        e = self.encoder.embeddings
        x = F.embedding(ids, self.word_table)  # (B, T, d)
        if e.position is not None:
            x = x + e.position.weight[: ids.shape[1]].unsqueeze(0)  # positions 0..T-1
        if e.token_type is not None:
            x = x + e.token_type.weight[0]
        return e.norm(x)

    def rotary(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, T, hd) with each sequence's own base: Dynamic NTK beyond the trained length from the
        sequence's real length (nomic-embed-v1 Eq. 5, `rope.ntk_base`), the plain base otherwise (`rope.rope_cos_sin`),
        in float64 as those are."""
        c = self.config
        D, T, L = c.head_dim, mask.shape[1], c.max_position
        lengths = mask.sum(1).to(torch.float64)  # (B,)
        base = torch.full_like(lengths, c.rope_base)
        if c.dynamic_ntk:
            s = lengths / L
            scaled = base * ((c.ntk_alpha * s) - (c.ntk_alpha - 1)).clamp_min(1e-6) ** (D / (D - 2))
            base = torch.where(lengths > L, scaled, base)
        exponent = torch.arange(0, D, 2, dtype=torch.float64, device=mask.device) / D  # (D/2,)
        inv_freq = 1.0 / base.unsqueeze(1) ** exponent  # (B, D/2)
        t = torch.arange(T, dtype=torch.float64, device=mask.device)  # (T,)
        freqs = t.view(1, T, 1) * inv_freq.unsqueeze(1)  # (B, T, D/2)
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, T, D)
        return angles.cos().float(), angles.sin().float()

    def attention(self, i: int, layer, x: torch.Tensor, mask: torch.Tensor, cos, sin) -> torch.Tensor:
        """Multi-head attention over each sequence's real keys: (B, T, d) → (B, T, d), before `out`."""
        B, T, _ = x.shape
        H, hd = layer.num_heads, layer.head_dim
        qkv = self.linear(x, f"{i}.qkv", layer.qkv.bias)  # (B, T, 3d)
        q, k, v = qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])  # (B, H, T, hd)
        return a.transpose(1, 2).reshape(B, T, H * hd)

    def mlp(self, i: int, mlp, x: torch.Tensor) -> torch.Tensor:
        """A dense MLP (GELU or SwiGLU, encoder.py): (..., d) → (..., d)."""
        h = self.linear(x, f"{i}.fc1", mlp.fc1.bias)
        return self.linear(MLP_ACTIVATIONS[self.config.mlp](h), f"{i}.fc2", mlp.fc2.bias)

    def moe(self, i: int, block, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A dropless MoE block (moe.py): softmax router, top-k, each expert on the real tokens routed to it, the
        gate-weighted outputs summed (and the shared output bias). x (n, d), valid (n,) bool → (n, d)."""
        probs = self.linear(x, f"{i}.router", None).softmax(dim=-1)  # (n, E)
        gates, experts = probs.topk(block.top_k, dim=-1)  # (n, k) each
        if block.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        w, act = block.experts, MLP_ACTIVATIONS[self.config.mlp]
        out = torch.zeros_like(x)  # (n, d)
        for e in range(block.num_experts):
            tok, slot = ((experts == e) & valid.unsqueeze(1)).nonzero(as_tuple=True)  # (n_e,) each
            h = self.linear(x.index_select(0, tok), f"{i}.e{e}.fc1", None if w.fc1_bias is None else w.fc1_bias[e])
            y = self.linear(act(h), f"{i}.e{e}.fc2", None if w.fc2_bias is None else w.fc2_bias[e])  # (n_e, d)
            out = out.index_add(0, tok, y * gates[tok, slot].unsqueeze(-1))
        return out if block.output_bias is None else out + block.output_bias

    def pool(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, d) → (B, d) as `pooling.pool`: mean over real tokens, the first token, or the last real one."""
        m = mask.to(x.dtype)  # (B, T)
        if self.pooling == "mean":
            v = x.sum(1) / m.sum(1, keepdim=True).clamp_min(1.0)
        elif self.pooling == "cls":
            v = x[:, 0]
        else:
            last = (m.sum(1).long() - 1).clamp_min(0)  # (B,) right padding: the last real token
            v = x[torch.arange(x.shape[0], device=x.device), last]
        return F.normalize(v, dim=-1) if self.normalize else v


def export_graph(emb, path: Path, example_length: int = 16) -> None:
    """Write `ExportGraph(emb)` to `path` as one ONNX file (weights inside), batch and sequence axes dynamic."""
    import torch.export as te

    graph = ExportGraph(emb).eval()
    B, T = 2, min(example_length, emb.max_length)
    device = next(emb.parameters()).device
    ids = torch.full((B, T), emb.config.pad_token_id, dtype=torch.long, device=device)
    ids[:, 0] = 1  # any id: the routing is symbolic, not these values
    mask = torch.ones(B, T, dtype=torch.long, device=device)
    mask[1, T // 2:] = 0
    batch, seq = te.Dim("batch", min=1), te.Dim("sequence", min=1, max=_longest(emb))
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    with torch.no_grad(), warnings.catch_warnings():
        # both inputs share the two axes; the exporter warns that it names them once
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used")
        program = torch.onnx.export(graph, (ids, mask), dynamo=True, input_names=list(INPUTS),
                                    output_names=list(OUTPUTS), dynamic_shapes=shapes, opset_version=OPSET,
                                    external_data=False, optimize=True, verify=False, report=False, verbose=False)
    program.save(str(path), external_data=_needs_external(emb))


def _longest(emb) -> int:
    """The longest sequence the graph takes: the absolute position table's length, else a large bound."""
    c = emb.config
    return c.max_position if c.position == "absolute" else max(c.max_position, emb.max_length, 1 << 16)


def _needs_external(emb) -> bool:
    """Weights past protobuf's 2 GB limit go to a file beside the graph (`model.onnx.data`)."""
    return sum(p.numel() for p in emb.encoder.parameters()) * 4 > 1.8e9


def quantize_int8(source: Path, target: Path) -> None:
    """ONNX Runtime's dynamic quantiser: int8 weights per output channel, activations quantised per call (no
    calibration data) on the 7-bit range (`reduce_range`: AVX2 kernels without VNNI saturate on the full one).

    Quantised: the matmuls by the weights of `FLOAT_WEIGHTS`' complement: q/k/v, attention output, the MLPs' and
    experts' fc1. Kept float32: the routers (a flipped expert choice moves a token's whole output), the MLPs' fc2
    (its input, after GELU, has the long tail that one 8-bit scale per call resolves worst: packaged MiniLM,
    cosine to float32 0.992-0.998 instead of 0.985-0.995 on short sentences), attention's activation-by-activation
    matmuls and the embedding tables. ONNX Runtime takes one activation scale per call for the whole batch, so int8
    vectors can change in the last digits with the batch a text is in (moembed's own int8 scales each row)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(source), load_external_data=False).graph
    quantized = {t.name for t in graph.initializer if t.name.startswith("w.") and not t.name.endswith(FLOAT_WEIGHTS)}
    keep = [n.name for n in graph.node if n.op_type == "MatMul" and not quantized.intersection(n.input)]
    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                     op_types_to_quantize=["MatMul"], nodes_to_exclude=keep)


# ---- the directory --------------------------------------------------------------------------------------------


def export_onnx(emb, path: str | Path, quantize: str | None = None, card: CardInfo | None = None) -> list[str]:
    """Write `emb` (an Embedder) as a sentence-transformers directory with onnx/model.onnx (and, with
    `quantize="int8"`, onnx/model_qint8_quantized.onnx), atomically, with its model card. Returns the graph files
    written, relative to `path`. Needs the `onnx` extra (onnx, onnxruntime, onnxscript)."""
    if quantize is not None and quantize not in QUANTIZE:
        raise MoembedError(f"--quantize: unknown {quantize!r}; choose {', '.join(QUANTIZE)}")
    _check_installed(quantize)
    parts = emb.parts()
    family = exporter_for(parts.config)
    written = [f"{ONNX_DIR}/{ONNX_FILE}"]
    with atomic_dir(Path(path)) as tmp:
        if family is not None:
            _write_hf(parts, family, tmp)
        else:
            _write_description(parts, tmp)
        (tmp / ONNX_DIR).mkdir()
        was_training = emb.training
        try:
            export_graph(emb.eval(), tmp / ONNX_DIR / ONNX_FILE)
        finally:
            emb.train(was_training)
        if quantize == "int8":
            quantize_int8(tmp / ONNX_DIR / ONNX_FILE, tmp / ONNX_DIR / INT8_FILE)
            written.append(f"{ONNX_DIR}/{INT8_FILE}")
        write_card(parts, tmp, "onnx", card, Path(path))
    return written


def _write_description(parts, tmp: Path) -> None:
    """config.json for an encoder no transformers class holds: its family's Hugging Face config (BERT's fields
    for moembed's own layers) so that AutoConfig reads it; the tokenizer; the sentence-transformers files."""
    from moembed.model.families.bert import CONVERTER as BERT

    family = FAMILIES.get(parts.config.hf_model_type or "")
    try:
        cfg = family.hf_config(parts.config) if family is not None else BERT.hf_config(parts.config)
    except (ValueError, MoembedError):  # a family whose config refuses this encoder (e.g. NomicBERT with MoE)
        family, cfg = BERT, BERT.hf_config(parts.config)
    family = family or BERT
    cfg["moembed_onnx_only"] = "the weights are in onnx/model.onnx only; this file describes the shapes"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _copy_tokenizer(parts, tmp)
    if not (tmp / "tokenizer_config.json").exists():
        (tmp / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": family.tokenizer_class, "model_max_length": parts.tokenizer.max_length}))
    _write_st_modules(parts, tmp, "sentence_transformers.models.Transformer")


def _check_installed(quantize: str | None) -> None:
    """The packages export needs, named with the install line when one is missing."""
    import importlib.util

    need = ["onnx", "onnxscript"] + (["onnxruntime"] if quantize else [])
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        raise MoembedError(f"--format onnx needs {', '.join(missing)}: pip install 'moembed[onnx]'")
