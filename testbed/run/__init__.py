"""Running a workload on the emulated WAN: the training run (``runner``), the processes it
starts in hosts (``procs``), their telemetry hub (``hub``), what a run records (``records``)
and the figures made from it (``metrics``), emulated devices (``emulation``), comparisons of
variants (``compare``) and fault injection (``chaos``).  Extensions plug in through
``testbed.extension``, and a run drives those it uses through the ``hooks``; this package
names none of them."""
