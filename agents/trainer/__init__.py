"""The training workload: a GPT cut into pipeline stages across DCs (see worker.py)."""
