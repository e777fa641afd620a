"""Geo-distributed training testbed.

How the pieces fit.  *Specs*: ``spec`` reads and validates topology files and
``experiment`` experiment files (placement included); ``awsmatrix`` writes topologies from
the measured AWS matrix; ``modelshape`` and ``schedules`` are the torch-free shape of the
model and the pipeline schedules, shared by the trainer and the simulator.  *The network*:
``kernel`` probes what this kernel offers and picks a backend per feature; ``network``
builds the DCs (Mininet hosts, Linux bridges, gateway routers) and the WAN links between
them, shaping each direction with ``shaping`` (tc through pyroute2) and, without netem, the
userspace ``delayline``; ``registry`` records everything made so ``testbed clean`` can
remove it; ``fidelity`` (with the ``owd`` and ``goodput`` probes) measures a built network
against its spec; ``tcpwindow`` holds a connection's window at exactly N bytes (the goodput
probe's and the training transport's window cap).
*A run*: ``runner`` owns one training run: it launches processes through ``procs`` (CPU
containers, start, stop), talks to them through the ``hub``, and drives every ``extension``
(Atlas, BubbleTea) through the same hooks; ``emulation`` gives emulated devices
(``device: emulated``) their op times; ``records`` are what a run (or the simulator,
``sim``) leaves behind, and ``metrics`` turns them into metrics.json, a Chrome trace and
plots; ``compare`` runs an experiment's variants back to back.  *Around it*: ``provision``
runs the Ansible playbook, ``chaos`` injects faults into short real runs and judges how
they ended, ``cli`` is the ``testbed`` command (``cliutil``: the one-line errors and the
Ctrl-C/SIGTERM unwinding every command shares), and ``vm`` (by hand: ``vmcli``, ``testbed
vm``) boots a throwaway VM with Debian's stock kernel, where the netem backend runs on a
machine whose kernel has none.
"""

__version__ = "0.1.0"
