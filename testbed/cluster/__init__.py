"""Runs across several machines: each DC group on its own server, WAN links between servers as VXLANs.

How the pieces fit: ``inventory`` reads the Ansible inventory and places each DC on a
machine; ``plays`` runs ``playbooks/cluster.yml`` (start the leased agents, fetch logs,
clean); ``agent`` is ``testbed machine-agent``, one machine's part of a run; ``wire`` is
the JSON-lines protocol between them; ``remote`` is the orchestrator's side (agents,
clocks, and a ``ClusterNetwork`` / ``ClusterSite`` that ``runner`` and ``fidelity`` use as
they use one machine's network: the protocols of ``run.site`` and ``net.surface``); ``fake`` makes a fake cluster of namespaces with sshd, so
the same code path runs in CI.
"""
