"""Machines on one box: network namespaces joined by a veth pair whose two ends are shaped by ``tc``.

Each "node" is a network namespace with its own stack; a veth pair joins two of them (10.201.0.1 and
10.201.0.2). Processes inside one namespace reach each other over its loopback (and deepshard's shared
memory, which only ranks of one node use), so the intra-node link stays fast; every byte between the
namespaces crosses the veth pair, whose egress on both ends goes through a token bucket (``tbf``) at the
given rate: a slow inter-node link. ``netem`` (added latency) is used when the kernel has it; where it
does not (a kernel without ``sch_netem``), the link has the veth's own latency, tens of microseconds, and
the report says so.

Needs root and iproute2 (``ip``, ``tc``). ``ShapedNodes`` is a context manager: the namespaces (and with
them the veth pair and its queues) are deleted on exit, even after an error.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from types import TracebackType
from typing import Optional

ADDRESSES = ("10.201.0.1", "10.201.0.2")


class LinkSetupError(RuntimeError):
    """The namespaces or the shaping could not be made here (not root, no iproute2, no permission)."""


def _run(*cmd: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=20)
    except subprocess.CalledProcessError as exc:
        raise LinkSetupError(f"{' '.join(cmd)} failed: {exc.stderr.strip()}") from exc


@dataclass
class ShapedNodes:
    """Two namespaces ``names`` joined by veth ends ``devices`` shaped to ``rate`` (tc syntax: ``1gbit``)
    with ``delay`` one way (tc syntax: ``100us``; needs netem)."""

    rate: str = "1gbit"
    delay: str = "100us"
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    latency_applied: bool = False
    """Whether netem added ``delay`` (False: the kernel lacks netem; the veth's own latency)."""

    @property
    def names(self) -> tuple[str, str]:
        return (f"zpA{self.tag}", f"zpB{self.tag}")

    @property
    def devices(self) -> tuple[str, str]:
        return (f"zpa{self.tag}", f"zpb{self.tag}")

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a process on ``node``."""
        return ["ip", "netns", "exec", self.names[node]]

    def __enter__(self) -> "ShapedNodes":
        if os.geteuid() != 0:
            raise LinkSetupError(f"network namespaces need root; running as uid {os.geteuid()}")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise LinkSetupError(f"{', '.join(missing)} not installed (apt-get install iproute2)")
        try:
            self._create()
        except BaseException:
            self._delete()
            raise
        return self

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self._delete()

    def _create(self) -> None:
        for name in self.names:
            _run("ip", "netns", "add", name)
        a, b = self.devices
        _run("ip", "link", "add", a, "netns", self.names[0], "type", "veth", "peer", "name", b, "netns", self.names[1])
        for name, dev, addr in zip(self.names, self.devices, ADDRESSES):
            _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", name, "link", "set", dev, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
        self.latency_applied = all(self._shape(name, dev) for name, dev in zip(self.names, self.devices))

    def _shape(self, name: str, dev: str) -> bool:
        """netem (delay + rate) when the kernel has it, else a token bucket at the rate; True: delay applied.
        The bucket holds 256 KiB (a 1 Gbit/s link refills it in 2 ms: at least one timer tick) and queues
        up to 50 ms of traffic (TCP backs off beyond it)."""
        netem = subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", dev, "root", "netem", "delay", self.delay,
                                "rate", self.rate, "limit", "100000"], capture_output=True, text=True, timeout=20)
        if netem.returncode == 0:
            return True
        _run("tc", "-n", name, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb",
             "latency", "50ms")
        return False

    def _delete(self) -> None:
        for name in self.names:  # deleting a namespace deletes its veth end, and with it the pair and its qdisc
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)

    def describe(self) -> str:
        latency = f"+{self.delay} one way (netem)" if self.latency_applied else "the veth's own latency (no netem)"
        return f"2 namespaces, veth {self.devices[0]}<->{self.devices[1]} shaped to {self.rate} each way, {latency}"


@dataclass
class UnshapedNodes:
    """The same two "nodes" without namespaces or shaping: every process on this host's loopback, for runs
    that need the layouts but not the slow link (a loss comparison). No root needed. The node map still
    comes from ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK``, so the groups are those of ``ShapedNodes``."""

    devices: tuple[str, str] = ("lo", "lo")
    latency_applied: bool = False

    def prefix(self, node: int) -> list[str]:
        """No prefix: every "node" is this host."""
        return []

    def __enter__(self) -> "UnshapedNodes":
        return self

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        return None

    def describe(self) -> str:
        return "2 nodes faked on this host's loopback, links not shaped (step times and link speeds mean nothing)"
