"""Router rows from k-means centroids of the token states an MoE layer will route (upcycling's `router_init`).

A freshly drawn router sends tokens to experts by chance; k-means on the hidden states that enter the layer's MLP
in the dense model gives each expert (or virtual group) a region of the token space from the first step. Spherical k-means (faiss) on the states; the
router has no bias, so a row is the unit centroid, scaled so that a token's logits have unit standard deviation
across experts on the sample (a router neither flat nor saturated: its softmax still passes gradient).
"""

from __future__ import annotations

import torch

from moembed.errors import MoembedError
from moembed.model.inference import length_sorted_batches


@torch.inference_mode()
def mlp_inputs(embedder, layers: list[int], texts: list[str], batch_size: int = 32,
               max_tokens: int = 50_000) -> dict[int, torch.Tensor]:
    """The packed real-token states (N, d) float32 entering the MLP of each of `layers` (0-based) in `embedder`."""
    states: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    hooks = [embedder.encoder.layers[i].mlp.register_forward_pre_hook(
        lambda _m, args, i=i: states[i].append(args[0].detach().float().reshape(-1, args[0].shape[-1])))
        for i in layers]
    was_training = embedder.training
    embedder.eval()
    try:
        ids, _ = embedder.token_ids(texts)
        for idx in length_sorted_batches([len(x) for x in ids], batch_size):
            embedder.embed_ids([ids[i] for i in idx])
            if sum(x.shape[0] for x in states[layers[0]]) >= max_tokens:
                break
    finally:
        for h in hooks:
            h.remove()
        embedder.train(was_training)
    return {i: torch.cat(v)[:max_tokens] for i, v in states.items()}


def kmeans_rows(embedder, layers: list[int], k: int, texts: list[str], seed: int = 0) -> dict[int, torch.Tensor]:
    """Layer → (k, d) router rows: unit centroids of spherical k-means on that layer's MLP inputs, scaled so that
    the logits of the sampled tokens have unit standard deviation across the k rows."""
    import faiss

    out = {}
    for layer, x in mlp_inputs(embedder, layers, texts).items():
        if x.shape[0] < k:
            raise MoembedError(f"router_init kmeans: {x.shape[0]} token states from {len(texts)} texts, fewer than "
                               f"the {k} centroids of layer {layer + 1}; give more texts")
        km = faiss.Kmeans(x.shape[1], k, niter=25, seed=seed, spherical=True, verbose=False)
        km.train(x.numpy().astype("float32"))
        c = torch.from_numpy(km.centroids).float()
        c = c / c.norm(dim=1, keepdim=True).clamp(min=1e-12)  # (k, d) unit rows
        logits = x @ c.T  # (N, k)
        spread = (logits - logits.mean(dim=1, keepdim=True)).std().clamp(min=1e-6)
        out[layer] = c / spread
    return out
