"""What a run leaves behind, the same for a real run and a simulated one: the typed
``records`` (workers' timelines, transfers, iterations) and the ``metrics`` made from them
(metrics.json, the Chrome trace, plots), with the run's ``provenance`` (the resolved spec,
the commit, the versions, the machine).  ``testbed.run`` and ``testbed.sim`` both write
them; neither is imported here."""
