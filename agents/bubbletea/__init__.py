"""BubbleTea: prefill-as-a-service in the bubbles of pipeline training.

How the pieces fit: ``plugin`` declares BubbleTea to the testbed (its experiment section and
its run); ``extension`` plugs BubbleTea into a training run (it starts the
processes and folds their results into the run's summary); ``controller`` (a process) admits
requests from the ``workload`` (Azure LLM traces or Poisson) and places them in the bubbles
``predictor`` foresees from the workers' live telemetry; one prefill ``server`` per training
worker runs them chunk by chunk on the worker's device (at idle priority on CPUs) and ships
the KV cache to a ``decode`` worker; ``inference`` is the served model; ``config`` holds what
each process is started with; ``messages`` the kinds its processes exchange (typed, on the
testbed's base).  On emulated devices the server and decode worker run no model:
they occupy their emulated device for the times ``profile`` measured once (a JSON file in
``data/``) and ``timing`` reads back.  ``backtoback`` measures the headline figures: the same
job with BubbleTea off and on, alternated.
"""
