"""A sentence-transformers input module that runs a moembed encoder (any family, dense or MoE).

`export_sentence_transformers` writes models that sentence-transformers' own Transformer module cannot hold
(MoE layers, rotary positions, SwiGLU) as a directory whose first module is `MoembedEncoder`, followed by the
standard Pooling and Normalize modules. The moembed files (config.json, model.safetensors, tokenizer.json) sit
in the directory root, so the same directory also loads with `Embedder.load`.

sentence-transformers imports a module class named in modules.json by its dotted path; classes outside its
own namespace need `trust_remote_code=True` (or pass the class through `module_classes`):

    >>> from sentence_transformers import SentenceTransformer
    >>> st = SentenceTransformer("out/st-model", trust_remote_code=True)   # moembed must be installed
    >>> st.encode(["a sparse MoE embedding"])
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from sentence_transformers.base.modules.input_module import InputModule

from moembed.model.embedder import Embedder
from moembed.model.io import write_parts
from moembed.model.prompts import prompt_token_count


class MoembedEncoder(InputModule):
    """Wraps an `Embedder`'s tokenizer and encoder. forward returns `token_embeddings` (B, T, d), zeros at
    padding, and the `attention_mask` (B, T) for the Pooling module that follows."""

    save_in_root = True

    def __init__(self, embedder: Embedder):
        super().__init__()
        self.embedder = embedder
        self.tokenizer = embedder.tokenizer.tokenizer  # the `tokenizers.Tokenizer` (sentence-transformers reads it)

    @property
    def max_seq_length(self) -> int:
        return self.embedder.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.embedder.tokenizer.set_max_length(value)

    def get_embedding_dimension(self) -> int:
        return self.embedder.dim

    def preprocess(self, inputs: Sequence[str], prompt: str | None = None, **kwargs) -> dict[str, Any]:
        ids, _ = self.embedder.token_ids(list(inputs), prompt or "")
        input_ids, mask = self.embedder.tokenizer.pad(ids)
        out = {"input_ids": input_ids, "attention_mask": mask.long()}
        if prompt and not self.embedder.include_prompt:  # what sentence-transformers' Pooling then leaves out
            out["prompt_length"] = prompt_token_count(self.embedder.tokenizer, prompt)
        return out

    def forward(self, features: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        out = self.embedder.encoder(features["input_ids"], features["attention_mask"].bool(), features.get("token_type_ids"))
        features["token_embeddings"] = out.last_hidden_state  # (B, T, d)
        return features

    def get_config_dict(self) -> dict[str, Any]:
        return {}

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        write_parts(self.embedder.parts(), Path(output_path))

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token=None, cache_folder=None, revision=None,
             local_files_only: bool = False, **kwargs) -> MoembedEncoder:
        path = cls.load_dir_path(model_name_or_path, subfolder=subfolder, token=token, cache_folder=cache_folder,
                                 revision=revision, local_files_only=local_files_only)
        return cls(Embedder.load(path))
