"""The MoE study's options: how each run upcycles the base and trains, laid over the recipe's quickstart config by
`moe_vs_dense.config`. dense (the control), copies (today's upcycling: 8 copies, top-2), groups (virtual groups: G = 4
quarter-wide slices, 2 copies, top-4: the dense model's active parameters), groups-kmeans (the same with routers from
k-means centroids), copies-top1 (8 copies top-1, gates not renormalised: Switch routing), copies-free (copies with
auxiliary-loss-free balancing instead of the aux loss), copies-reinit (Drop-Upcycling r = 0.5), groups-wide (virtual
groups with 8 copies: 32 quarter-wide experts, top-4, the dense model's active parameters and copies' total),
groups-router-lr (groups with the routers at 20 times the peak learning rate: 1e-3 at the recipes' 5e-5, a rate for
weights that start from nothing), groups-sources and groups-wide-sources (groups and groups-wide with routers that send
each training source's tokens, in the multilingual recipe a language or language pair, to its own group from step 0),
copies-sources (the default copies with such routers: the task gives the router no gradient, only the load-balancing
loss moves it, so each expert's gradient comes from its sources' tokens), copies-noise (the copies with Gaussian noise
of 0.1 times each weight's std: experts that differ a little, so the router gets a gradient, while the model stays
within 0.995 cosine of the dense one; a control, Komatsuzaki et al. 2023), copies-raw-gates (copies top-2 with the top-2
probabilities as gates, not renormalised: the released nomic-embed-v2 layout, a dense MLP scaled by about 2/8 at step 0
that gives the router a gradient).
"""

from __future__ import annotations

OPTIONS: dict[str, dict] = {
    "dense": {},
    "copies": {"experts": 8, "top_k": 2},
    "groups": {"experts": 8, "top_k": 4, "upcycling": {"granularity": 4}},
    "groups-kmeans": {"experts": 8, "top_k": 4, "upcycling": {"granularity": 4, "router_init": "kmeans"}},
    "copies-top1": {"experts": 8, "top_k": 1, "upcycling": {"renormalize": False}},
    "copies-free": {"experts": 8, "top_k": 2, "upcycling": {"balance_rate": 0.001}, "train": {"aux_loss_coef": 0.0}},
    "copies-reinit": {"experts": 8, "top_k": 2, "upcycling": {"reinit": 0.5}},
    "groups-wide": {"experts": 32, "top_k": 4, "upcycling": {"granularity": 4}},
    "groups-router-lr": {"experts": 8, "top_k": 4, "upcycling": {"granularity": 4}, "train": {"router_lr_scale": 20.0}},
    "groups-sources": {"experts": 8, "top_k": 4, "upcycling": {"granularity": 4, "router_init": "sources"}},
    "groups-wide-sources": {"experts": 32, "top_k": 4, "upcycling": {"granularity": 4, "router_init": "sources"}},
    "copies-sources": {"experts": 8, "top_k": 2, "upcycling": {"router_init": "sources"}},
    "copies-noise": {"experts": 8, "top_k": 2, "upcycling": {"noise": 0.1}},
    "copies-raw-gates": {"experts": 8, "top_k": 2, "upcycling": {"renormalize": False}},
    "groups-sources-window": {"experts": 8, "top_k": 4, "upcycling": {"granularity": 4, "router_init": "sources"},
                              "train": {"balance_window": 16}},
}
MOE_OPTIONS = [o for o in OPTIONS if o != "dense"]  # each measured against dense
