"""Geo-distributed training testbed.

How the pieces fit, bottom up (each package imports only those listed before it):

* ``spec``: what a user writes, validated (topologies, experiments, the AWS matrix, the
  model's shape, pipeline schedules);
* ``registry``: everything the testbed makes, written down as it is made, so ``testbed
  clean`` can always remove it; ``procutil``: ending a set of processes and the datagram
  client to a process's control socket, which ``net`` and ``run`` both use;
* ``net``: the emulated WAN (Mininet hosts behind gateways, links shaped by tc and the
  delay line) and the instruments that measure it against its spec;
* ``extension``: the one registry through which extensions (``agents/``: Atlas, BubbleTea,
  Titan, a third party's) plug in, found by the ``testbed.extensions`` entry points;
* ``train``: the training workload, a GPT cut into pipeline stages (what each worker
  process runs);
* ``run``: a workload on the WAN: processes in hosts, their telemetry, records, metrics,
  comparisons, fault injection; ``cluster``: the same across several machines;
* ``sim``: the simulator, from the same experiment files;
* ``tools``: provisioning (Ansible) and the netem VM; ``cli``: the ``testbed`` command
  (``cliutil``: the one-line errors and the Ctrl-C/SIGTERM unwinding every command shares).
"""

__version__ = "0.1.0"
