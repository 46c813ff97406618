"""Router rows from the token states an MoE layer will route (upcycling's `router_init`).

A freshly drawn router sends tokens to experts by chance. Two initialisations give each expert (or virtual
group) a region of the token space from the first step, both from the hidden states that enter the layer's MLP in
the dense model:

    kmeans    spherical k-means (faiss) on the states; a row is the unit centroid of its cluster
    sources   the texts' sources (in the multilingual recipe each source is one language or language pair)
              clustered into as many groups as the router has rows, by the mean of their unit token states; the
              rows are then a linear probe fitted to tell each token's group from its state: routing that starts
              by source (nomic-embed-v2-moe §9 asks whether experts can specialise by language; this puts them
              there at step 0)

The router has no bias, so rows are scaled so that the sampled tokens' logits have unit standard deviation across
rows (a router neither flat nor saturated: its softmax still passes gradient).
"""

from __future__ import annotations

import torch

from moembed.errors import MoembedError
from moembed.model.inference import length_sorted_batches


@torch.inference_mode()
def mlp_inputs(embedder, layers: list[int], texts: list[str], batch_size: int = 32,
               max_tokens: int = 50_000) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The packed real-token states (N, d) float32 entering the MLP of each of `layers` (0-based) in `embedder`,
    and the index in `texts` of the text each token belongs to (N,)."""
    states: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    owners: list[torch.Tensor] = []
    hooks = [embedder.encoder.layers[i].mlp.register_forward_pre_hook(
        lambda _m, args, i=i: states[i].append(args[0].detach().float().reshape(-1, args[0].shape[-1])))
        for i in layers]
    was_training = embedder.training
    embedder.eval()
    try:
        ids, _ = embedder.token_ids(texts)
        for idx in length_sorted_batches([len(x) for x in ids], batch_size):
            embedder.embed_ids([ids[i] for i in idx])
            owners.append(torch.repeat_interleave(torch.tensor(idx), torch.tensor([len(ids[i]) for i in idx])))
            if sum(x.shape[0] for x in states[layers[0]]) >= max_tokens:
                break
    finally:
        for h in hooks:
            h.remove()
        embedder.train(was_training)
    owner = torch.cat(owners)
    out = {i: torch.cat(v) for i, v in states.items()}
    if any(x.shape[0] != owner.shape[0] for x in out.values()):  # the MLP saw padding: owners would be wrong
        raise RuntimeError(f"mlp_inputs: {owner.shape[0]} real tokens, {[x.shape[0] for x in out.values()]} MLP rows")
    return {i: x[:max_tokens] for i, x in out.items()}, owner[:max_tokens]


def unit_spread(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """rows (k, d) scaled so that the logits x @ rows.T of the sampled tokens x (N, d) have unit standard
    deviation across the k rows."""
    logits = x @ rows.T  # (N, k)
    return rows / (logits - logits.mean(dim=1, keepdim=True)).std().clamp(min=1e-6)


def kmeans_rows(embedder, layers: list[int], k: int, texts: list[str], seed: int = 0) -> dict[int, torch.Tensor]:
    """Layer → (k, d) router rows: unit centroids of spherical k-means on that layer's MLP inputs, scaled so that
    the logits of the sampled tokens have unit standard deviation across the k rows."""
    import faiss

    out = {}
    for layer, x in mlp_inputs(embedder, layers, texts)[0].items():
        if x.shape[0] < k:
            raise MoembedError(f"router_init kmeans: {x.shape[0]} token states from {len(texts)} texts, fewer than "
                               f"the {k} centroids of layer {layer + 1}; give more texts")
        km = faiss.Kmeans(x.shape[1], k, niter=25, seed=seed, spherical=True, verbose=False)
        km.train(x.numpy().astype("float32"))
        c = torch.from_numpy(km.centroids).float()
        out[layer] = unit_spread(c / c.norm(dim=1, keepdim=True).clamp(min=1e-12), x)  # (k, d) from unit rows
    return out


def group_means(u: torch.Tensor, group: torch.Tensor, k: int) -> torch.Tensor:
    """(k, d) mean of the rows of u (N, d) in each group, group (N,) in [0, k)."""
    sums = torch.zeros(k, u.shape[1]).index_add_(0, group, u)
    return sums / torch.bincount(group, minlength=k).clamp(min=1)[:, None]


def source_rows(embedder, layers: list[int], k: int, texts: list[str], sources: list[str],
                seed: int = 0) -> dict[int, torch.Tensor]:
    """Layer → (k, d) router rows that route by source (`router_init="sources"`). The sources seen in the sample
    are clustered into k groups by k-means on the centred means of their unit token states; the rows are a
    multinomial logistic regression without bias (the router has none) from a token's state to its source's
    group, fitted by L-BFGS from the groups' centred mean states, and scaled as `kmeans_rows` scales.
    (The mean states alone route badly without a bias: on multilingual-e5-small's 39 training sources they put
    53-90% of the tokens in their group's rows, the fitted probe 89-99%.) sources: one label per text."""
    import faiss

    if len(sources) != len(texts):
        raise MoembedError(f"router_init sources: {len(sources)} sources for {len(texts)} texts; give one per text")
    names = sorted(set(sources))
    index = {name: j for j, name in enumerate(names)}
    code = torch.tensor([index[s] for s in sources])  # (n,)
    states, owner = mlp_inputs(embedder, layers, texts)
    seen, src = torch.unique(code[owner], return_inverse=True)  # sources with tokens in the sample; (N,) into seen
    if len(seen) < k:
        raise MoembedError(f"router_init sources: tokens of {len(seen)} sources ({', '.join(names[i] for i in seen)})"
                           f" for {k} router rows; give texts of at least {k} sources, or use kmeans")
    out = {}
    for layer, x in states.items():
        x = x.clone()  # out of inference mode: the probe is fitted with autograd
        u = x / x.norm(dim=1, keepdim=True).clamp(min=1e-12)  # (N, d)
        means = group_means(u, src, len(seen))  # (S, d)
        means = (means - means.mean(0)).numpy().astype("float32")  # centred: what tells the sources apart
        km = faiss.Kmeans(means.shape[1], k, niter=25, seed=seed, verbose=False, min_points_per_centroid=1)
        km.train(means)
        group = torch.from_numpy(km.index.search(means, 1)[1][:, 0]).long()[src]  # (N,) each token's group
        start = group_means(u, group, k)
        out[layer] = unit_spread(probe(x, group, start - start.mean(0)), x)
    return out


def probe(x: torch.Tensor, y: torch.Tensor, start: torch.Tensor, l2: float = 1e-4, steps: int = 200) -> torch.Tensor:
    """(k, d) rows W minimising cross-entropy(x @ W.T, y) + l2·‖W‖², x (N, d), y (N,) in [0, k), from `start`;
    centred over the rows (a shift common to every row leaves the softmax as it is)."""
    w = start.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], max_iter=steps, history_size=20, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = torch.nn.functional.cross_entropy(x @ w.T, y) + l2 * w.pow(2).sum()
        value.backward()
        return value

    with torch.enable_grad():
        opt.step(loss)
    w = w.detach()
    return w - w.mean(0)
