"""Prompt templates for MoE language-model embeddings (MoEE paper, Table 2; PromptEOL, Jiang et al. 2023).

A template is a string containing the placeholder `*sent*`, which is replaced by the input text. The embedding
is then read at the template's last token, so a template that ends by asking for "one word" pushes the
model's next-token state (HS) and routing (RW) towards a summary of the sentence.

    >>> apply_prompt(resolve_prompt("prompteol"), "A cat sat.")
    'This sentence: "A cat sat." means in one word: "'
"""

from __future__ import annotations

from moembed.errors import MoembedError

PLACEHOLDER = "*sent*"

# Table 2 of the MoEE paper. Prompt 1 is PromptEOL, written with the quotes of its original paper; the other
# eight are the paper's texts as printed. "none" embeds the text as it is.
PROMPTS: dict[str, str] = {
    "none": PLACEHOLDER,
    "prompteol": 'This sentence: "*sent*" means in one word: "',
    "style": "In one word, describe the style of the following sentence - *sent*:",
    "sentiment": "In one word, describe the sentiment of the following sentence (positive, neutral, or negative) - *sent*:",
    "tone": "In one word, describe the tone of the following sentence - *sent* (e.g., formal, informal, humorous, serious):",
    "intent": "In one word, describe the intent behind the following sentence (e.g., request, suggestion, command) - *sent*:",
    "complexity": "In one word, rate the complexity of the following sentence (simple, moderate, complex) - *sent*:",
    "subjectivity": "In one word, describe whether the following sentence is subjective or objective - *sent*:",
    "language_style": "In one word, describe the language style of the following sentence (e.g., academic, conversational, literary) - *sent*:",
    "grammar": "In one word, describe the grammatical structure of the following sentence (simple, compound, complex) - *sent*:",
}


def resolve_prompt(prompt: str | None) -> str:
    """A template from a Table 2 name, or `prompt` itself when it is a template containing `*sent*`.

    None means "none" (the bare text). Anything else raises MoembedError listing the names.
    """
    if prompt is None:
        return PROMPTS["none"]
    if prompt in PROMPTS:
        return PROMPTS[prompt]
    if PLACEHOLDER in prompt:
        return prompt
    raise MoembedError(
        f"prompt: {prompt!r} is neither a known name ({', '.join(PROMPTS)}) nor a template containing {PLACEHOLDER}"
    )


def apply_prompt(template: str, text: str) -> str:
    """Insert `text` into `template` at every `*sent*`."""
    return template.replace(PLACEHOLDER, text)
