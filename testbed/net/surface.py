"""What a built network offers the code that uses it, written down: the same on one machine
(``network.Network``) and across several (``cluster.remote.ClusterNetwork``).

How it fits: ``fidelity`` measures, and ``run.runner`` trains on, whatever satisfies
``NetworkSurface``; neither names the concrete class.  The surface is what they use and no
more: the hosts by DC (``hosts``, ``host``: the ``HostIndex`` both sides share), each host's
``node`` (``Node``: run a shell command, start a process), the WAN directions (``link``,
``links``: a ``Link`` with its parameters and its counters), processes started in a host
(``popen``, a ``HostProcess``: as much of ``subprocess.Popen`` as callers use), the hosts'
TCP counters, a direction's state, ``check`` (raise when the network broke under a run),
the one-way clock correction between two hosts, and the lifecycle (``start``, ``stop``,
a context manager).  What only one machine has (changing a link in place, traffic classes,
cutting a link, the registry) stays on ``network.Network``; a caller that needs it names it.

``run.site`` holds the rest of the written interface between one machine and several (the
site, launcher, processes, hub and containers); this part lives here so that ``net`` never
imports ``run``.  ``NetworkError``, ``HostInfo`` and ``HostIndex`` are here because both
sides use them (``network`` re-exports them under their old names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, TypeVar, runtime_checkable

from testbed.spec.topology import Direction, Topology


class NetworkError(RuntimeError):
    """The network could not be built or driven; the message is one line."""


@runtime_checkable
class HostProcess(Protocol):
    """A process started in a host: what callers use of ``subprocess.Popen`` (a Popen here,
    ``cluster.remote.RemotePopen`` on another machine)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> Any:
        """With ``stdout=subprocess.PIPE``: ``readline()`` and ``read()``."""
        ...

    @property
    def stderr(self) -> Any: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def communicate(self, *, timeout: float | None = None) -> tuple[Any, Any]: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@runtime_checkable
class Node(Protocol):
    """A host or gateway: a Mininet node here, ``cluster.remote.RemoteNode`` elsewhere."""

    @property
    def name(self) -> str: ...

    def cmd(self, command: str) -> str: ...

    def popen(self, argv: list[str], **kwargs: Any) -> HostProcess: ...


@dataclass
class HostInfo:
    dc: str
    index: int  # 0-based within its DC
    name: str
    ip: str
    node: Node  # a mininet.node.Host, or a RemoteNode across machines


class HostIndex:
    """The hosts of a network by DC (``_hosts``): what ``Network`` and, across machines,
    ``cluster.remote.ClusterNetwork`` answer alike."""

    _hosts: dict[str, list[HostInfo]]

    def hosts(self, dc: str | None = None) -> list[HostInfo]:
        """The hosts of ``dc``, or of every DC in the topology's order."""
        if dc is not None:
            return self._hosts[dc]
        return [h for dc_hosts in self._hosts.values() for h in dc_hosts]

    def host(self, dc: str, index: int = 0) -> HostInfo:
        try:
            return self._hosts[dc][index]
        except (KeyError, IndexError):
            raise NetworkError(f"no host {index} in DC {dc!r}") from None

    def owd_correction_ms(self, src: HostInfo, dst: HostInfo) -> float:
        """What a one-way probe src -> dst reads too much by: on one machine nothing (every
        namespace reads the same clock)."""
        return 0.0


@runtime_checkable
class Link(Protocol):
    """One direction of a WAN link: ``network.WanDirection`` here, a handle through the
    sending gateway's machine agent across machines."""

    @property
    def src(self) -> str: ...

    @property
    def dst(self) -> str: ...

    @property
    def params(self) -> Direction: ...

    def counters(self) -> Any:
        """A ``shaping.Counters`` sample (``time`` on this orchestrator's clock)."""
        ...


class BackendsView(Protocol):
    """Which backend emulates delay, loss and rate (``kernel.Backends``)."""

    @property
    def delay(self) -> str: ...

    @property
    def loss(self) -> str: ...

    @property
    def rate(self) -> str: ...


_Net = TypeVar("_Net", bound="NetworkSurface")


@runtime_checkable
class NetworkSurface(Protocol):
    """A network built from ``topo``, as runs and instruments use it."""

    @property
    def topo(self) -> Topology: ...

    @property
    def startup_s(self) -> float:
        """How long ``start`` took."""
        ...

    @property
    def started(self) -> bool: ...

    @property
    def backends(self) -> BackendsView | None:
        """Which backends emulate the links (None across machines until it is built)."""
        ...

    def start(self: _Net) -> _Net: ...

    def stop(self) -> None: ...

    def __enter__(self: _Net) -> _Net: ...

    def __exit__(self, *exc: Any) -> None: ...

    def hosts(self, dc: str | None = None) -> list[HostInfo]: ...

    def host(self, dc: str, index: int = 0) -> HostInfo: ...

    def link(self, src: str, dst: str) -> Link: ...

    def links(self) -> Sequence[Link]: ...

    def popen(self, host: HostInfo, cmd: list[str], **kwargs: Any) -> HostProcess:
        """Start ``cmd`` in ``host``; ended with the network at the latest."""
        ...

    def owd_correction_ms(self, src: HostInfo, dst: HostInfo) -> float: ...

    def tcp_counters(self) -> dict[str, dict[str, int]]:
        """Per host name, its namespace's TCP counters (segments out, retransmitted, ...)."""
        ...

    def link_state(self, src: str, dst: str) -> str:
        """"up", "down" or why not (a dead delay line) for the direction src -> dst."""
        ...

    def check(self) -> None:
        """Raise ``NetworkError`` when the network broke under a run (a dead delay line, a
        machine gone)."""
        ...
