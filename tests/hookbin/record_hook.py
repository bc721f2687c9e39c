#!/usr/bin/env python3
"""A restart hook for tests: appends its argv to RECORD, creates RECORD.started, sleeps, appends "done".

    record_hook.py RECORD SLEEP_S [ARGS...]
"""

import json
import os
import sys
import time

record, sleep_s, rest = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
with open(record, "a") as f:
    f.write(json.dumps({"argv": rest, "pid": os.getpid(), "env_level": os.environ.get("GPU_WATCHDOG_LEVEL"),
                        "fallback_file": os.environ.get("GPU_WATCHDOG_FALLBACK_FILE")}) + "\n")
open(record + ".started", "w").close()
time.sleep(sleep_s)
with open(record, "a") as f:
    f.write(json.dumps({"done": True}) + "\n")
sys.exit(int(os.environ.get("HOOK_EXIT", "0")))
