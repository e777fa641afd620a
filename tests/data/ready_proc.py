"""A stand-in for a testbed process, for the launcher's tests: ``python -m
tests.data.ready_proc CONFIG.json`` waits ``delay_s``, prints the lines of ``say`` (each
flushed), then exits with ``exit`` if given, else sleeps until it is ended."""

import json
import sys
import time

cfg = json.loads(open(sys.argv[1]).read())
time.sleep(cfg.get("delay_s", 0.0))
for line in cfg.get("say", []):
    print(line, flush=True)
if cfg.get("exit") is not None:
    sys.exit(cfg["exit"])
while True:
    time.sleep(60)
