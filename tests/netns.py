"""Test hosts made of Linux network namespaces on this machine.

Each host is a namespace with one veth link to a bridge that lives in a switch namespace of
its own, so traffic between hosts really crosses veth links (and `tc netem` can delay or drop
it) and nothing touches the machine's own network namespace. Addresses are 10.77.<net>.<i+1>
inside these namespaces only. Needs root (CAP_NET_ADMIN); `available()` says whether we can.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def available() -> tuple[bool, str]:
    """(True, "") if network namespaces can be created here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    name = f"mycclprobe{os.getpid()}"
    try:
        _ip("ip", "netns", "add", name)
    except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired) as e:
        return False, f"cannot create a network namespace: {getattr(e, 'stderr', e)}".strip()
    _ip("ip", "netns", "del", name, check=False)
    return True, ""


class Hosts:
    def __init__(self, n: int):
        self.n = n
        tag = uuid.uuid4().hex[:6]
        self.sw = f"mysw{tag}"
        self.names = [f"myh{i}{tag}" for i in range(n)]
        self.devs = [f"mv{i}{tag}" for i in range(n)]
        self.net = 10 + (os.getpid() % 200)
        self.addrs = [f"10.77.{self.net}.{i + 1}" for i in range(n)]
        self.created: list[str] = []

    def __enter__(self) -> "Hosts":
        try:
            self._setup()
        except Exception:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        _ip("ip", "netns", "add", self.sw)
        self.created.append(self.sw)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.sw)
        _ip("ip", "link", "set", "br0", "up", ns=self.sw)
        for i, (name, dev) in enumerate(zip(self.names, self.devs)):
            _ip("ip", "netns", "add", name)
            self.created.append(name)
            peer = f"p{dev[1:]}"
            _ip("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
            _ip("ip", "link", "set", dev, "netns", name)
            _ip("ip", "link", "set", peer, "netns", self.sw)
            _ip("ip", "link", "set", peer, "master", "br0", ns=self.sw)
            _ip("ip", "link", "set", peer, "up", ns=self.sw)
            _ip("ip", "addr", "add", f"{self.addrs[i]}/24", "dev", dev, ns=name)
            _ip("ip", "link", "set", dev, "up", ns=name)
            _ip("ip", "link", "set", "lo", "up", ns=name)

    def impair(self, i: int, delay_ms: int = 3, loss_pct: float = 2.0) -> list[str]:
        """Delay and loss on host i's link; returns what could be applied.

        netem where the kernel has it; otherwise a token-bucket bandwidth cap (queueing delay)
        and random drops with iptables' statistic match (when iptables is installed)."""
        ns, dev = self.names[i], self.devs[i]
        try:
            _ip("tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms", "1ms",
                "loss", f"{loss_pct}%", ns=ns)
            return [f"netem delay {delay_ms}ms loss {loss_pct}%"]
        except subprocess.CalledProcessError:
            pass
        applied = []
        _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", "300mbit", "burst", "32kb", "latency",
            f"{max(10, 10 * delay_ms)}ms", ns=ns)
        applied.append("tbf 300mbit (queueing delay; this kernel has no netem)")
        try:
            for chain in ("INPUT", "OUTPUT"):
                _ip("iptables", "-A", chain, "-i" if chain == "INPUT" else "-o", dev, "-m", "statistic", "--mode",
                    "random", "--probability", str(loss_pct / 100), "-j", "DROP", ns=ns)
            applied.append(f"iptables random drop {loss_pct}% each way")
        except (subprocess.CalledProcessError, FileNotFoundError):
            pass
        return applied

    def dropped(self, i: int) -> int:
        """Packets host i's link has dropped on purpose (impair()): netem's drop count, or the
        iptables statistic rules' packet counters."""
        ns, dev = self.names[i], self.devs[i]
        out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                             capture_output=True, text=True).stdout
        n = 0
        if "netem" in out:
            m = re.search(r"dropped (\d+)", out)
            n += int(m.group(1)) if m else 0
        for chain in ("INPUT", "OUTPUT"):
            res = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-L", chain, "-v", "-n", "-x"],
                                 capture_output=True, text=True)
            for line in res.stdout.splitlines():
                if "statistic" in line and "DROP" in line:
                    n += int(line.split()[0])
        return n

    def cap(self, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """Caps every host's link at `rate` (tc rate syntax, e.g. "1gbit") in both directions: a
        token bucket on the host's end (what it sends) and on the switch's end (what it receives),
        so that the link, not the CPU, bounds large messages. This kernel has no netem; tbf is
        enough for a rate."""
        for i, (name, dev) in enumerate(zip(self.names, self.devs)):
            _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency",
                latency, ns=name)
            _ip("tc", "qdisc", "replace", "dev", f"p{dev[1:]}", "root", "tbf", "rate", rate, "burst", burst,
                "latency", latency, ns=self.sw)

    def popen(self, i: int, cmd: list[str], env: dict, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.names[i]] + cmd, env=env, **kw)

    def close(self) -> None:
        for name in reversed(self.created):
            _ip("ip", "netns", "del", name, check=False)
        self.created.clear()
