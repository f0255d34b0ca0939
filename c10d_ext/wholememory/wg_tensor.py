"""pylibwholegraph.torch's WholeMemoryTensor and its creation, files and partitions."""

__all__: list[str] = []
