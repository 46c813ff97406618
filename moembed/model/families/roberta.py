"""RoBERTa and XLM-RoBERTa checkpoints (`model_type: roberta`, `xlm-roberta`; e.g. multilingual-e5, Arctic-Embed
2.0, the XLM-R base of nomic-embed-v2 §4.1): the BERT layer layout under a `roberta.` prefix.

What differs from BERT is the numbering of positions: transformers' RoBERTa embeddings give a real token at index t
the position row padding_idx + 1 + t (rows 0..padding_idx are only ever read by padding), so a table of
`max_position_embeddings` rows (514 for XLM-R) holds max_position_embeddings - padding_idx - 1 usable positions
(512). moembed keeps those usable rows, counted from 0 as in its encoder, and writes the skipped rows back as
zeros on export. RoBERTa configs usually have one token type and a layer-norm epsilon of 1e-5; both are read from
config.json.
"""

from __future__ import annotations

from moembed.model.families.bert import BertConverter


class RobertaConverter(BertConverter):
    prefix = r"^(roberta|model)\."
    default_pad = 1  # RobertaConfig / XLMRobertaConfig default pad_token_id

    def __init__(self, model_type: str, architecture: str, tokenizer_class: str):
        self.model_type, self.architecture, self.tokenizer_class = model_type, architecture, tokenizer_class

    def position_offset(self, pad_token_id: int) -> int:
        return pad_token_id + 1


ROBERTA = RobertaConverter("roberta", "RobertaModel", "RobertaTokenizer")
XLM_ROBERTA = RobertaConverter("xlm-roberta", "XLMRobertaModel", "XLMRobertaTokenizer")
