"""Runs across several machines: each DC group on its own server, WAN links between servers as VXLANs.

How the pieces fit: ``inventory`` reads the Ansible inventory and places each DC on a
machine (and how SSH reaches it); ``build`` names the orchestrator's own build and packs it;
``plays`` runs ``playbooks/cluster.yml`` (install that build on the machines, clean them);
``agent`` is ``testbed machine-agent``, one machine's part of a run, started over SSH from
the build; ``wire`` is the JSON-lines protocol between them on the SSH session's
stdin/stdout; ``remote`` is the orchestrator's side (agents, clocks, and a
``ClusterNetwork`` / ``ClusterSite`` that ``runner`` and ``fidelity`` use as they use one
machine's network: the protocols of ``run.site`` and ``net.surface``); ``jobs`` is
``testbed torchrun --inventory`` (the ``run.lab.LabHandle`` that ``run.torchrun`` drives,
across machines: the user's script folder copied to each machine, ranks started and heard
from through the agents); ``fake`` makes a fake cluster of namespaces with sshd, so the same
code path runs in CI.
"""
