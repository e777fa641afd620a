"""Running a workload on the emulated WAN: the training run (``runner``), the written
interface between a run and where it runs, one machine or several (``site``), the processes
it starts in hosts (``procs``), their telemetry hub (``hub``), what a run records (``records``)
and the figures made from it (``metrics``), emulated devices (``emulation``), comparisons of
variants (``compare``) and fault injection (``chaos``).  Extensions plug in through
``testbed.extension``; this package names none of them."""
