"""Hugging Face MoE causal language models as sources of HS and RW embeddings (MoEE §3.1).

Supported families (by `model_type` in config.json), with where their routers sit:
- olmoe, mixtral: every layer is MoE.
- qwen2_moe (Qwen1.5-MoE-A2.7B), qwen3_moe: layer i is MoE unless i is in `mlp_only_layers`, when
  (i + 1) % `decoder_sparse_step` == 0.
- deepseek_v2, deepseek_v3: layers i >= `first_k_dense_replace` are MoE. (The original DeepSeekMoE-16B needs
  remote code, which is never run; its checkpoints load only once converted to one of these classes.)

Router logits are captured through the model's own `output_router_logits=True` outputs (the pre-softmax
`F.linear` outputs of each MoE layer's router, flattened to (B*T, E)); when a model returns none, forward hooks
on the `mlp.gate` modules of the MoE layers take them instead. DeepSeek-V3 scores experts with a sigmoid; RW
still uses the paper's softmax over all experts of the same logits.

Batches are left-padded with explicit position ids (0 at each sequence's first real token), so a text's
positions, and therefore its embedding, do not depend on how much padding its batch needs.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from moembed.errors import MoembedError
from moembed.model.inference import run_batches
from moembed.model.protocol import short_hash, weights_key
from moembed.moee.extract import ExtractConfig, Features, hidden_state, routing_weights
from moembed.moee.prompts import apply_prompt, resolve_prompt
from moembed.progress import bar

FAMILIES = ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def moe_layer_indices(config) -> list[int]:
    """0-based indices of the decoder layers whose MLP is a routed MoE block, as the modeling files decide."""
    n, kind = config.num_hidden_layers, config.model_type
    if kind in ("olmoe", "mixtral"):
        return list(range(n))
    if kind in ("qwen2_moe", "qwen3_moe"):
        skip, step = set(config.mlp_only_layers or []), config.decoder_sparse_step
        return [i for i in range(n) if i not in skip and config.num_experts > 0 and (i + 1) % step == 0]
    if kind in ("deepseek_v2", "deepseek_v3"):
        return list(range(config.first_k_dense_replace, n))
    raise MoembedError(f"config.json: model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}")


def num_experts(config) -> int:
    """Routed experts per MoE layer (shared experts have no router weight and are not part of RW)."""
    key = {"mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts"}
    return int(getattr(config, key.get(config.model_type, "num_experts")))


class HFMoESource:
    """HS and RW features of a Hugging Face MoE causal LM.

    `features(texts, prompt)` → `Features(hs (n, d), rw (n, L_moe * E))`, float32, in input order.
    prompt: a Table 2 name or a template with `*sent*` (None → `default_prompt`).
    """

    def __init__(self, lm, tokenizer, name: str, extract: ExtractConfig | None = None,
                 default_prompt: str | None = None, max_length: int = 512, capture: str = "outputs"):
        if capture not in ("outputs", "hooks"):
            raise MoembedError(f"capture: unknown {capture!r}; choose outputs or hooks")
        self.lm = lm.eval()
        self.decoder = lm.model  # the transformer without the LM head: its logits are not needed
        self.tokenizer = tokenizer
        self.name = name
        self.extract = extract or ExtractConfig()
        self.default_prompt = resolve_prompt(default_prompt)
        self.max_length = max_length
        self.capture = capture
        self.moe_layers = moe_layer_indices(lm.config)
        self.prompts: dict[str, str] = {}
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    @property
    def hs_dim(self) -> int:
        return int(self.lm.config.hidden_size)

    @property
    def rw_dim(self) -> int:
        return len(self.moe_layers) * num_experts(self.lm.config)

    def settings(self) -> dict:
        """Everything besides the weights that changes the features."""
        return {"extract": self.extract.model_dump(), "prompt": self.default_prompt, "max_length": self.max_length,
                "dtype": str(next(self.lm.parameters()).dtype)}

    def settings_key(self) -> str:
        """The language model's weights and this source's settings."""
        return short_hash(json.dumps([weights_key(self.lm), self.settings()], sort_keys=True))

    # ---- tokens -----------------------------------------------------------------------------------------------

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text; a text longer than max_length keeps its LAST max_length tokens, because the
        embedding is read at the end, where the prompt asks for its one word."""
        ids = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        return [x[-self.max_length:] for x in ids]

    def left_pad(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids and bool mask, padding on the left so every last real token is at position -1."""
        T = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), T, dtype=torch.bool)
        for b, x in enumerate(ids):
            if x:
                input_ids[b, T - len(x):] = torch.tensor(x)
                mask[b, T - len(x):] = True
        return input_ids, mask

    # ---- forward ----------------------------------------------------------------------------------------------

    @contextmanager
    def _hooks(self, sink: list):
        """Forward hooks on the routers of the MoE layers, appending their logits to `sink` in layer order."""
        def grab(_module, _inputs, output):
            sink.append(output[0] if isinstance(output, tuple) else output)

        handles = [self.decoder.layers[i].mlp.gate.register_forward_hook(grab) for i in self.moe_layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _run(self, input_ids: torch.Tensor, mask: torch.Tensor, own_outputs: bool):
        """The decoder's forward on a left-padded batch, positions counted from each first real token."""
        device = next(self.decoder.parameters()).device
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T) 0 at the first real token
        return self.decoder(input_ids=input_ids.to(device), attention_mask=mask.long().to(device),
                            position_ids=positions.to(device), use_cache=False,
                            output_hidden_states=self.extract.hs_layers == "all", output_router_logits=own_outputs)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> Features:
        """One left-padded batch (B, T) → Features (B, ·)."""
        B, T = input_ids.shape
        hooked: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        if self.capture == "outputs":
            out = self._run(input_ids, mask, own_outputs=True)
            logits = list(getattr(out, "router_logits", None) or ())
        if self.capture == "hooks" or not logits:  # hooks asked for, or the model returns no router logits
            with self._hooks(hooked):
                out = self._run(input_ids, mask, own_outputs=False)
            logits = hooked
        if len(logits) != len(self.moe_layers):
            raise MoembedError(f"{self.name}: got router logits of {len(logits)} layers, expected {len(self.moe_layers)}")
        logits = [z.reshape(B, T, -1).cpu() for z in logits]  # (B*T, E) → (B, T, E)
        # all layers only when asked: otherwise the final-norm output alone, to keep memory low
        hidden = tuple(h.cpu() for h in out.hidden_states) if self.extract.hs_layers == "all" else (out.last_hidden_state.cpu(),)
        hs = hidden_state(hidden, mask, self.extract.hs_pooling, self.extract.hs_layers)
        rw = routing_weights(logits, mask, self.extract.rw_pooling)
        return Features(hs.float(), rw.float())

    def features(self, texts: list[str], prompt: str | None = None, batch_size: int = 32,
                 show_progress: bool = False) -> Features:
        """HS and RW of `texts` (n, ·), in input order. Batches group texts of similar length only to save
        padding; the result for a text does not depend on its batch."""
        if batch_size < 1:
            raise MoembedError(f"batch_size: must be >= 1, got {batch_size}")
        template = self.default_prompt if prompt is None else resolve_prompt(prompt)
        ids = self.token_ids([apply_prompt(template, t) for t in texts])
        empty = next((i for i, x in enumerate(ids) if not x), None)
        if empty is not None:
            raise MoembedError(f"texts[{empty}]: no tokens to embed (empty text and no prompt or special tokens)")

        def forward_ids(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            f = self.forward(*self.left_pad(batch))
            return f.hs, f.rw

        with bar("moee", enabled=show_progress) as progress:
            hs, rw = run_batches(ids, batch_size, forward_ids, (self.hs_dim, self.rw_dim), progress)
        return Features(hs, rw)


def is_hf_moe_dir(path: str | Path) -> bool:
    """True when `path/config.json` names a supported MoE causal-LM family."""
    import json

    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") in FAMILIES
    except (ValueError, OSError):
        return False


def load_hf_moe(path: str | Path, dtype: str = "bfloat16", load_in_8bit: bool = False, max_length: int = 512,
                extract: ExtractConfig | None = None, prompt: str | None = None,
                capture: str = "outputs") -> HFMoESource:
    """Load a Hugging Face MoE causal LM from a local directory (never from a hub).

    dtype: "bfloat16" (default, CPU-friendly) or "float32"; load_in_8bit: bitsandbytes 8-bit weights, only when
    bitsandbytes is installed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise MoembedError(f"{path}: no config.json (expected a Hugging Face model directory)")
    if dtype not in DTYPES:
        raise MoembedError(f"dtype: unknown {dtype!r}; choose one of {', '.join(DTYPES)}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    moe_layer_indices(config)  # unsupported families fail here, naming the model_type
    kwargs = {"dtype": DTYPES[dtype], "local_files_only": True}
    if load_in_8bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise MoembedError("load_in_8bit: bitsandbytes is not installed") from None
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    lm = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return HFMoESource(lm, tok, name=path.name, extract=extract, default_prompt=prompt,
                       max_length=max_length, capture=capture)
