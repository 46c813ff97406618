"""Losses as pure functions of tensors: contrastive (InfoNCE, Matryoshka), GradCache, MoE auxiliary losses."""
