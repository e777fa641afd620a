"""Geo-distributed training testbed.

How the pieces fit, bottom up (each package imports only those listed before it):

* ``extension``: the one registry through which extensions (``agents/``, a third party's
  package) plug in, found by the ``testbed.extensions`` entry points: their experiment
  sections, run hooks, commands, faults and predictions;
* ``messages``: one typed protocol for every message between the testbed's processes
  (telemetry, the delay line's control, the cluster wire): a dataclass per kind, one
  ``kind`` key on the wire, JSON encode/decode with one-line errors (standard library only,
  so every process imports it cheaply; extensions add their kinds on the same base);
* ``spec``: what a user writes, validated (topologies, experiments, the AWS matrix, the
  model's shape, pipeline schedules);
* ``registry``: everything the testbed makes, written down as it is made, so ``testbed
  clean`` can always remove it; ``procutil``: ending a set of processes and the datagram
  client to a process's control socket, which ``net`` and ``run`` both use;
* ``net``: the emulated WAN (Mininet hosts behind gateways, links shaped by tc and the
  delay line) and the instruments that measure it against its spec;
* ``train``: the training workload, a GPT cut into pipeline stages (what each worker
  process runs);
* ``results``: what a run leaves behind (records) and the figures made from it (metrics),
  the same for a real run and a simulated one;
* ``sim``: the simulator, from the same experiment files, and device time for devices that
  are not there;
* ``run``: a workload on the WAN: processes in hosts, their telemetry, comparisons, fault
  injection;
* ``tools``: provisioning (Ansible) and the netem VM;
* ``cluster``: runs across several machines (provisioned by ``tools``);
* ``cli``: the ``testbed`` command (``cliutil``, low enough for every part: the one-line
  errors and the Ctrl-C/SIGTERM unwinding every command shares).
"""

__version__ = "0.1.0"
