"""Titan and Titan-Next: conferencing traffic offloaded from the private WAN to Internet paths.

A reconstruction of "Saving Private WAN" (arXiv 2407.02037; only its abstract is public, so
the formulation is ours and stated where it is made).  How the pieces fit:

* ``data/``: Azure's published P95 RTT matrix, region locations, Teams' bitrates and network
  targets (CC BY 4.0, copied with attribution), plus our time-zone table and the measured
  Internet-minus-WAN latency by region group.
* ``regions.py``: the regions, the backbone pruned from the matrix (relay rule), Internet
  paths (latency from the group comparison; assumed loss/jitter), and a ``World`` (users x DCs).
* ``workload.py``: synthetic calls (diurnal by time zone, Poisson, 2-4 participants with a
  heavy tail, audio/video/HD at Teams' bitrates) and per-slot demand and forecasts.
* ``placement.py``: the latency rule's allowed placements per call configuration, plans,
  quota-counter realisation with migrations, and evaluation (link loads, peaks, RTTs).
* ``lp.py``: Titan-Next's LP (sum of WAN-link peaks, DC capacity, Internet share caps,
  latency tie-break re-solve) and its WAN-only variant, with HiGHS.
* ``controller.py``: Titan's per-path offload controller (raise while quality holds, back off
  within a bounded number of steps).
* ``study.py`` / ``plots.py``: the offline week at scale, every baseline, JSON/CSV/plots.
* ``emunet.py``, ``media.py``, ``routecheck.py``, ``emulate.py``: the emulated dual-path
  network (a testbed ``Lab`` for the WAN, with an Internet hub, DSCP marks and policy
  routing built on it; every process started through the lab's launcher), real UDP calls
  measured at the receivers, per-link load from counters, per-stream route checks; ``messages.py``:
  what the emulation says to the agents (typed, on the testbed's base).
* ``cli.py``: ``testbed titan study | emulate | backbone``; ``plugin.py`` declares it to the
  testbed (the ``testbed.extensions`` entry point).
"""
