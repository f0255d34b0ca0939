"""pylibwholegraph.torch's start-up and communicators: init, init_torch_env, WholeMemoryCommunicator."""

__all__: list[str] = []
