"""moembed: train, evaluate and use text-embedding models with sparse Mixture-of-Experts encoders."""

__version__ = "0.1.0"

from moembed.errors import MoembedError  # noqa: E402


def __getattr__(name: str):
    # Lazy so that `import moembed` (and the CLI's --help) does not import torch.
    if name == "Embedder":
        from moembed.model.embedder import Embedder

        return Embedder
    raise AttributeError(name)


__all__ = ["Embedder", "MoembedError", "__version__"]
