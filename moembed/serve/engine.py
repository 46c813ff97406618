"""Everything the server asks of a model, behind one small interface.

The server never touches the Embedder directly: it tokenizes through `Engine.tokenize`, runs forward passes
through `Engine.embed` (on the batcher's worker thread only), and shapes outputs through `Engine.postprocess`.
`EmbedderEngine` implements the interface on `moembed.Embedder`; tests substitute slow or gated engines.

    >>> eng = EmbedderEngine.load("path/to/model", device="auto")
    >>> ids, truncated = eng.tokenize(["what is a sparse MoE?"], input_type="query")
    >>> eng.postprocess(eng.embed(ids), dim=256, precision="float32")   # (1, 256) float32, unit norm
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

import numpy as np
import torch

from moembed.devices import INT8, resolve_device
from moembed.errors import MoembedError
from moembed.model.fast.int8 import int8_kernel
from moembed.model.prompts import prompt_lengths

# API input_type → the model's prompt name (nomic-embed-v1 §4 task prefixes). A model without that prompt
# gets no prefix: its texts are embedded as given.
INPUT_TYPES = {"query": "search_query", "document": "search_document"}
# API precisions: the Embedder's names ("ubinary": sign bits packed into unsigned bytes, as sentence-transformers
# names it).
PRECISIONS = ("float32", "int8", "ubinary")


class TooLong(MoembedError):
    """A text exceeds the model's maximum length and truncation is off."""

    def __init__(self, index: int, tokens: int, max_length: int):
        super().__init__(f"input[{index}]: {tokens} tokens exceed the model's maximum of {max_length}")
        self.index, self.tokens, self.max_length = index, tokens, max_length


class Engine(Protocol):
    """The model side of the server.

    name: the model id clients send; dim: full embedding width; max_length: tokens per text (with specials);
    device_type: "cpu", "cuda" or "mps"; compute: the precision forward passes run in, as the start-up log says it
    ("float32", "bfloat16", "int8 (onednn kernel)"); int8_ready: whether int8 output has calibration ranges.
    """

    name: str
    dim: int
    max_length: int
    device_type: str
    compute: str
    int8_ready: bool

    def tokenize(self, texts: list[str], input_type: str | None = None, truncate: bool = True) -> tuple[list[list[int]], int]:
        """Token ids per text (prefix and special tokens included) and how many texts were truncated.
        With truncate=False a text over max_length raises TooLong. Thread-safe; no torch."""

    def embed(self, ids: list[list[int]]) -> torch.Tensor:
        """Pooled embeddings (B, d) float32 on the CPU of one batch of token-id lists; each row as it would be
        alone. Called on the batcher's worker thread only."""

    def postprocess(self, emb: torch.Tensor, dim: int | None, precision: str) -> np.ndarray:
        """(n, d) from `embed` → truncated to `dim`, normalised as the model does, in the API `precision`."""


class EmbedderEngine:
    """`Engine` over a loaded `moembed.Embedder`. All Embedder calls the server makes are in this class."""

    def __init__(self, emb, device: torch.device, bf16: bool, name: str | None = None):
        from tokenizers import Tokenizer

        self.emb = emb.to(device).eval()
        self.device = device
        self.device_type = device.type
        self.bf16 = bf16
        # "bfloat16" (autocast), "int8" (dynamic int8 matmuls, with the CPU's int8 kernel) or "float32"
        self.compute = "bfloat16" if bf16 else emb.compute
        if self.compute == INT8:
            self.compute += f" ({int8_kernel()} kernel)"
        self.name = name or emb.name
        self.dim = emb.dim
        self.max_length = emb.max_length
        # A copy of the tokenizer that does not truncate, to refuse long texts when truncation is off.
        self._untruncated = Tokenizer.from_str(emb.tokenizer.tokenizer.to_str())
        self._untruncated.no_truncation()
        self._untruncated.no_padding()

    @classmethod
    def load(cls, path: str, device: str = "auto", dtype: str = "auto", name: str | None = None,
             pooling: str | None = None, backend: str = "auto") -> "EmbedderEngine":
        from moembed.model.embedder import Embedder

        dev = resolve_device(device)
        bf16 = dev.type != "cpu" if dtype == "auto" else dtype == "bf16"
        # int8: refused off the CPU before the weights are read (`resolve_dtype`)
        emb = Embedder.load(path, device=str(dev), dtype=INT8 if dtype == INT8 else "float32", pooling=pooling,
                            backend=backend)
        return cls(emb, dev, bf16, name)

    @property
    def int8_ready(self) -> bool:
        return self.emb.calibration is not None

    def prefix(self, input_type: str | None) -> str:
        prompt = INPUT_TYPES.get(input_type) if input_type else None
        return self.emb.prefix(prompt if prompt in self.emb.prompts else None)  # None: the default prompt, if any

    def tokenize(self, texts: list[str], input_type: str | None = None, truncate: bool = True) -> tuple[list[list[int]], int]:
        """Each id list carries its prompt's length when the model leaves prompts out of pooling (`embed`)."""
        prefix = self.prefix(input_type)
        if truncate:
            return self.emb.token_ids(texts, prefix)
        ids = [e.ids for e in self._untruncated.encode_batch([prefix + t for t in texts])]
        for i, x in enumerate(ids):
            if len(x) > self.max_length:
                raise TooLong(i, len(x), self.max_length)
        return self.emb.mark_prompt(ids, prefix), 0

    def embed(self, ids: list[list[int]]) -> torch.Tensor:
        input_ids, mask = self.emb.tokenizer.pad(ids)  # (B, T) each
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()
        with torch.inference_mode(), amp:
            # a batch may mix texts of several requests and prompts: each is pooled after its own prompt
            out = self.emb(input_ids.to(self.device), mask.to(self.device), prompt_lengths=prompt_lengths(ids))
            out = out.embeddings  # (B, d)
        return out.float().cpu()

    def postprocess(self, emb: torch.Tensor, dim: int | None, precision: str) -> np.ndarray:
        if precision not in PRECISIONS:
            raise MoembedError(f"precision: unknown {precision!r}; choose one of {', '.join(PRECISIONS)}")
        return self.emb.postprocess(emb, dim, precision)
