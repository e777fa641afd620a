"""The training workload: a GPT cut into pipeline stages across DCs.

How the pieces fit: ``worker`` is one pipeline stage of one DP replica (a process the run
starts from a ``config``); ``model`` builds the GPT and its stages; ``data`` cuts the corpus
into the same global batch whatever the parallelism; ``transport`` carries activations and
gradients over N TCP connections per boundary; ``waitboard`` shows the wait under way to a
co-tenant; ``reference`` trains the same model in one process (for loss parity);
``codec`` turns tensors into the bytes a channel carries and ``ring`` all-reduces them among
the replicas of a stage; ``device`` is the device a worker computes on (``torch_compute``:
PyTorch on a CPU or GPU; ``emulated``: profiled time on a device that computes nothing);
``telemetry`` is the worker's line to the orchestrator.
"""
