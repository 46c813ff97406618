"""Recipes: end-to-end jobs assembled from moembed's components (data, model, train, eval)."""
