"""pylibwholegraph.torch's embeddings: WholeMemoryEmbedding, its module, sparse optimizers and caches."""

__all__: list[str] = []
