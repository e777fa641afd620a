"""The emulated WAN: DCs of hosts behind gateways joined by shaped links (``network``), the
traffic control on a link (``shaping``), the userspace delay line where the kernel has no
netem (``delayline``), what the kernel offers (``kernel``), and the instruments that measure a
built network against its spec (``fidelity`` with ``owd`` and ``goodput``; ``tcpwindow`` clamps
a connection's window; ``tcpinfo`` reads a connection's ``struct tcp_info`` (the transport's
per-message trace); ``tcpmodel`` says what a TCP connection sustains under random loss, for
fidelity and the simulator; ``sendturns`` hands a WAN direction to one sender at a time).  ``surface`` writes down what a built network offers runs and
instruments, on one machine or several (``NetworkSurface``).  It knows topologies
(``testbed.spec``), never runs or workloads."""
