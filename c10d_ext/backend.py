"""The creator torch calls for ``init_process_group("myccl")`` / ``new_group``, and Options."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from . import _C
from .config import BY_FIELD, GROUP_FIELDS, OPTION_FIELDS, RENAMED_FIELDS, parse_env, torch_env


def _options_class():
    import dataclasses
    import warnings

    fields = [(name, Any, dataclasses.field(default=None)) for name in GROUP_FIELDS]
    base = dataclasses.make_dataclass("Options", fields, slots=True, repr=False)

    class Options(base):
        """Per-group settings, passed as ``pg_options=c10d_ext.Options(...)``.

        One field per MYCCL_* variable of a group (docs/CONFIG.md), named after it without
        ``MYCCL_`` in lower case: ``Options(transport="tcp", num_threads=2)``. A field left as None
        takes its value from the environment variable. Values are validated as the variables are;
        an unknown field raises, so a typo never silently does nothing.
        """

        __slots__ = ()

        def __init__(self, **fields: Any) -> None:
            for old, new in RENAMED_FIELDS.items():
                if old in fields:
                    warnings.warn(f"c10d_ext.Options({old}=...) is now Options({new}=...), after MYCCL_"
                                  f"{new.upper()}", FutureWarning, stacklevel=2)
                    fields[new] = fields.pop(old)
            unknown = sorted(set(fields) - set(GROUP_FIELDS))
            if unknown:
                raise TypeError(f"myccl: Options has no field {unknown[0]!r}; known fields: "
                                f"{', '.join(OPTION_FIELDS)}")
            super().__init__(**fields)

        def __repr__(self) -> str:
            set_fields = {k: getattr(self, k) for k in GROUP_FIELDS if getattr(self, k) is not None}
            return f"c10d_ext.Options({', '.join(f'{k}={v!r}' for k, v in set_fields.items())})"

    Options.__module__ = __name__
    Options.__qualname__ = "Options"
    return Options


Options = _options_class()


def make_config(options: Options | None = None, environ: dict | None = None) -> _C.Config:
    values = parse_env(environ)
    if options is not None:
        if not isinstance(options, Options):
            raise TypeError(
                f"myccl: pg_options must be a c10d_ext.Options, got {type(options).__name__}"
            )
        for field in GROUP_FIELDS:
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


def _sync_log_level() -> None:
    """C++ filters its messages by the 'c10d_ext' logger's effective level, read when the package is
    imported and again whenever a group is made, so an application that configures logging after
    importing c10d_ext is heard."""
    import logging

    _C.set_log_level(logging.getLogger("c10d_ext").getEffectiveLevel())


def create_backend(dist_opts: Any, pg_options: Any = None) -> _C.MycclBackend:
    """torch.distributed's extended-API creator: (DistributedBackendOptions, pg_options)."""
    timeout = dist_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    cfg = make_config(pg_options)
    _sync_log_level()
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
