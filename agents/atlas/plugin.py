"""Atlas as the testbed sees it: its experiment section, its run, its command, its faults.

How it fits: pyproject's ``testbed.extensions`` entry point names ``EXTENSION``; the core
finds everything below through it (``testbed.extension``).  ``AtlasSpec`` is the ``atlas:``
section of an experiment file; a ``compare:`` arm may set its sharing (``sharing:
temporal``).  A run that shares the WAN other than fairly starts ``extension.AtlasExtension``
(the controller and the gateway agents); ``testbed plan`` is the planner's command
(``cli.plan``); ``testbed chaos`` may kill an agent or the controller, after which training
must go on under fair sharing; ``compare:`` predicts an Atlas variant with the plan its
controller published (``extension.predict_options``); ``testbed torchrun --with atlas=FILE``
shares a user's own job's WAN links among its pipelines (``lab.AtlasJob``).  Light imports
only: this module is read whenever an experiment is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from testbed.extension import Extension, ProcessFault, Section


class AtlasSpec(Section):
    """How DP pipelines share the WAN (``agents/atlas``)."""

    sharing: Literal["fair", "temporal", "paced"] = Field(
        "fair", description="fair: TCP fair-shares each link (lockstep pipelines); temporal: the Atlas "
                            "controller staggers the pipelines and gateway agents give each link to one "
                            "pipeline at a time; paced: only the senders act (the stagger, no agents)")
    lease_s: float = Field(2.0, gt=0, le=60, description="an agent's or controller's silence after which "
                                                            "its links fall back to fair sharing")
    replan_threshold: float = Field(0.1, gt=0, description="republish the plan when it moves by this fraction")
    class_queue: Literal["deep", "share"] = Field(
        "deep", description="the pipelines' queues at an enforcing gateway: deep = 4 x the path's BDP each "
                            "(a waiting pipeline loses nothing); share = the link's own queue split among them "
                            "(the same buffering as a FIFO link: compare at equal buffer depth)")
    enforce: Literal["gateway", "senders"] = Field(
        "gateway", description="where temporal sharing's turns are taken: gateway = the delay line's per-pipeline "
                               "scheduler on the WAN egress (any job's traffic); senders = each pipeline's "
                               "writer waits for its turn from its DC's agent (the testbed's trainer only), so "
                               "nothing of a waiting pipeline is queued or dropped in the network")
    plan: Literal["telemetry", "fixed"] = Field(
        "telemetry", description="telemetry: the turn order follows the pipelines' measured compute (the slowest "
                                 "first) and readiness; fixed: r0, r1, ... whatever the workload (the ablation)")

    def in_use(self) -> bool:
        return self.sharing != "fair"


def _agent_targets(exp) -> list[str]:
    return [f"agent-{dc}" for dc in sorted({s.dc for s in exp.workers()})]


_CONTINUES = "completes with every iteration and the same losses; the log says training continues under fair sharing"

EXTENSION = Extension(
    name="atlas",
    section=AtlasSpec,
    variant_keys={"sharing": "sharing"},
    run="agents.atlas.extension:AtlasExtension",
    commands={"plan": "agents.atlas.cli:plan"},
    faults={
        "kill-atlas-agent": ProcessFault(_CONTINUES, _agent_targets),
        "kill-atlas-controller": ProcessFault(_CONTINUES, lambda exp: ["controller"]),
    },
    predict="agents.atlas.extension:predict_options",
    simulate="agents.atlas.extension:simulate_options",
    lab="agents.atlas.lab:AtlasJob",
    # its controller plans on the wall clock from wall-clock telemetry and the wire's links, and
    # its plans are recorded in emulated terms (extension._emulated_plan)
    dilates=True,
    # its processes run where the site puts them (near a DC), over Launcher.socket paths and
    # the links' delay-line calls: testbed run --inventory runs it across machines
    across_machines=True,
)
