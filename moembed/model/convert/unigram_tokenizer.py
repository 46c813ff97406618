"""An XLM-R style `tokenizers` Unigram tokenizer from SentencePiece pieces, scores and a per-codepoint normaliser.

SentencePiece models carry their normaliser as a `precompiled_charsmap`: a darts-clone double-array trie from
UTF-8 keys to offsets into a blob of NUL-terminated replacement strings (sentencepiece `normalizer.cc`;
read in `tokenizers` by `normalizers.Precompiled`). Engines that store the normaliser as a plain table
(codepoint → replacement codepoints) can be given the same normaliser in `tokenizers` by building that blob
from the table, which `charsmap_from_table` does.

Pipeline (the SentencePiece / XLM-R one):
    Precompiled(table) → runs of spaces collapsed to one → Metaspace "▁" (prepended when the text does not start
    with a space) → Unigram Viterbi → `<s> A </s>` (pairs: `<s> A </s> </s> B </s>`).
"""

from __future__ import annotations

import bisect
import struct
from collections import deque

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

METASPACE = "\u2581"  # SentencePiece's visible space "▁"

# darts-clone unit layout (darts.h, DoubleArrayUnit): bits 0-7 label, bit 8 has_leaf, bit 9 offset shift flag,
# bits 10-30 offset; a value unit has bit 31 set and the value in bits 0-30.
_HAS_LEAF = 1 << 8
_IS_VALUE = 1 << 31
_MAX_OFFSET = 1 << 21  # offsets below 2**21 need no shift


def _build_double_array(keys: dict[bytes, int]) -> list[int]:
    """Darts-clone double array for `keys` (non-empty byte strings without NUL → value < 2**31).

    Lookup (darts-clone `commonPrefixSearch`): pos = units[0].offset; for each key byte c: pos ^= c, the unit
    there must carry label c, pos ^= its offset; a unit with has_leaf holds its value at units[pos]. Each trie node
    gets a distinct base b with its children at b ^ label and its value (label 0) at b, so no two nodes can reach
    the same slot with the same label. The array is padded to a multiple of 256 so that b ^ c stays in range for
    every byte c probed at run time.
    """
    trie: dict = {}  # nested dicts: byte → child; key None → value
    for key, value in keys.items():
        node = trie
        for c in key:
            node = node.setdefault(c, {})
        node[None] = value
    units: dict[int, int] = {0: 0}  # position → unit (0 = root; its offset is set first)
    used_bases: set[int] = set()
    free: list[int] = []  # sorted free slots below `high`; every slot from `high` up is free
    high = 1

    def occupy(p: int) -> None:
        nonlocal high
        if p < high:
            free.pop(bisect.bisect_left(free, p))
        else:
            free.extend(range(high, p))
            high = p + 1

    def fits(base: int, labels: list[int]) -> bool:
        return base not in used_bases and all((base ^ c) not in units for c in labels)

    queue = deque([(trie, 0)])  # (node, its position), breadth first
    while queue:
        node, pos = queue.popleft()
        labels = sorted(0 if c is None else c for c in node)
        # the first label goes into the lowest free slot where all the others fit too
        slot = next((f for f in free if fits(f ^ labels[0], labels)), None)
        if slot is None:
            slot = high
            while not fits(slot ^ labels[0], labels):
                slot += 1
        base = slot ^ labels[0]
        used_bases.add(base)
        offset = pos ^ base
        if offset >= _MAX_OFFSET:  # would need darts' shifted offsets; ~1M trie slots, far beyond any charsmap
            raise ValueError("normalisation table too large for the charsmap trie")
        units[pos] |= offset << 10
        for c in labels:
            child = node[None if c == 0 else c]
            occupy(base ^ c)
            if c == 0:
                units[base] = _IS_VALUE | child
            else:
                units[base ^ c] = c | (_HAS_LEAF if None in child else 0)
                queue.append((child, base ^ c))
    size = (max(units) | 255) + 1
    size = max(size, (max(used_bases) | 255) + 1)
    array = [0] * size
    for p, u in units.items():
        array[p] = u
    return array


def charsmap_from_table(table: dict[int, tuple[int, ...]]) -> bytes:
    """A SentencePiece `precompiled_charsmap` that maps each codepoint of `table` to its replacement.

    Layout: u32 trie size in bytes | trie units (u32 little-endian) | replacement strings, each NUL-terminated
    (an empty replacement deletes the character). Codepoint 0 cannot be a key (NUL ends a lookup).
    """
    blob = bytearray()
    where: dict[str, int] = {}
    keys = {}
    for cp, out in sorted(table.items()):
        if cp == 0:
            continue
        text = "".join(map(chr, out))
        if text not in where:
            where[text] = len(blob)
            blob += text.encode("utf-8") + b"\0"
        keys[chr(cp).encode("utf-8")] = where[text]
    array = _build_double_array(keys)
    return struct.pack(f"<I{len(array)}I", 4 * len(array), *array) + bytes(blob)


def xlmr_unigram_tokenizer(
    pieces: list[tuple[str, float]],
    norm_table: dict[int, tuple[int, ...]],
    *,
    bos: int,
    eos: int,
    pad: int,
    unk: int,
    mask: int | None,
) -> Tokenizer:
    """The XLM-R pipeline over a Unigram vocabulary `pieces` [(piece, log-prob score)], ids = list positions.

    Unknown characters score min(score) - 10 (as SentencePiece); `tokenizers` fuses a run of unknown characters
    into one `<unk>`, as SentencePiece does.
    """
    tok = Tokenizer(models.Unigram(pieces, unk_id=unk, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([
        normalizers.Precompiled(charsmap_from_table(norm_table)),
        normalizers.Replace(Regex(" {2,}"), " "),
    ])
    # Splitting at "▁" before the Viterbi pass changes nothing when no piece holds "▁" past its first character
    # (true of XLM-R's vocabulary); a vocabulary with such pieces keeps the text whole, as SentencePiece does.
    split = not any(METASPACE in p[1:] for p, _ in pieces)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=split)
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=split)
    s, e = pieces[bos][0], pieces[eos][0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{s} $A {e}", pair=f"{s} $A {e} {e} $B {e}", special_tokens=[(s, bos), (e, eos)],
    )
    specials = [AddedToken(pieces[i][0], special=True, normalized=False) for i in (bos, pad, eos, unk)]
    if mask is not None:  # XLM-R's <mask> swallows the space before it
        specials.append(AddedToken(pieces[mask][0], special=True, normalized=False, lstrip=True))
    tok.add_special_tokens(specials)
    return tok
