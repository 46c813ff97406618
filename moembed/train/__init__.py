"""Training: typed configs, stages (mlm, contrastive, finetune), the loop, optimisation schedules, atomic checkpoints,
MLM pretraining, plots.

    >>> from moembed.train.config import load_config
    >>> from moembed.train.loop import train
    >>> train(load_config("configs/tiny/contrastive.yaml", ["steps=4"]))
"""
