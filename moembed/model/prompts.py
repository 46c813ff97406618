"""Prompts: the prefixes put before a text, and the prompt tokens pooling leaves out.

A model's prompts are named prefix strings (nomic-embed-v1 §4's task prefixes for models moembed trains; those of
`config_sentence_transformers.json` for a sentence-transformers directory). `encode(prompt_name=...)` prepends one;
with none, the model's default prompt, if it has one.

Leaving the prompt out of pooling (`include_prompt: false` in sentence-transformers' Pooling config, as INSTRUCTOR
models are trained): the text is still encoded after its prompt, so every token attends to it, but the first
`prompt_length` positions of the sequence are not pooled. The count is sentence-transformers': the tokens of the
prompt tokenized alone, special tokens included, less its last token when that is a special one (the trailing
[SEP] / </s>), so the leading [CLS] / <s> is left out with the prompt. Each text's id list carries its count
(`PromptIds`), so that a batch mixing prompts (the server's queries and documents) pools each text as it would be
pooled alone.
"""

from __future__ import annotations

from moembed.errors import MoembedError

# Task prefixes of nomic-embed-v1 §4 (also used by Nomic v2): the default for models moembed trains.
NOMIC_PROMPTS = {
    "search_query": "search_query: ",
    "search_document": "search_document: ",
    "classification": "classification: ",
    "clustering": "clustering: ",
}
# The prompt `encode_query` / `encode_document` use when none is given: the first of these names the model has.
ROLE_PROMPTS = {"query": ("query", "search_query"), "document": ("document", "passage", "corpus", "search_document")}


class PromptIds(list):
    """One text's token ids whose first `prompt_length` positions belong to its prompt and are not pooled."""

    __slots__ = ("prompt_length",)

    def __init__(self, ids, prompt_length: int):
        super().__init__(ids)
        self.prompt_length = prompt_length

    def __reduce__(self):  # a copy sent to another process keeps the count
        return PromptIds, (list(self), self.prompt_length)


def prompt_lengths(ids: list[list[int]]) -> list[int] | None:
    """The prompt length of each id list (0 for plain lists), or None when no list has one."""
    out = [getattr(x, "prompt_length", 0) for x in ids]
    return out if any(out) else None


def prefix_of(prompts: dict[str, str], default_prompt_name: str | None, name: str | None) -> str:
    """The text prefix for a prompt name (None → the default prompt's, if any); unknown names raise."""
    if name is None:
        return prompts.get(default_prompt_name, "") if default_prompt_name is not None else ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise MoembedError(f"prompt_name: unknown name {name!r}; this model knows: {known}")
    return prompts[name]


def prompt_text(prompts: dict[str, str], default_prompt_name: str | None, prompt_name: str | None = None,
                prompt: str | None = None) -> str:
    """The prefix for `encode`'s prompt arguments: the literal `prompt`, or the text of `prompt_name`.

    Giving both raises (sentence-transformers silently prefers `prompt`; moembed refuses the ambiguity)."""
    if prompt is not None and prompt_name is not None:
        raise MoembedError(f"prompt and prompt_name: give one, not both (got {prompt!r} and {prompt_name!r})")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise MoembedError(f"prompt: expected a string, got {type(prompt).__name__}")
        return prompt
    return prefix_of(prompts, default_prompt_name, prompt_name)


def role_prompt(prompts: dict[str, str], role: str) -> str | None:
    """The prompt name a model gives a "query" or a "document" (`ROLE_PROMPTS`), None when it has none."""
    return next((p for p in ROLE_PROMPTS[role] if p in prompts), None)


def role_args(prompts: dict[str, str], role: str, prompt_name: str | None, prompt: str | None):
    """(prompt_name, prompt) of `encode_query` / `encode_document`: the role's prompt unless one is given."""
    return (role_prompt(prompts, role) if prompt_name is None and prompt is None else prompt_name), prompt


def prompt_token_count(tokenizer, prefix: str) -> int:
    """How many leading positions of `prefix + text` the prompt takes, as sentence-transformers counts them
    (module docstring); 0 for no prefix. tokenizer: a `moembed.model.tokenizer.TextTokenizer`."""
    if not prefix:
        return 0
    tok = tokenizer.tokenizer  # the `tokenizers.Tokenizer`, truncating to max_length as for a text
    ids = tok.encode(prefix).ids
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    n = len(ids) - 1 if ids and ids[-1] in special else len(ids)
    if n >= tokenizer.max_length:
        raise MoembedError(f"prompt {prefix!r}: its {n} tokens fill the model's maximum length of "
                           f"{tokenizer.max_length}, leaving no token of the text to pool (include_prompt is false)")
    return n


def mark_prompt(ids: list[list[int]], prompt_length: int) -> list[list[int]]:
    """`ids` with each list marked as starting with `prompt_length` prompt positions (unchanged for 0)."""
    return [PromptIds(x, prompt_length) for x in ids] if prompt_length else ids
