"""The simulator: ``build`` turns an experiment file into worker programs and links and a
simulated run into the same records a real run leaves (``testbed.results``); ``engine``
plays them out (a discrete-event, fluid-network model); ``tcpwindow`` is a channel's TCP
congestion window as Linux runs it (``sim.tcp_window_model``, on by default on hosts with
Linux's slow start after idle: ``build.window_model``); ``rounds`` sends a channel's
messages a window at a time into drop-tail FIFO queues (``sim.sharing: fifo-bursts`` with
the window model); ``packets`` sends every WAN message as TCP segments through the delay
lines and drop-tail queues, each connection Linux's CUBIC, HyStart, restart after idle and
loss recovery (``sim.sharing: packets``); ``device`` says how long each op takes on a device that is not there (a
real run's profile, fixed stage times or the FLOPs model: what emulated devices replay
too); ``validity`` holds, as data, where each part of the model was checked against the
emulator and whether a run lies there; ``cli`` is ``testbed sim`` (one run or a sweep)."""
