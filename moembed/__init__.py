"""moembed: train, evaluate and use text-embedding models with sparse Mixture-of-Experts encoders."""

from moembed.errors import MoembedError
from moembed.version import __version__


def __getattr__(name: str):
    # Lazy so that `import moembed` (and the CLI's --help) does not import torch.
    if name == "Embedder":
        from moembed.model.embedder import Embedder

        return Embedder
    raise AttributeError(name)


__all__ = ["Embedder", "MoembedError", "__version__"]
