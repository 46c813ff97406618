"""A MoVE vocabulary pair: base vocabulary V_s, routing vocabulary V_l and the decomposition φ (MoVE §3.1, Eq. 1).

One byte-level BPE is trained to |V_l| (by `moembed.data.tokenizers`; any BPE tokenizer.json also works); V_s is
the same tokenizer cut after its first merges (special tokens + byte alphabet + the first |V_s| − 261 merge
results). A V_l token is decomposed by running the V_s merges on its
own string, so its pieces concatenate back to it, and every V_l token decomposes (the byte alphabet is in V_s).
Tokens of V_s keep their id in V_l and decompose to themselves (Eq. 1, first case); special tokens are their own
single piece. Word boundaries are the byte-level "Ġ" prefix, identical in both vocabularies since a piece is a
substring of its token.

Directory layout (`VocabPair.save`):
    tokenizer.json          V_l tokenizer (the model's input tokenizer)
    tokenizer_small.json    V_s tokenizer (for a base-vocabulary baseline; not needed by a MoVE model)
    move.safetensors        phi (|V_l|, L) long, lengths (|V_l|,), frequency (|V_l|,) corpus counts, routing (|V_l|,)
    move.json               sizes and the routing used
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, processors

from moembed.data.tokenizers import TokenizerConfig, train_tokenizer
from moembed.errors import MoembedError
from moembed.fileio import atomic_dir
from moembed.model.config import MoVEConfig
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder
from moembed.model.move import hash_balanced_routing, move_budget, semantic_routing
from moembed.model.presets import bert_config, nomic_config
from moembed.model.tokenizer import TextTokenizer


def train_bpe(texts: list[str], vocab_size: int, min_frequency: int = 2, lowercase: bool = True) -> Tokenizer:
    """A byte-level BPE tokenizer ([CLS] text [SEP]) trained on `texts` by `moembed.data.tokenizers`."""
    import tempfile

    cfg = TokenizerConfig(kind="bpe", vocab_size=vocab_size, multiple=1, lowercase=lowercase, min_frequency=min_frequency)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n", encoding="utf-8")
        train_tokenizer([str(corpus)], cfg, Path(tmp) / "tok")
        return Tokenizer.from_file(str(Path(tmp) / "tok" / "tokenizer.json"))


def _add_template(tok: Tokenizer) -> None:
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )


def _bpe_parts(tok: Tokenizer) -> tuple[dict, dict[str, int], list[tuple[str, str]]]:
    spec = json.loads(tok.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise MoembedError(f"vocabulary pair: needs a BPE tokenizer, got {model.get('type')!r}")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return spec, model["vocab"], merges


def truncate_bpe(tok: Tokenizer, size: int) -> Tokenizer:
    """The base tokenizer V_s: `tok` with only its first merges, so that it has `size` tokens.

    V_s ids are the V_l ids of the same strings when `tok` numbers its tokens specials, alphabet, merges in order
    (as `train_bpe` does); then V_s is exactly the id range [0, size) of V_l.
    """
    spec, vocab, merges = _bpe_parts(tok)
    produced = {a + b for a, b in merges}
    initial = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in produced]
    keep = size - len(initial)
    if keep < 0 or size > len(vocab):
        raise MoembedError(f"base vocabulary size {size} must lie in {len(initial)}..{len(vocab)} for this tokenizer")
    small_merges = merges[:keep]
    tokens = sorted(set(initial) | {a + b for a, b in small_merges}, key=lambda t: vocab[t])
    small_vocab = {t: i for i, t in enumerate(tokens)}
    spec["model"]["vocab"] = small_vocab
    spec["model"]["merges"] = [[a, b] for a, b in small_merges]
    spec["model"]["ignore_merges"] = False
    # Added tokens outside V_s (e.g. "[unusedN]" fillers appended after the merges) are left out of V_s.
    spec["added_tokens"] = [a for a in spec.get("added_tokens", []) if a["content"] in small_vocab]
    for a in spec["added_tokens"]:
        a["id"] = small_vocab[a["content"]]
    small = Tokenizer.from_str(json.dumps(spec))
    _add_template(small)
    return small


def decompose(large: Tokenizer, small: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """φ (Eq. 1): V_s ids of each V_l token's pieces → phi (|V_l|, L) long (0-padded), lengths (|V_l|,)."""
    small_vocab = small.get_vocab()
    items = sorted(large.get_vocab().items(), key=lambda kv: kv[1])
    if [i for _, i in items] != list(range(len(items))):
        raise MoembedError("vocabulary pair: the V_l tokenizer's ids are not contiguous from 0")
    pieces = []
    for token, _ in items:
        if token in small_vocab:  # Eq. 1, first case: a V_s token is its own single piece
            pieces.append([small_vocab[token]])
        else:
            pieces.append([small_vocab[p.value] for p in small.model.tokenize(token)])
        if not pieces[-1] or "".join(small.id_to_token(i) for i in pieces[-1]) != token:
            raise MoembedError(f"vocabulary pair: V_l token {token!r} does not decompose into V_s pieces")
    L = max(len(p) for p in pieces)
    phi = torch.zeros(len(pieces), L, dtype=torch.long)
    for i, p in enumerate(pieces):
        phi[i, : len(p)] = torch.tensor(p)
    return phi, torch.tensor([len(p) for p in pieces], dtype=torch.long)


def token_frequency(tok: Tokenizer, texts: list[str], batch_size: int = 1024) -> torch.Tensor:
    """(|V|,) how often each token occurs when `texts` are tokenized (special tokens included: they are inputs too)."""
    counts = torch.zeros(tok.get_vocab_size(), dtype=torch.long)
    for s in range(0, len(texts), batch_size):
        ids = [i for e in tok.encode_batch(texts[s : s + batch_size]) for i in e.ids]
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(counts))
    return counts


@dataclass
class VocabPair:
    large: Tokenizer  # V_l
    small: Tokenizer  # V_s
    phi: torch.Tensor  # (|V_l|, L) long
    lengths: torch.Tensor  # (|V_l|,) long
    frequency: torch.Tensor  # (|V_l|,) long, counts on the building corpus
    routing: torch.Tensor  # (|V_l|,) long expert per token
    routing_kind: str = "hash"

    @property
    def sizes(self) -> tuple[int, int]:
        """(|V_s|, |V_l|)."""
        return self.small.get_vocab_size(), self.large.get_vocab_size()

    @property
    def num_experts(self) -> int:
        return int(self.routing.max()) + 1

    def save(self, path: str | Path) -> None:
        vs, vl = self.sizes
        with atomic_dir(path) as tmp:
            self.large.save(str(tmp / "tokenizer.json"))
            self.small.save(str(tmp / "tokenizer_small.json"))
            tensors = {"phi": self.phi, "lengths": self.lengths, "frequency": self.frequency, "routing": self.routing}
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "move.safetensors"))
            meta = {"base_vocab_size": vs, "vocab_size": vl, "max_pieces": self.phi.shape[1],
                    "num_experts": self.num_experts, "routing": self.routing_kind}
            (tmp / "move.json").write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "VocabPair":
        path = Path(path)
        for f in ("tokenizer.json", "tokenizer_small.json", "move.safetensors", "move.json"):
            if not (path / f).exists():
                raise MoembedError(f"{path / f}: missing (not a MoVE vocabulary directory)")
        try:
            t = load_file(str(path / "move.safetensors"))
            meta = json.loads((path / "move.json").read_text())
            large, small = Tokenizer.from_file(str(path / "tokenizer.json")), Tokenizer.from_file(str(path / "tokenizer_small.json"))
        except Exception as e:  # safetensors / tokenizers raise bare exceptions on corrupt files
            raise MoembedError(f"{path}: cannot read the vocabulary pair ({type(e).__name__}: {str(e)[:200]})") from None
        missing = [k for k in ("phi", "lengths", "frequency", "routing") if k not in t]
        if missing:
            raise MoembedError(f"{path / 'move.safetensors'}: missing tensor {missing[0]!r}")
        return cls(large, small, t["phi"], t["lengths"], t["frequency"], t["routing"], meta.get("routing", "hash"))


def build_vocab_pair(
    texts: list[str], base_size: int, size: int, num_experts: int, routing: str = "hash",
    token_vectors: Callable[[list[str]], torch.Tensor] | None = None, min_frequency: int = 2,
    large: Tokenizer | None = None, lowercase: bool = True,
) -> VocabPair:
    """Train V_l on `texts` (or take the BPE `large`), cut V_s from it, decompose V_l, count token frequencies on
    `texts` and build the static routing.

    routing: "hash" (frequency-balanced, the paper's choice), "semantic" (needs `token_vectors`: token strings →
    (|V_l|, D) vectors, e.g. a pretrained embedder's `embed_tensor`),
    or "learned" (the stored table is then the hash one, used only as a fallback; the router decides).
    """
    if not 0 < base_size < size:
        raise MoembedError(f"vocabulary sizes: need base size < size, got {base_size} and {size}")
    large = large or train_bpe(texts, size, min_frequency, lowercase)
    if large.get_vocab_size() <= base_size:
        raise MoembedError(
            f"vocabulary pair: the corpus only supports {large.get_vocab_size()} tokens, not more than the base size {base_size}"
        )
    small = truncate_bpe(large, base_size)
    phi, lengths = decompose(large, small)
    freq = token_frequency(large, texts)
    if routing == "semantic":
        if token_vectors is None:
            raise MoembedError("routing: semantic routing needs token vectors")
        table = semantic_routing(token_vectors(token_strings(large)), num_experts)
    elif routing in ("hash", "learned"):
        table = hash_balanced_routing(freq, num_experts)
    else:
        raise MoembedError(f"routing: unknown {routing!r}; choose hash, learned or semantic")
    return VocabPair(large, small, phi, lengths, freq, table, routing)


def token_strings(tok: Tokenizer) -> list[str]:
    """Readable text of every token, in id order (byte-level "Ġ" decoded to a space), for semantic routing."""
    return [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]


def make_embedder(
    pair: VocabPair, kind: str = "move", family: str = "bert", num_experts: int | None = None,
    expert_dim: int | None = None, routing: str | None = None, residual: bool = False, max_length: int = 512,
    name: str | None = None, **shape,
) -> Embedder:
    """A new random `Embedder` on this vocabulary pair.

    kind: "move" (V_l input, MoVE embedding from V_s; K defaults to the routing table's, d_e to `move_budget`),
    "base" (V_s input, plain table), or "large" (V_l input, plain table: naive vocabulary scaling).
    shape: EncoderConfig fields (hidden_size, num_layers, num_heads, intermediate_size, max_position, ...).
    """
    if kind not in ("move", "base", "large"):
        raise MoembedError(f"kind: unknown {kind!r}; choose move, base or large")
    vs, vl = pair.sizes
    build = bert_config if family == "bert" else nomic_config
    shape.setdefault("max_position", max_length)
    if kind == "move":
        k = num_experts or pair.num_experts
        if k != pair.num_experts and (routing or pair.routing_kind) != "learned":
            raise MoembedError(f"num_experts: the routing table was built for {pair.num_experts} experts, not {k}")
        d_e = expert_dim or move_budget(vs, vl, shape.get("hidden_size", 384), k)[1]
        move = MoVEConfig(base_vocab_size=vs, num_experts=k, expert_dim=d_e, max_pieces=pair.phi.shape[1],
                          routing=routing or pair.routing_kind, residual=residual)
        config = build(vocab_size=vl, move=move, **shape)
    else:
        config = build(vocab_size=vs if kind == "base" else vl, **shape)
    encoder = Encoder(config)
    if kind == "move":
        table = pair.routing if move.routing != "learned" else pair.routing % k
        encoder.embeddings.word.set_vocabulary(pair.phi, pair.lengths, table)
    tok = Tokenizer.from_str((pair.small if kind == "base" else pair.large).to_str())
    return Embedder(encoder, TextTokenizer(tok, max_length), name=name or f"{kind}-{vs if kind == 'base' else vl}")
