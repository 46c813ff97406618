"""The bidirectional transformer encoder (BERT-style and Nomic-style, see `config.py`).

Padding is removed once at the embedding layer: every linear layer, MLP and MoE block works on the packed
(N, d) tensor of real tokens only (N = number of non-padding tokens), and only attention sees the padded
(B, T) layout. This saves the compute spent on padding and means padding tokens are never routed to experts.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from moembed.model.config import EncoderConfig
from moembed.model.activations import swiglu
from moembed.model.attention import Attention
from moembed.model.linear import Linear
from moembed.model.recompute import then_recomputed
from moembed.model.settings import Settings, UsesSettings, apply
from moembed.model.rope import batch_cos_sin, rope_cos_sin


@dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor  # (B, T, d), zeros at padding
    attention_mask: torch.Tensor  # (B, T) bool
    token_index: torch.Tensor  # (N,) flat positions b*T + t of the real tokens
    packed_hidden: torch.Tensor  # (N, d) last hidden state of the real tokens
    router_logits: tuple[torch.Tensor, ...] = ()  # one (N, E) per MoE layer, real tokens only
    expert_counts: tuple[torch.Tensor, ...] = ()  # one (E,) per MoE layer
    hidden_states: tuple[torch.Tensor, ...] = field(default_factory=tuple)  # (N, d) per layer when asked

    @property
    def batch_index(self) -> torch.Tensor:
        """(N,) the sequence each packed token belongs to."""
        return torch.div(self.token_index, self.attention_mask.shape[1], rounding_mode="floor")


class GeluMLP(nn.Module):
    """BERT's MLP: d → i → d with exact GELU."""

    recompute_act = False  # keep fc1's output, not GELU's, for backward (moembed.model.recompute)

    def __init__(self, d: int, i: int, bias: bool = True):
        super().__init__()
        self.fc1 = Linear(d, i, bias=bias)
        self.fc2 = Linear(i, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # inference: GELU fused into fc1's matmul where it runs packed
            return self.fc2(self.fc1(x, gelu=True))
        return then_recomputed(F.gelu, self.fc1(x), self.fc2, self.recompute_act)


class SwiGLUMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020), as nomic-bert: fc2(up(x) * silu(gate(x))); up and gate in one matmul."""

    recompute_act = False  # keep fc1's output, not the product, for backward (moembed.model.recompute)

    def __init__(self, d: int, i: int, bias: bool = False):
        super().__init__()
        self.fc1 = Linear(d, 2 * i, bias=bias)  # rows [:i] = up, rows [i:] = gate
        self.fc2 = Linear(i, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return then_recomputed(swiglu, self.fc1(x), self.fc2, self.recompute_act)


def build_mlp(config: EncoderConfig, layer_idx: int) -> nn.Module:
    """The MLP of one layer: dense, or a sparse MoE block on the layers `config.moe` selects."""
    if layer_idx in config.moe_layers():
        from moembed.model.moe import MoEBlock

        return MoEBlock(config)
    cls = GeluMLP if config.mlp == "gelu" else SwiGLUMLP
    return cls(config.hidden_size, config.intermediate_size, config.bias)


class Embeddings(nn.Module):
    """Token (+ absolute position) (+ token type) embeddings, LayerNorm, dropout — on the packed real tokens."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        d = config.hidden_size
        if config.move is not None:  # MoVE §3.1: V_l embeddings built from V_s pieces by experts
            from moembed.model.move import MoVEEmbedding

            self.word = MoVEEmbedding(config)
        else:
            self.word = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_position, d) if config.position == "absolute" else None
        self.token_type = nn.Embedding(config.type_vocab_size, d) if config.type_vocab_size else None
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        x = self.word(ids)  # (N, d)
        if self.position is not None:
            x = x + self.position(positions)
        if self.token_type is not None:
            x = x + self.token_type(types if types is not None else torch.zeros_like(ids))
        return self.dropout(self.norm(x))


class EncoderLayer(nn.Module):
    """Post-LayerNorm transformer layer: x = LN(x + Attn(x)); x = LN(x + MLP(x)).

    Attention is `out(core(qkv(x)))`: the fused q, k, v projection, the parameterless `core` (`Attention`, or the
    module a backend swapped in: `moembed.model.fast.attention`) and the output projection."""

    def __init__(self, config: EncoderConfig, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.qkv = Linear(d, 3 * d, bias=config.bias)  # fused q, k, v
        self.core = Attention(config.num_heads, config.head_dim, config.attention_dropout)
        self.out = Linear(d, d, bias=config.bias)
        self.norm1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.mlp = build_mlp(config, layer_idx)
        self.norm2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    @property
    def num_heads(self) -> int:
        return self.core.num_heads

    @property
    def head_dim(self) -> int:
        return self.core.head_dim

    @property
    def attention_dropout(self) -> float:
        """The attention weights' dropout probability in training (the core's; settable, as finetuning does)."""
        return self.core.dropout

    @attention_dropout.setter
    def attention_dropout(self, p: float) -> None:
        self.core.dropout = p

    def attention(self, x: torch.Tensor, ctx: "_Context") -> torch.Tensor:
        return self.out(self.core(self.qkv(x), ctx))  # (N, d) → (N, 3d) → (N, d), real tokens only

    def forward(self, x: torch.Tensor, ctx: "_Context"):
        x = self.norm1(x + self.dropout(self.attention(x, ctx)))
        m = self.mlp(x)
        router = None
        if isinstance(m, tuple):  # an MoE block: (hidden, router_logits, expert_counts)
            m, router = m[0], (m[1], m[2])
        return self.norm2(x + self.dropout(m)), router


class _Context:
    """Per-forward layout shared by all layers: packing indices, attention mask and rotary tables."""

    def __init__(self, mask: torch.Tensor, cos=None, sin=None):
        self.shape = tuple(mask.shape)
        self.full = bool(mask.all())
        self.index = mask.flatten().nonzero().squeeze(1)  # (N,)
        # (B*T,): each position's packed row; a padding position, the last real row before it (row 0 if none)
        self.gather = None if self.full else (mask.flatten().cumsum(0) - 1).clamp_min(0)
        # SDPA boolean mask, True = attend; None when nothing is padded (lets SDPA take its fastest path).
        self.attn_mask = None if self.full else mask[:, None, None, :]  # (B, 1, 1, T)
        self.cos, self.sin = cos, sin
        self.mask = mask

    @functools.cached_property
    def lengths(self) -> torch.Tensor | None:
        """(B,) real tokens per sequence where each sequence's real tokens come first (right padding, as the
        tokenizers pad), else None."""
        lengths = self.mask.sum(1)  # (B,)
        if self.full or torch.equal(self.mask, torch.arange(self.shape[1], device=self.mask.device) < lengths[:, None]):
            return lengths
        return None

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """(B,) each sequence's first packed row, where `lengths` is given (the packed rows are then sequence after
        sequence)."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(N, c) packed → (B, T, c) with zeros at padding."""
        B, T = self.shape
        if self.full:
            return x.view(B, T, -1)
        out = x.new_zeros(B * T, x.shape[-1])
        out.index_copy_(0, self.index, x)
        return out.view(B, T, -1)

    def pad_keys(self, x: torch.Tensor) -> torch.Tensor:
        """(N, c) packed → (B, T, c) for attention, each padding position holding a copy of a real row instead of
        zero. The mask gives padded keys a weight of exactly 0 (a finite value times 0 adds nothing) and `unpad`
        drops padded queries, so outputs and gradients are those of zero padding, bit for bit; one gather replaces
        zero-filling the whole buffer and scattering into it. With no real row at all (N = 0), zeros."""
        B, T = self.shape
        if self.full:
            return x.view(B, T, -1)
        if x.shape[0] == 0:
            return self.pad(x)
        return x.index_select(0, self.gather).view(B, T, -1)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, c) → (N, c), real tokens only."""
        x = x.reshape(-1, x.shape[-1])
        return x if self.full else x.index_select(0, self.index)


class _NoRandomInit(TorchFunctionMode):
    """Random initialisers as no-ops while modules are built (`Encoder.for_weights`). A torch function mode holds
    for the current thread only, so a model built in another thread at the same time is initialised as usual."""

    SKIPPED = {nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.trunc_normal_,
               nn.init.xavier_uniform_, torch.Tensor.normal_, torch.Tensor.uniform_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]  # the tensor, as the initialisers return it
        return func(*args, **(kwargs or {}))


class Encoder(UsesSettings, nn.Module):
    """Bidirectional transformer encoder. forward(input_ids (B, T), attention_mask (B, T)) → EncoderOutput.

    Built with the user's `Settings` (MOEMBED_NO_FASTPATH, read here once); `settings.apply(encoder, s)` or
    `Embedder.load(..., backend=)` chooses others."""

    def __init__(self, config: EncoderConfig, settings: Settings | None = None):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config, i) for i in range(config.num_layers))
        self.apply(self._init_weights)
        apply(self, settings or Settings.from_env())

    @classmethod
    def for_weights(cls, config: EncoderConfig) -> Encoder:
        """An encoder whose every weight a checkpoint is about to overwrite: built without drawing random initial
        values (its tensors hold whatever memory they get until loaded): drawing them costs time for nothing, and
        on the meta device (the shape check of `moembed.model.io`) torch's Python `normal_` imports torch._dynamo."""
        with _NoRandomInit():
            return cls(config)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def batch_rotary_tables(self, mask: torch.Tensor, dtype):
        """cos, sin for a padded batch (mask (B, T)): (T, D) shared, or (B, 1, T, D) when Dynamic NTK gives some
        sequence its own base. Each sequence's base comes from its own real length (`rope.batch_cos_sin`), so a text
        is encoded the same whatever it is batched with. Training never rescales (the trained positions)."""
        c = self.config
        T = mask.shape[1]
        if not c.dynamic_ntk or self.training or T <= c.max_position:
            return rope_cos_sin(T, c.head_dim, c.rope_base, device=mask.device, dtype=dtype)
        lengths = mask.sum(1)  # (B,) real tokens per sequence
        return batch_cos_sin(lengths, T, c.head_dim, c.rope_base, c.max_position, c.ntk_alpha, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        mask = attention_mask.bool()
        if self.config.position == "absolute" and T > self.config.max_position:
            raise ValueError(f"sequence length {T} exceeds max_position {self.config.max_position}")
        cos = sin = None
        if self.config.position == "rotary":
            cos, sin = self.batch_rotary_tables(mask, torch.float32)
        ctx = _Context(mask, cos, sin)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        flat = lambda t: t.flatten() if ctx.full else t.flatten().index_select(0, ctx.index)  # noqa: E731
        types = flat(token_type_ids) if token_type_ids is not None else None
        x = self.embeddings(flat(input_ids), flat(positions), types)  # (N, d)
        logits, counts, states = [], [], []
        for layer in self.layers:
            x, router = layer(x, ctx)
            if router is not None:
                logits.append(router[0])
                counts.append(router[1])
            if output_hidden_states:
                states.append(x)
        return EncoderOutput(
            last_hidden_state=ctx.pad(x), attention_mask=mask, token_index=ctx.index, packed_hidden=x,
            router_logits=tuple(logits), expert_counts=tuple(counts), hidden_states=tuple(states),
        )
