"""pylibwholegraph.torch's embeddings: WholeMemoryEmbedding and its torch.nn.Module, sparse
optimizers (sgd, lazy adam, adagrad, rmsprop) and caches, with its names, arguments and defaults.

    emb = wgth.create_embedding(comm, "distributed", "cpu", torch.float32, [rows, dim])
    opt = wgth.create_wholememory_optimizer(emb, "adam", {"weight_decay": 1e-4})
    module = wgth.WholeMemoryEmbeddingModule(emb)
    module(ids).sum().backward()      # gradients kept with the embedding
    opt.step(lr)                      # collective: summed at each row's owner, one step per row

Lookups of a distributed table, and lookups of a cached embedding, are collective over the
embedding's communicator (every rank calls, each with its own ids, zero included); through a
read-only cache of one rank, only where the table's own lookup is (docs/WHOLEMEMORY.md, Caches).
"""

from __future__ import annotations

import torch

from . import embedding_optimizer as rules
from .embedding_cache import (WholeMemoryCachePolicy, create_builtin_cache_policy,  # noqa: F401
                              create_wholememory_cache_policy, destroy_wholememory_cache_policy)
from .embedding_table import EmbeddingImpl, barrier, check_create, file_sizes, resolve_group
from .tensor import agree_on_error, fail

__all__ = ["WholeMemoryOptimizer", "create_wholememory_optimizer", "destroy_wholememory_optimizer",
           "WholeMemoryCachePolicy", "create_builtin_cache_policy", "create_wholememory_cache_policy",
           "destroy_wholememory_cache_policy", "WholeMemoryEmbedding", "create_embedding",
           "create_embedding_from_filelist", "destroy_embedding", "WholeMemoryEmbeddingModule"]

_BAD = "rank {rank} passed bad input (its error says what)"


class _Optimizer:
    """What the binding's optimizer object holds: the rule and its parameters."""

    def __init__(self, kind: str, rule, params: dict):
        self.kind, self.rule, self.params = kind, rule, params

    def destroy_optimizer(self) -> None:
        self.rule = None


class WholeMemoryOptimizer:
    """A sparse optimizer shared by one or more WholeMemoryEmbedding; made by
    create_wholememory_optimizer."""

    def __init__(self, global_comm):
        self.wmb_opt = None
        self.embeddings: list = []
        self.global_comm = global_comm

    def add_embedding(self, wm_embedding) -> None:
        """Sets this optimizer on an embedding (collective: makes its states). create_wholememory_optimizer
        calls it."""
        op = "create_wholememory_optimizer"
        if not isinstance(wm_embedding, WholeMemoryEmbedding):
            fail(op, None, f"expected a WholeMemoryEmbedding, got {type(wm_embedding).__name__}", TypeError)
        impl = wm_embedding._live(op)
        impl.set_optimizer(op, self.wmb_opt.kind, self.wmb_opt.rule, self.wmb_opt.params)
        wm_embedding.wmb_optimizer = self.wmb_opt
        wm_embedding.dummy_input.requires_grad_(True)
        self.embeddings.append(wm_embedding)

    def step(self, lr: float) -> None:
        """Collective: applies every embedding's gradients (the ones some rank gathered for training)."""
        for wm_embedding in self.embeddings:
            impl = wm_embedding._live("step")
            flag = torch.tensor([1 if wm_embedding.need_apply else 0], dtype=torch.int32)
            if impl.group.size() > 1:
                torch.distributed.all_reduce(flag, group=impl.group)
            if int(flag):
                wm_embedding.apply_gradients(lr)
        for wm_embedding in self.embeddings:
            impl = wm_embedding.wmb_embedding
            barrier(impl.comm, impl.group)


def create_wholememory_optimizer(embeddings, optimizer_type: str, param_dict: dict):
    """A WholeMemoryOptimizer of ``optimizer_type`` (sgd, adam, adagrad, rmsprop) with ``param_dict``'s
    parameters (the rest at their defaults), set on ``embeddings`` (one or a list). Collective."""
    op = "create_wholememory_optimizer"
    embs = [embeddings] if isinstance(embeddings, WholeMemoryEmbedding) else list(embeddings)
    if not embs or not all(isinstance(e, WholeMemoryEmbedding) for e in embs):
        fail(op, None, f"embeddings must be a WholeMemoryEmbedding or a list of them, got {embeddings!r}", TypeError)
    group = embs[0]._live(op).group
    error, rule, params = None, None, None
    try:
        rule = rules.rule(op, group, optimizer_type)
        params = rule.params(op, group, param_dict)
    except (ValueError, TypeError) as e:
        error = e
    agree_on_error(op, group, error, _BAD)
    opt = WholeMemoryOptimizer(embs[0].wmb_embedding.comm)
    opt.wmb_opt = _Optimizer(optimizer_type, rule, params)
    for e in embs:
        opt.add_embedding(e)
    return opt


def destroy_wholememory_optimizer(optimizer: WholeMemoryOptimizer) -> None:
    optimizer.wmb_opt.destroy_optimizer()
    optimizer.wmb_opt = None


class EmbeddingLookupFn(torch.autograd.Function):
    """The lookup as an autograd function: the backward hands the output's gradient to the
    embedding (add_gradients), which the optimizer applies later; the dummy input is what makes
    autograd call it."""

    @staticmethod
    def forward(ctx, indice, dummy_input, wm_embedding, is_training=False, force_dtype=None):
        output_tensor = wm_embedding.gather(indice, is_training=is_training, force_dtype=force_dtype)
        if is_training and wm_embedding.need_grad():
            ctx.save_for_backward(indice, dummy_input)
            ctx.wm_embedding = wm_embedding
        return output_tensor

    @staticmethod
    def backward(ctx, grad_outputs):
        indice, dummy_input = ctx.saved_tensors
        ctx.wm_embedding.add_gradients(indice, grad_outputs)
        ctx.wm_embedding = None
        return None, torch.zeros_like(dummy_input), None, None, None


class WholeMemoryEmbedding:
    """An embedding table in whole memory: made by create_embedding or create_embedding_from_filelist."""

    def __init__(self, wmb_embedding: EmbeddingImpl, wmb_cache_policy):
        self.wmb_embedding = wmb_embedding
        self.embedding_tensor = None
        self.optimizer_states: dict = {}
        self.wmb_cache_policy = wmb_cache_policy
        self.adjust_cache = self.wmb_cache_policy is not None
        self.wmb_optimizer = None
        self.dummy_input = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.need_apply = False
        self.sparse_indices: list = []
        self.sparse_grads: list = []

    def _live(self, op: str) -> EmbeddingImpl:
        if self.wmb_embedding is None:
            fail(op, None, "this embedding was destroyed (destroy_embedding)")
        return self.wmb_embedding

    def dim(self) -> int:
        return len(self.get_embedding_tensor().shape)

    @property
    def shape(self):
        return self.get_embedding_tensor().shape

    def set_adjust_cache(self, adjust_cache: bool) -> None:
        """Whether lookups (and steps) count accesses and refill the cache (the default with a cache)."""
        self.adjust_cache = bool(adjust_cache) if self.wmb_cache_policy is not None else False

    def need_grad(self) -> bool:
        return self.wmb_embedding is not None

    def gather(self, indice: torch.Tensor, *, is_training: bool = False, force_dtype: torch.dtype | None = None):
        """The rows ``indice`` names ([len(indice), dim]), as ``force_dtype`` if given. is_training:
        the result requires grad and the embedding expects gradients (add_gradients) for a step."""
        impl = self._live("gather")
        rows = impl.lookup("gather", indice, self.adjust_cache)
        if force_dtype is not None:
            rows = rows.to(force_dtype)
        if torch.cuda.is_available() and rows.device.type != "cuda":
            rows = rows.to(torch.cuda.current_device())  # as pylibwholegraph: on the current CUDA device
        need_grad = self.need_grad() and is_training
        if need_grad:
            rows.requires_grad_(True)
            self.need_apply = True
        return rows

    def add_gradients(self, indice: torch.Tensor, grad_outputs: torch.Tensor) -> None:
        """Keeps the gradients of looked-up rows until the optimizer's step."""
        impl = self._live("add_gradients")
        op = "add_gradients"
        if not isinstance(indice, torch.Tensor) or indice.dim() != 1 or indice.dtype not in (torch.int32, torch.int64):
            fail(op, impl.group, f"indices must be a 1-D int32 or int64 tensor, got {indice!r}", TypeError)
        if (not isinstance(grad_outputs, torch.Tensor) or not grad_outputs.is_floating_point()
                or tuple(grad_outputs.shape) != (indice.numel(), impl.dim)):
            shape = list(grad_outputs.shape) if isinstance(grad_outputs, torch.Tensor) else type(grad_outputs).__name__
            fail(op, impl.group, f"gradients must be floating point of shape {[indice.numel(), impl.dim]}, got {shape}")
        self.sparse_indices.append(indice.detach())
        self.sparse_grads.append(grad_outputs.detach())
        self.need_apply = True

    def apply_gradients(self, lr: float) -> None:
        """Collective: the kept gradients go to the rows' owners, summed per row, one optimizer step
        per row touched (by any rank). A rank without gradients takes part with none."""
        impl = self._live("apply_gradients")
        try:
            impl.apply_gradients("apply_gradients", self.sparse_indices, self.sparse_grads, lr)
        finally:
            self.sparse_indices = []
            self.sparse_grads = []
            self.need_apply = False

    def writeback_all_cache(self) -> None:
        """Collective: a read-write cache's modified rows (and states) written to the table."""
        self._live("writeback_all_cache").writeback()

    def drop_all_cache(self) -> None:
        """Collective: the cache written back (read-write) and emptied."""
        self._live("drop_all_cache").drop()

    def cache_counters(self) -> dict | None:
        """This rank's cache counts (None without a cache): hits and misses (lookups answered by this
        rank's cache or its table: a read-write cache counts at the rows' owners), rows loaded into
        the cache and written back to the table."""
        cache = self._live("cache_counters").cache
        return None if cache is None else cache.counters.as_dict()

    def get_embedding_tensor(self):
        """The table as a WholeMemoryTensor (a read-write cache's newer rows reach it on write-back)."""
        if self.embedding_tensor is None:
            self.embedding_tensor = self._live("get_embedding_tensor").table
        return self.embedding_tensor

    def get_optimizer_state_names(self) -> list[str]:
        impl = self._live("get_optimizer_state_names")
        return [] if impl.rule is None else impl.rule.state_names

    def get_optimizer_state(self, state_name: str):
        """An optimizer state as a WholeMemoryTensor, with the table's rows and partition."""
        impl = self._live("get_optimizer_state")
        if state_name not in impl.states:
            fail("get_optimizer_state", impl.group, f"optimizer state name {state_name!r} not found "
                 f"(this embedding's: {', '.join(self.get_optimizer_state_names()) or 'none'})")
        if state_name not in self.optimizer_states:
            self.optimizer_states[state_name] = impl.states[state_name]
        return self.optimizer_states[state_name]

    def save(self, file_prefix: str) -> None:
        """Collective: the table to ``{file_prefix}_embedding_tensor_part_<i>_of_<n>`` and each state to
        ``{file_prefix}_<state>_part_...`` (a read-write cache is written back first)."""
        self._live("save").writeback()
        self.get_embedding_tensor().to_file_prefix(file_prefix + "_embedding_tensor")
        for state_name in self.get_optimizer_state_names():
            self.get_optimizer_state(state_name).to_file_prefix(file_prefix + "_" + state_name)

    def load(self, file_prefix: str, *, ignore_embedding: bool = False, part_count: int | None = None) -> None:
        """Collective: what save wrote (any number of parts); the cache is emptied (not written back)."""
        impl = self._live("load")
        if ignore_embedding is False:
            self.get_embedding_tensor().from_file_prefix(file_prefix + "_embedding_tensor", part_count)
        for state_name in self.get_optimizer_state_names():
            self.get_optimizer_state(state_name).from_file_prefix(file_prefix + "_" + state_name, part_count)
        impl.drop(writeback=False)


def _create(op, comm, memory_type, memory_location, dtype, sizes, cache_policy, partition, gather_sms,
            round_robin_size):
    group = resolve_group(op, comm)
    error = None
    try:
        partition, round_robin_size = check_create(op, group, memory_type, memory_location, dtype, sizes,
                                                   cache_policy, partition, round_robin_size, gather_sms)
    except (ValueError, TypeError) as e:
        error = e
    agree_on_error(op, group, error, _BAD)
    impl = EmbeddingImpl(op, comm, group, memory_type, memory_location, dtype, sizes, cache_policy, partition,
                         round_robin_size)
    return WholeMemoryEmbedding(impl, cache_policy)


def create_embedding(comm, memory_type: str, memory_location: str, dtype: torch.dtype, sizes, *,
                     cache_policy: WholeMemoryCachePolicy | None = None, embedding_entry_partition=None,
                     random_init: bool = False, gather_sms: int = -1, round_robin_size: int = 0):
    """Collective over ``comm``: an embedding of ``sizes`` = [rows, dim] in ``memory_type``
    (continuous, chunked, distributed, hierarchy) ``memory_location`` (cpu, cuda) memory.
    embedding_entry_partition: rows per rank (ignored with a cache); round_robin_size: blocks of
    that many rows dealt to the ranks in turn; random_init: each rank's part Xavier-uniform.
    gather_sms is accepted and has no effect here."""
    wm_embedding = _create("create_embedding", comm, memory_type, memory_location, dtype, sizes, cache_policy,
                           embedding_entry_partition, gather_sms, round_robin_size)
    if random_init is True:
        local_tensor, _ = wm_embedding.get_embedding_tensor().get_local_tensor()
        torch.nn.init.xavier_uniform_(local_tensor)
    impl = wm_embedding.wmb_embedding
    barrier(impl.comm, impl.group)
    return wm_embedding


def create_embedding_from_filelist(comm, memory_type: str, memory_location: str, filelist, dtype: torch.dtype,
                                   last_dim_size: int, *, cache_policy: WholeMemoryCachePolicy | None = None,
                                   embedding_entry_partition=None, gather_sms: int = -1, round_robin_size: int = 0):
    """Collective: an embedding holding the rows of ``filelist`` (one file or a list, concatenated:
    raw rows of ``last_dim_size`` elements of ``dtype``), each rank reading only its own rows."""
    op = "create_embedding_from_filelist"
    group = resolve_group(op, comm)
    error, files, sizes, total = None, [], [], 0
    try:
        if not isinstance(dtype, torch.dtype):
            fail(op, group, f"dtype must be a torch.dtype, got {dtype!r}", TypeError)
        files, sizes, total = file_sizes(op, group, filelist, dtype, last_dim_size)
        if total == 0:
            fail(op, group, f"the files {files} hold no rows")
    except (ValueError, TypeError) as e:
        error = e
    agree_on_error(op, group, error, _BAD)
    wm_embedding = _create(op, comm, memory_type, memory_location, dtype, [total, last_dim_size], cache_policy,
                           embedding_entry_partition, gather_sms, round_robin_size)
    impl = wm_embedding.wmb_embedding
    impl.load_files(files)
    barrier(impl.comm, impl.group)
    return wm_embedding


def destroy_embedding(wm_embedding: WholeMemoryEmbedding) -> None:
    wm_embedding._live("destroy_embedding").destroy()
    wm_embedding.wmb_embedding = None
    wm_embedding.embedding_tensor = None
    wm_embedding.optimizer_states = {}


class WholeMemoryEmbeddingModule(torch.nn.Module):
    """torch.nn.Module over a WholeMemoryEmbedding: forward looks rows up (for training in training
    mode); backward hands their gradients to the embedding for its optimizer's step."""

    def __init__(self, wm_embedding: WholeMemoryEmbedding):
        super().__init__()
        self.wm_embedding = wm_embedding
        self.embedding_gather_fn = EmbeddingLookupFn.apply

    def forward(self, indice: torch.Tensor, force_dtype: torch.dtype | None = None):
        return self.embedding_gather_fn(indice, self.wm_embedding.dummy_input, self.wm_embedding, self.training,
                                        force_dtype)
