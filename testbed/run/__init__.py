"""Running a workload on the emulated WAN.  A ``lab`` is one network with one lifecycle for
it and what runs in it; ``labserver`` is the process that keeps one up (``testbed up``) and
its client, ``labcli`` their commands.  Workloads on a lab: the training run (``runner``),
a user's own torch.distributed job (``torchrun``), comparisons of variants (``compare``) and
fault injection (``chaos``).  ``site`` is the written interface between a run and where it
runs, one machine or several; ``procs`` starts processes in hosts; ``hub`` is a run's
telemetry socket.  ``devices`` holds the core's device kinds (cpu, cuda, emulated, auto),
plug-ins of the registry like any extension's; emulated devices' times come from
``testbed.sim.device``.  What a run leaves behind is in ``testbed.results``.  Extensions plug in through ``testbed.extension``,
and a run drives those it uses through the ``hooks``; this package names none of them."""
