"""BubbleTea as the testbed sees it: its experiment section and its run.

How it fits: pyproject's ``testbed.extensions`` entry point names ``EXTENSION``; the core
finds everything below through it (``testbed.extension``).  ``BubbleTeaSpec`` is the
``bubbletea:`` section of an experiment file (checked against the topology by ``_check``);
a run with ``enabled: true`` starts ``extension.BubbleTeaExtension`` (the controller, a
prefill server per worker, the decode workers).  Light imports only: this module is read
whenever an experiment is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from testbed.extension import Extension, Section


class BubbleModelSpec(Section):
    layers: int = Field(2, ge=1, le=64)
    hidden: int = Field(64, ge=8, le=4096)
    heads: int = Field(4, ge=1, le=64)
    max_context: int = Field(512, ge=16, le=8192)


class BubbleTeaSpec(Section):
    """Prefill-as-a-service in the pipeline's bubbles (``agents/bubbletea``)."""

    enabled: bool = False
    source: Literal["conv", "code", "poisson"] = Field("conv", description="Azure trace or a Poisson source")
    rate_scale: float = Field(1.0, gt=0, description="trace arrival rate x this")
    token_scale: float = Field(0.1, gt=0, description="trace prompt and output lengths x this")
    rate_per_s: float = Field(5.0, gt=0, description="Poisson arrivals per second")
    duration_s: float = Field(600.0, gt=0, description="workload length (the run ends it earlier)")
    max_prompt_tokens: int = Field(256, ge=1)
    max_output_tokens: int = Field(16, ge=1)
    slo_ttft_s: float = Field(2.0, gt=0, description="a request not prefilled within this is rejected")
    slo_tbt_s: float | None = Field(None, gt=0, description="goodput also asks a request's mean time between "
                                                            "tokens to be within this (None: TTFT only)")
    margin_s: float = Field(0.006, ge=0, description="kept free before a predicted bubble's end (>= one "
                                                        "5 ms CFS period: the quota a prefill used is gone)")
    margin_frac: float = Field(0.03, ge=0, lt=1, description="... or this fraction of the bubble, the larger")
    chunk_tokens: int = Field(32, ge=1, description="prefill chunk: the points where a prefill can stop")
    dispatch_ahead: bool = Field(True, description="an idle server outside a bubble gets the jobs for its worker's "
                                                   "next wait ahead, and starts them when the wait board shows it "
                                                   "begin (no round trip through the controller per bubble)")
    interleave: bool = Field(True, description="serve every other steady iteration only: the same run "
                                               "measures training with and without prefills")
    decode_dc: str | None = Field(None, description="one decode worker, in this DC, for all prefills "
                                                    "(default: one per DC, so KV caches stay off the WAN)")
    control: bool = Field(False, description="device: emulated: the prefill chunks run on a device of their own, "
                                             "not the worker's (everything else as when on): the host's share of "
                                             "the slowdown, measured apart from the device's")
    model: BubbleModelSpec = Field(default_factory=BubbleModelSpec)
    serving_profile: str | None = Field(
        None, description="device: emulated: prefill and decode times of the model above "
                          "(agents/bubbletea/profile.py's JSON); default the one shipped for this machine's CPU")

    def in_use(self) -> bool:
        return self.enabled


def _check(exp, origin: str) -> None:
    from testbed.spec.topology import SpecError, one_line

    if exp.bubbletea.control and exp.device != "emulated":
        raise SpecError(one_line(f"{origin}: bubbletea.control needs device: emulated (a CPU's or a GPU's "
                                 f"prefills cannot be moved off the worker's device)"))
    decode_dc, topo = exp.bubbletea.decode_dc, exp.topo
    if decode_dc is not None and decode_dc not in {dc.name for dc in topo.dcs}:
        raise SpecError(one_line(f"{origin}: bubbletea.decode_dc: no DC {decode_dc!r} in topology {topo.name} "
                                 f"({', '.join(dc.name for dc in topo.dcs)})"))


EXTENSION = Extension(
    name="bubbletea",
    section=BubbleTeaSpec,
    check=_check,
    run="agents.bubbletea.extension:BubbleTeaExtension",
    # its processes get wall-clock inputs (profile, SLOs, margin, arrivals x k) and its results
    # are recorded in emulated terms (extension.emulated_results)
    dilates=True,
    # its processes run where the site puts them (near a DC), over Launcher.socket paths and
    # the links' delay-line calls: testbed run --inventory runs it across machines
    across_machines=True,
)
