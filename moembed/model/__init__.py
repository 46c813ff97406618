"""Model components: typed configs, the encoder, MoE blocks, pooling and quantisation, the embedder, model I/O."""
