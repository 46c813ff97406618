"""MoVE: a Mixture-of-Vocabulary-Experts embedding layer (MoVE §3.1, Fig. 2).

The input sequence follows the large routing vocabulary V_l. Each V_l token t is decomposed into pieces of the
small base vocabulary V_s by φ (Eq. 1; a token of V_s is its own single piece). One expert, chosen for the V_l
token by the routing r: V_l → {1..K}, transforms the base embedding of every piece (Eq. 2):

    h^(j) = Expert_{r(t)}(E_s[φ(t)_j])          each expert: d → d_e → d (Fig. 2b)
    h*(t) = mean_j h^(j)                          the V_l token's embedding (mean pooling, §3.1)

The expert sees each piece's base embedding, not the pooled vector: pooling comes after the expert (Eq. 2 and
"computed by mean pooling the expert outputs of the constituent tokens"). Only the base table E_s and the experts
are trained, so rare V_l tokens share parameters with the frequent pieces they are made of. At inference the
whole (|V_l|, d) table is precomputed (`precompute_table`) and the layer becomes a plain lookup
(`moembed.model.convert.lookup.to_lookup`).

Routing (App. D): "hash" — a static table pre-assigned by corpus frequency so that every expert receives about
the same token mass (Roller et al., 2021; built by `hash_balanced_routing`); "semantic" — a static table of
equal-size clusters of token vectors (`semantic_routing`); "learned" — a top-1 router (linear + softmax on the
mean base embedding of the pieces), the expert output scaled by the router probability so the router receives a
gradient (Switch Transformer, Fedus et al., 2022).
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.model.config import EncoderConfig


def move_budget(vs: int, vl: int, d: int, num_experts: int | None = None) -> tuple[int, int]:
    """(K, d_e) for growing the vocabulary from |V_s| = vs to |V_l| = vl at width d (MoVE §4.4.2, Table 12).

    The parameter gap (vl - vs) × d is the budget for K experts of 2 × d × d_e weights each, so
    d_e = round((vl - vs) / (2K)) — d cancels. This reproduces every entry of Table 12 (30k → 200k: K = 500,
    d_e = 170; 30k → 500k: K = 250, d_e = 940) and App. D (5k → 100k: K = 100, d_e = 475). Unless given, K follows
    the paper's two settings: K = vs / 50 capped at 500 (30k → 500, 5k → 100).
    """
    if not 0 < vs < vl:
        raise ValueError(f"need 0 < |V_s| < |V_l|, got {vs} and {vl}")
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    k = num_experts if num_experts is not None else min(500, max(1, round(vs / 50)))
    if k < 1:
        raise ValueError(f"num_experts must be >= 1, got {k}")
    return k, max(1, round((vl - vs) / (2 * k)))


def hash_balanced_routing(frequency: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Static routing (|V_l|,) long: tokens by descending corpus frequency, each to the currently lightest expert.

    Greedy longest-processing-time assignment (Roller et al., 2021; MoVE §3.1): every expert ends with about the
    same token mass. Ties in mass (e.g. unseen tokens) go to the expert holding fewest tokens, so zero-frequency
    tokens spread evenly too.
    """
    freq = frequency.double().cpu()
    routing = torch.empty(len(freq), dtype=torch.long)
    heap = [(0.0, 0, e) for e in range(num_experts)]  # (mass, tokens, expert)
    for t in torch.argsort(freq, descending=True, stable=True).tolist():
        mass, n, e = heapq.heappop(heap)
        routing[t] = e
        heapq.heappush(heap, (mass + float(freq[t]), n + 1, e))
    return routing


def semantic_routing(vectors: torch.Tensor, num_experts: int, iters: int = 10, seed: int = 0) -> torch.Tensor:
    """Static routing (|V_l|,) long: equal-size clusters of token vectors (V, D) (MoVE App. D, semantic ablation).

    k-means (cosine) gives the centroids; tokens then fill clusters up to ceil(V / K) each, the closest first:
    an over-full cluster keeps its nearest tokens and the others move to their next-nearest open cluster.
    """
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(vectors.float(), dim=-1)  # (V, D)
    V = len(x)
    centroids = x[torch.randperm(V, generator=g)[:num_experts]].clone()  # (K, D)
    for _ in range(iters):
        assign = (x @ centroids.T).argmax(1)  # (V,)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        keep = torch.bincount(assign, minlength=num_experts) == 0
        centroids = torch.where(keep[:, None], centroids, F.normalize(sums, dim=-1))
    cap = math.ceil(V / num_experts)
    sim = x @ centroids.T  # (V, K)
    routing = torch.full((V,), -1, dtype=torch.long)
    load = torch.zeros(num_experts, dtype=torch.long)
    while (routing < 0).any():
        free = (routing < 0).nonzero().squeeze(1)
        choice = sim[free].masked_fill(load[None, :] >= cap, -math.inf).argmax(1)  # (F,)
        for e in choice.unique().tolist():
            cand = free[choice == e]
            room = cap - int(load[e])
            best = cand[torch.argsort(sim[cand, e], descending=True)[:room]]
            routing[best] = e
            load[e] += len(best)
    return routing


def expert_mass(routing: torch.Tensor, frequency: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(K,) total corpus frequency of the tokens routed to each expert."""
    return torch.zeros(num_experts, dtype=torch.float64).index_add_(0, routing.cpu(), frequency.double().cpu())


class MoVEExperts(nn.Module):
    """K expert MLPs d → d_e → d (Fig. 2b, GELU), their weights stacked so one expert is one pair of matmuls."""

    def __init__(self, num_experts: int, d: int, d_e: int, residual: bool = False):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, d, d_e) / math.sqrt(d))  # (K, d, d_e)
        self.b1 = nn.Parameter(torch.zeros(num_experts, d_e))
        self.w2 = nn.Parameter(torch.randn(num_experts, d_e, d) / math.sqrt(d_e))  # (K, d_e, d)
        self.b2 = nn.Parameter(torch.zeros(num_experts, d))
        self.residual = residual

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x (n, d) → (n, d)."""
        y = F.gelu(x @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]
        return x + y if self.residual else y

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """x (M, d), expert (M,) → (M, d). Rows are grouped by expert: one matmul pair per expert present."""
        if len(x) == 0:
            return x.clone()
        order = torch.argsort(expert, stable=True)  # (M,)
        present, counts = torch.unique_consecutive(expert[order], return_counts=True)
        chunks = x.index_select(0, order).split(counts.tolist())
        y = torch.cat([self.expert(e, c) for e, c in zip(present.tolist(), chunks)])  # (M, d), sorted by expert
        return y.index_select(0, torch.argsort(order))  # back to input order


class MoVEEmbedding(nn.Module):
    """The encoder's word embedding for a MoVE config: forward(ids (N,) in V_l) → (N, d).

    Buffers (saved in the state dict, so a model directory carries its vocabulary mapping):
        phi (|V_l|, max_pieces) long: V_s ids of each token's pieces, 0-padded past `lengths`
        lengths (|V_l|,) long: number of pieces (≥ 1)
        routing (|V_l|,) long: expert of each token (hash / semantic routing; unused by learned routing)
    Until `set_vocabulary` is called, token i is the single piece i mod |V_s|, routed to expert i mod K.
    """

    def __init__(self, config: EncoderConfig):
        super().__init__()
        m, d, V = config.move, config.hidden_size, config.vocab_size
        self.num_experts, self.learned = m.num_experts, m.routing == "learned"
        self.base = nn.Embedding(m.base_vocab_size, d, padding_idx=config.pad_token_id)
        self.experts = MoVEExperts(m.num_experts, d, m.expert_dim, m.residual)
        self.router = nn.Linear(d, m.num_experts, bias=False) if self.learned else None
        ids = torch.arange(V)
        phi = torch.zeros(V, m.max_pieces, dtype=torch.long)
        phi[:, 0] = ids % m.base_vocab_size
        self.register_buffer("phi", phi)
        self.register_buffer("lengths", torch.ones(V, dtype=torch.long))
        self.register_buffer("routing", ids % m.num_experts)

    def set_vocabulary(self, phi: torch.Tensor, lengths: torch.Tensor, routing: torch.Tensor) -> None:
        """Install φ (n, L ≤ max_pieces), lengths (n,) and routing (n,) for the first n ≤ |V_l| token ids."""
        n, L = phi.shape
        V, Lmax = self.phi.shape
        if n > V or L > Lmax:
            raise ValueError(f"phi has shape {tuple(phi.shape)}; this layer holds at most ({V}, {Lmax})")
        if int(phi.max()) >= self.base.num_embeddings or int(lengths.min()) < 1 or int(lengths.max()) > L:
            raise ValueError("phi ids must be < |V_s| and 1 <= lengths <= phi width")
        if int(routing.min()) < 0 or int(routing.max()) >= self.num_experts:
            raise ValueError(f"routing must lie in 0..{self.num_experts - 1}")
        with torch.no_grad():
            self.phi[:n].zero_()
            self.phi[:n, :L] = phi
            self.lengths[:n] = lengths
            self.routing[:n] = routing

    def embed_unique(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings (U, d) of distinct V_l ids (U,) — Eq. 2 and mean pooling."""
        lengths = self.lengths[ids]  # (U,)
        valid = torch.arange(self.phi.shape[1], device=ids.device) < lengths[:, None]  # (U, L)
        owner = torch.arange(len(ids), device=ids.device)[:, None].expand_as(valid)[valid]  # (M,) row of each piece
        x = self.base(self.phi[ids][valid])  # (M, d) base embeddings of all pieces
        if self.learned:
            pooled = torch.zeros(len(ids), x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, owner, x)
            probs = self.router(pooled / lengths[:, None]).softmax(-1)  # (U, K)
            gate, expert = probs.max(-1)  # top-1 (App. D)
        else:
            expert = self.routing[ids]  # (U,)
        y = self.experts(x, expert[owner])  # (M, d)
        out = torch.zeros(len(ids), y.shape[1], dtype=y.dtype, device=y.device).index_add_(0, owner, y)
        out = out / lengths[:, None].to(y.dtype)  # (U, d) mean over pieces
        return out * gate[:, None] if self.learned else out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (N,) → (N, d). Each distinct token of the batch is computed once."""
        uniq, inverse = torch.unique(ids, return_inverse=True)  # (U,), (N,)
        return self.embed_unique(uniq)[inverse]

    @property
    def weight(self) -> torch.Tensor:
        """The full (|V_l|, d) table E_{V_l}, with gradients to the base table and experts.

        For decoders tied to the word embedding (MLM heads): costs one pass of every V_l token through its expert.
        """
        return self.embed_unique(torch.arange(self.phi.shape[0], device=self.phi.device))

    @torch.no_grad()
    def precompute_table(self, chunk_size: int = 4096) -> torch.Tensor:
        """The full (|V_l|, d) embedding table E_{V_l} (§3.1), computed chunk by chunk for inference export."""
        V = self.phi.shape[0]
        device = self.phi.device
        parts = [self.embed_unique(torch.arange(s, min(s + chunk_size, V), device=device)) for s in range(0, V, chunk_size)]
        return torch.cat(parts)
