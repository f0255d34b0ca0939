"""The creator torch calls for ``init_process_group("myccl")`` / ``new_group``, and Options."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from . import _C
from .config import BY_FIELD, GROUP_FIELDS, parse_env, torch_env


class Options:
    """Per-group settings, passed as ``pg_options=c10d_ext.Options(...)``.

    Any field left as None takes its value from the MYCCL_* environment variable (see
    ``c10d_ext.config``). Unknown fields raise, so a typo never silently does nothing.
    """

    __slots__ = tuple(GROUP_FIELDS)

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            object.__setattr__(self, name, None)
        for name, value in fields.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in GROUP_FIELDS:
            raise AttributeError(
                f"myccl: Options has no field {name!r}; known fields: {', '.join(sorted(GROUP_FIELDS))}"
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        set_fields = {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}
        return f"c10d_ext.Options({', '.join(f'{k}={v!r}' for k, v in set_fields.items())})"


def make_config(options: Options | None = None, environ: dict | None = None) -> _C.Config:
    values = parse_env(environ)
    if options is not None:
        if not isinstance(options, Options):
            raise TypeError(
                f"myccl: pg_options must be a c10d_ext.Options, got {type(options).__name__}"
            )
        for field in Options.__slots__:
            v = getattr(options, field)
            if v is not None:
                # Same validation as the environment: go through the variable's parser.
                var = BY_FIELD[field]
                try:
                    values[field] = var.parse(str(int(v)) if isinstance(v, bool) else str(v))
                except ValueError as e:
                    raise ValueError(f"myccl: Options.{field}={v!r} is invalid: {e}") from None
    cfg = _C.Config()
    for field in GROUP_FIELDS:
        setattr(cfg, field, values[field])
    for field, value in torch_env(environ).items():
        setattr(cfg, field, value)
    return cfg


def create_backend(dist_opts: Any, pg_options: Any = None) -> _C.MycclBackend:
    """torch.distributed's extended-API creator: (DistributedBackendOptions, pg_options)."""
    timeout = dist_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    cfg = make_config(pg_options)
    ranks = list(dist_opts.global_ranks_in_group)
    return _C.MycclBackend(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        timeout,
        str(dist_opts.group_id),
        ranks,
        cfg,
        # torch 2.14+: init_process_group(enable_reconfigure=True); no links until reconfigure()
        reconfigurable=bool(getattr(dist_opts, "enable_reconfigure", False)),
    )
