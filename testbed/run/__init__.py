"""Running a workload on the emulated WAN: the training run (``runner``), the processes it
starts in hosts (``procs``), their telemetry hub (``hub``), what a run records (``records``)
and the figures made from it (``metrics``), emulated devices (``emulation``), comparisons of
variants (``compare``) and fault injection (``chaos``); a lab with one lifecycle for a
network and what runs in it (``lab``), the process that keeps one up and its client
(``labserver``), their commands (``labcli``) and a user's own torch.distributed job on a lab
(``torchrun``).  Extensions plug in through
``testbed.extension``; this package names none of them."""
