"""Running a workload on the emulated WAN: the training run (``runner``), the processes it
starts in hosts (``procs``), their telemetry hub (``hub``), comparisons of variants
(``compare``) and fault injection (``chaos``).  What a run leaves behind is in
``testbed.results``; emulated devices' times come from ``testbed.sim.device``.  Extensions
plug in through ``testbed.extension``, and a run drives those it uses through the ``hooks``;
this package names none of them."""
