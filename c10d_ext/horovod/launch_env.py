"""What launched this process, read from its environment: rank and size from the launcher's
variables (horovodrun, Open MPI, MVAPICH, MPICH/Intel MPI, PMIx, Slurm's srun), the rendezvous
address (Horovod's, torch's, or derived from Slurm's job), and Horovod's variables that this
implementation does not act on. Pure functions of an environment mapping; basics.py makes the
world from them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Mapping

# Slurm's own step ids for the batch script, the allocation's interactive step, the extern step
# and a pending step are the top values of a uint32 (0xfffffffa-0xfffffffd); printed as %d they
# are negative. Only an srun step has a real one.
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0
SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 20000  # port = 10000 + job id mod 20000

# launcher, rank variables, size variables, local-rank variables; the first launcher with any
# of its variables set decides. Open MPI before PMIx and Slurm, MPICH's PMI before Slurm: an
# mpirun inside a Slurm allocation inherits the allocation's SLURM_* and its ranks must not.
_LAUNCHERS = (
    ("horovodrun", ("HOROVOD_RANK",), ("HOROVOD_SIZE",), ("HOROVOD_LOCAL_RANK",)),
    ("Open MPI", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("MVAPICH", ("MV2_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_SIZE",), ("MV2_COMM_WORLD_LOCAL_RANK",)),
    ("MPICH/Intel MPI (PMI)", ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID",)),
    # PMIx exports no size of its own: Open MPI's mpirun adds OMPI_COMM_WORLD_SIZE (and is found
    # above), srun --mpi=pmix the step's task count; PMIX_SIZE where a site's wrapper sets one.
    ("PMIx", ("PMIX_RANK",), ("PMIX_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")),
    ("Slurm", ("SLURM_PROCID",), ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS"), ("SLURM_LOCALID",)),
)
_SLURM_STEP_SIZE = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in the job, as its launcher's variables say."""

    launcher: str
    rank: int
    size: int
    local_rank: int | None
    rank_var: str
    size_var: str

    def describe(self) -> str:
        return (f"{self.launcher} ({self.rank_var}={self.rank}, {self.size_var}={self.size}): "
                f"rank {self.rank} of {self.size}")


def _get(env: Mapping[str, str], names) -> tuple[str | None, str | None]:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip() != "":
            return n, v.strip()
    return None, None


def _int(name: str, value: str, launcher: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Horovod initialization failed: {launcher}'s {name}={value!r} is not an integer") from None


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step (not the batch script or an allocation's
    shell, which Slurm also gives SLURM_PROCID and SLURM_NTASKS)."""
    _, step = _get(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
    try:
        return step is not None and 0 <= int(step) < _SLURM_SPECIAL_STEPS
    except ValueError:
        return False


def detect(env: Mapping[str, str]) -> Launch | None:
    """The launcher that started this process and its rank and size, or None when no launcher
    variable is set. Raises ValueError for a rank without a size (or the reverse), a rank outside
    0..size-1, and a Slurm job of several tasks seen from outside an srun step."""
    for launcher, rank_names, size_names, local_names in _LAUNCHERS:
        rank_var, rank = _get(env, rank_names)
        size_var, size = _get(env, size_names)
        if launcher in ("MPICH/Intel MPI (PMI)", "PMIx") and rank is not None and size is None and in_slurm_step(env):
            size_var, size = _get(env, _SLURM_STEP_SIZE)  # srun's PMI plugins: the step's task count
        if launcher == "Slurm":
            if rank is None:
                continue  # SLURM_NTASKS alone is the allocation's (salloc, sbatch), not a task's
            if not in_slurm_step(env):
                n = _int(size_var, size, launcher) if size is not None else 1
                if n <= 1:
                    continue  # the batch script of a one-task job: one process
                raise ValueError(
                    f"Horovod initialization failed: {rank_var}={rank} and {size_var}={size} describe a Slurm "
                    f"job of {n} tasks, but this process is not a task of a job step (no SLURM_STEP_ID: it is "
                    "Slurm's batch script or an allocation's shell). Start the training with srun, one task per "
                    f"process, or unset {size_var} to run it as one process.")
        if rank is None and size is None:
            continue
        if rank is None or size is None:
            have, missing = (rank_var, "/".join(size_names)) if size is None else (size_var, "/".join(rank_names))
            raise ValueError(
                f"Horovod initialization failed: {launcher}'s {have} is set but {missing} is not, so this "
                f"process's rank and size are unknown. Set both (or neither, for a job of one process).")
        r, n = _int(rank_var, rank, launcher), _int(size_var, size, launcher)
        if n < 1 or not 0 <= r < n:
            raise ValueError(f"Horovod initialization failed: {launcher}'s {rank_var}={r} is not a rank of "
                             f"{size_var}={n}")
        local_var, local = _get(env, local_names)
        return Launch(launcher, r, n, _int(local_var, local, launcher) if local is not None else None,
                      rank_var, size_var)
    return None


# ----------------------------------------------------------------------------------- rendezvous
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Splits on `sep` outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    parts.append("".join(cur))
    return parts


def _expand_one(name: str, whole: str) -> list[str]:
    start = name.find("[")
    if start < 0:
        if "]" in name:
            raise ValueError(f"unbalanced ']' in host list {whole!r}")
        return [name]
    end = name.index("]", start)
    prefix, body, rest = name[:start], name[start + 1:end], name[end + 1:]
    values = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"bad range {item!r} in host list {whole!r}")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in host list {whole!r}")
        width = len(lo)  # Slurm keeps the lower bound's zero padding: 08-10 is 08, 09, 10
        values += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    tails = _expand_one(rest, whole)  # further bracket groups multiply out
    return [prefix + v + t for v in values for t in tails]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list ('node[01-03,7],gpu5') as host names, in order."""
    hosts = []
    for item in _split_top(text.strip()):
        item = item.strip()
        if item:
            hosts += _expand_one(item, text)
    return hosts


def slurm_rendezvous(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """Where a Slurm job's rank 0 serves the rendezvous: the first host of the step's node list
    (SLURM_STEP_NODELIST, else SLURM_NODELIST, which srun sets to the step's, else
    SLURM_JOB_NODELIST), and 10000 + SLURM_JOB_ID mod 20000 as the port."""
    addr = port = None
    _, nodes = _get(env, ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"))
    if nodes:
        hosts = expand_hostlist(nodes)
        addr = hosts[0] if hosts else None
    _, job = _get(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if job is not None and job.isdigit():
        port = SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN
    return addr, port


def rendezvous(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """The rendezvous (rank 0's TCPStore): HOROVOD_GLOO_RENDEZVOUS_ADDR/_PORT, else MASTER_ADDR/
    MASTER_PORT, else (each of the two on its own) what Slurm's job says."""
    _, addr = _get(env, ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "MASTER_ADDR"))
    _, port = _get(env, ("HOROVOD_GLOO_RENDEZVOUS_PORT", "MASTER_PORT"))
    port = int(port) if port not in (None, "-1") else None
    if addr is None or port is None:
        slurm_addr, slurm_port = slurm_rendezvous(env)
        addr = addr if addr is not None else slurm_addr
        port = port if port is not None else slurm_port
    return addr, port


def no_rendezvous_message(launch: Launch) -> str:
    return (f"Horovod initialization failed: launched by {launch.describe()}, but no rendezvous address was "
            "found: set MASTER_ADDR and MASTER_PORT (or HOROVOD_GLOO_RENDEZVOUS_ADDR/_PORT) to a host and free "
            "port where rank 0 can serve the job's store (under Slurm, SLURM_JOB_NODELIST and SLURM_JOB_ID "
            "give them when set).")


# ----------------------------------------------------------------------------------- tuning
# Horovod's tuning and library variables (horovod/common/common.h, operations.cc,
# env_parser.cc) that this implementation reads nowhere. HOROVOD_ADASUM_MPI_CHUNK_SIZE is not
# here: adasum.py honours it.
IGNORED_TUNING = (
    "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "HOROVOD_CACHE_CAPACITY", "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_TORUS_ALLREDUCE", "HOROVOD_NUM_NCCL_STREAMS",
    "HOROVOD_MPI_THREADS_DISABLE", "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_GROUPED_ALLREDUCES",
    "HOROVOD_DISABLE_GROUP_FUSION", "HOROVOD_THREAD_AFFINITY", "HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER",
    "HOROVOD_DISABLE_NVTX_RANGES", "HOROVOD_ENABLE_ASYNC_COMPLETION",
)
IGNORED_TUNING_PREFIXES = ("HOROVOD_CCL_",)
_tuning_checked = False


def ignored_tuning(env: Mapping[str, str]) -> list[str]:
    """The ignored tuning variables set (non-empty) in `env`, sorted."""
    return sorted(k for k, v in env.items() if v != "" and (k in IGNORED_TUNING or k.startswith(IGNORED_TUNING_PREFIXES)))


def warn_ignored_tuning(env: Mapping[str, str] | None = None) -> None:
    """One warning per process (at its first hvd.init) naming the ignored variables set."""
    global _tuning_checked
    if _tuning_checked:
        return
    _tuning_checked = True
    names = ignored_tuning(os.environ if env is None else env)
    if names:
        verb = "is set but has" if len(names) == 1 else "are set but have"
        warnings.warn(f"Horovod: {', '.join(names)} {verb} no effect in c10d_ext.horovod (no autotuning, response "
                      "cache, hierarchical or torus algorithms, NCCL stream count, thread affinity, MPI, CCL or "
                      "controller choice here); ignored.", UserWarning, stacklevel=4)


# ----------------------------------------------------------------------------------- topology
TOPOLOGY_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                 "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def export_topology(env, rank, size, local_rank, local_size, cross_rank, cross_size) -> None:
    """horovodrun's variables for this process's place in the world as it is now: an elastic
    worker's environment says it after every reset, as Horovod's own workers' does."""
    for name, value in zip(TOPOLOGY_VARS, (rank, size, local_rank, local_size, cross_rank, cross_size)):
        env[name] = str(value)
