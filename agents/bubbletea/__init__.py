"""BubbleTea: prefill-as-a-service in the bubbles of pipeline training.

How the pieces fit: ``extension`` plugs BubbleTea into a training run (it starts the
processes and folds their results into the run's summary); ``controller`` (a process) admits
requests from the ``workload`` (Azure LLM traces or Poisson) and places them in the bubbles
``predictor`` foresees from the workers' live telemetry; one prefill ``server`` per training
worker runs them chunk by chunk on the worker's device at idle priority and ships the KV
cache to a ``decode`` worker; ``inference`` is the served model; ``config`` holds what each
process is started with.
"""
