"""Starting the launcher's processes on their hosts, for run.py and the elastic driver: whether a
host is this machine, the command line that runs a process on another (over ssh, or the prefix in
MYCCL_HVD_RSH), and the pump that copies a process's output to ours and each rank's tagged lines to
its files (--output-filename)."""

from __future__ import annotations

import collections
import os
import re
import shlex
import socket

from .. import config

# The launcher's own file: run with --_agent / --_worker on the hosts (as a file, without the package).
RUN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
RSH_ENV = "MYCCL_HVD_RSH"
SSH_COMMAND_PREFIX = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no"]
TERMINATE_GRACE_S = 30.0  # torch's agent stops its workers with SIGTERM, then SIGKILL after 30 s
_IGNORED_ENV = [re.compile(r) for r in (r"BASH_FUNC_.*", r"OLDPWD$", r".*CUDA_VISIBLE_DEVICES$")]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TAG = re.compile(rb"\[(\d+)\]<(stdout|stderr)>:")


def is_local_host(name: str) -> bool:
    """Whether `name` is this machine: a loopback name, our host name, or an address of ours."""
    if name in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        addr = sockaddr[0]
        if addr.startswith("127.") or addr == "::1":
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))  # only addresses of this machine can be bound
            return True
        except OSError:
            pass
    return False


def _exportable(env: dict) -> dict:
    return {k: v for k, v in env.items()
            if _ENV_NAME.match(k) and not any(r.match(k) for r in _IGNORED_ENV)}


def remote_argv(host: str, command_line: str, ssh_port=None, ssh_identity_file=None) -> list:
    """The argv that runs the shell command line `command_line` on `host`."""
    template = config.value(RSH_ENV)
    if template:
        words = [w.replace("{host}", host) for w in shlex.split(template)]
        if "{command}" in words:
            return [command_line if w == "{command}" else w for w in words]
        return words + ["/bin/sh", "-c", command_line]
    return (SSH_COMMAND_PREFIX + (["-p", str(ssh_port)] if ssh_port is not None else [])
            + (["-i", ssh_identity_file] if ssh_identity_file is not None else []) + [host, command_line])


# One process to start on a host: torch's agent for the host's ranks (run.py), or one elastic
# worker (elastic/driver.py).
HostLaunch = collections.namedtuple("HostLaunch", "host node_rank nproc ranks local argv env")


def _command_line(h: HostLaunch) -> str:
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(_exportable(h.env).items()))
    return (f"cd {shlex.quote(os.getcwd())} > /dev/null 2>&1 ; exec env {exports} "
            + " ".join(shlex.quote(a) for a in h.argv))


def _pump(src, dst, files: dict):
    """Copies an agent's output to ours, and each tagged line to its rank's file."""
    for line in iter(src.readline, b""):
        dst.write(line)
        dst.flush()
        m = _TAG.search(line[:200])
        if m and files is not None:
            f = files.get((int(m.group(1)), m.group(2).decode()))
            if f is not None:
                f.write(line)
                f.flush()
    src.close()
