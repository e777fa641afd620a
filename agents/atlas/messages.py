"""Atlas's own messages, on the testbed's typed base (``testbed/messages.py``).

How it fits: the controller (``controller.py``) publishes each plan to the run as
``PlanPublished`` (the extension, ``extension.py``, passes each pipeline's start offset on to
its first stage as the core's ``StartOffset``) and to the gateway agents (``agent.py``) as
``AgentPlan``; it renews the agents' leases with ``Heartbeat`` and ends with ``Clear``.  The
worker timeline the controller reads is the core's ``Events``, forwarded with the worker's
name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from testbed.messages import Message, Record


@dataclass
class PlanPublished(Message):
    """A temporal plan, to the run (``TemporalPlan.as_dict()``: order, offsets, figures, basis)."""

    kind: ClassVar[str] = "atlas.plan"
    plan: dict


@dataclass
class LinkSchedule(Record):
    """One WAN direction's part of a plan: its classes (pipeline -> (src, dst) address pairs),
    the rank order, and the class queues (``"share"``: the link's queue split; None: sized by
    the delay line)."""

    classes: dict[str, list[list[str | None]]]
    order: list[str]
    queue_bytes: int | str | None = None


@dataclass
class AgentPlan(Message):
    """To a gateway agent: the plan of every link (``"src->dst"``); it applies its own."""

    kind: ClassVar[str] = "atlas.links"
    links: dict[str, LinkSchedule]


@dataclass
class Heartbeat(Message):
    kind: ClassVar[str] = "atlas.heartbeat"


@dataclass
class Clear(Message):
    """Back to fair sharing: the controller is done."""

    kind: ClassVar[str] = "atlas.clear"
