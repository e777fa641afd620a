"""Atlas: DC selection, many-connection WAN transfers, and temporal bandwidth sharing.

How the pieces fit: ``planner`` picks DCs and stage boundaries (the paper's Algorithm 1
plus a what-if search scored by the simulator); ``plan`` turns the trainer's measured
compute times and transfer sizes into a temporal plan (who owns each WAN link, in which
order, with which start offsets); ``controller`` (a process) reads the run's live telemetry
and publishes that plan; one ``agent`` per WAN gateway (a process) enforces it on the
gateway's egress through the delay line's strict-priority scheduler, under a lease so a
dead agent or controller leaves plain fair sharing behind; ``precision`` measures how
exactly a link follows a plan.  ``extension`` plugs the controller and agents into a
training run; ``lab`` does temporal sharing for a user's own ``testbed torchrun`` job
(pipelines and their order given by the user, no controller); ``config`` holds what each
process is started with; ``messages`` what the processes say to each other; ``plugin`` declares all of it to the testbed (its experiment
section, run, ``testbed plan`` from ``cli``, chaos faults, the torchrun hook).
"""
