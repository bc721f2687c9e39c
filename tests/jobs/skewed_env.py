"""Run a command with NCCL_P2P_DISABLE=1 on one local rank only (``SKEW_RANK``, default 3): a rank started
with different NCCL settings than its peers, as in the multi-node GRPO field report."""

import os
import sys

if os.environ.get("LOCAL_RANK") == os.environ.get("SKEW_RANK", "3"):
    os.environ["NCCL_P2P_DISABLE"] = "1"
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
