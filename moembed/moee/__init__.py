"""MoEE: training-free embeddings from the routers of Mixture-of-Experts models (Li & Zhou, 2024).

Routing weights (RW, every MoE layer's distribution over experts, concatenated) complement the hidden state (HS);
MoEE combines them by concatenation or by a weighted sum of similarities. Sources: Hugging Face MoE causal LMs
(`hf.py`) and moembed's own MoE encoders (`encoder.py`).
"""

from moembed.moee.combine import MoEEModel, SumModel, load_moee, load_source
from moembed.moee.extract import ExtractConfig, Features
from moembed.moee.prompts import PROMPTS, apply_prompt, resolve_prompt

__all__ = [
           "PROMPTS",
           "ExtractConfig",
           "Features",
           "MoEEModel",
           "SumModel",
           "apply_prompt",
           "load_moee",
           "load_source",
           "resolve_prompt",
]
