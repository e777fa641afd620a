"""Geo-distributed training testbed.

How the pieces fit: ``spec`` reads and validates topology files; ``kernel`` probes what
this kernel offers and picks a backend per feature; ``network`` builds the DCs (Mininet
hosts, Linux bridges, gateway routers) and the WAN links between them, shaping each
direction with ``shaping`` (tc through pyroute2) and, without netem, the userspace
``delayline``; ``registry`` records everything made so ``testbed clean`` can remove it;
``fidelity`` measures a built network against its spec; ``cli`` is the ``testbed`` command.
"""

__version__ = "0.1.0"
