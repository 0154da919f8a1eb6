"""A process leaves its gloo group for good (the cause of CI's SIGABRT at exit, issue 25).

torch.distributed.nn's collectives take ``group=group.WORLD`` as a default argument. Imported after
``init_process_group`` (torch.optim imports it through torch._dynamo when the first optimizer is built),
those defaults keep the group alive after ``destroy_process_group()``: gloo's threads and the TCPStore
server ran on into interpreter shutdown, where a rank now and then aborted with ``terminate called
without an active exception``. memfit's ``finish()`` drops those references, so the threads are gone
before the interpreter shuts down.
"""

import subprocess
import sys

CHILD = r"""
import os, sys
import torch, torch.distributed as dist
from memfit.distributed.launch import free_port

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
import torch.distributed.nn  # after the group, as torch.optim's first optimizer does
t = torch.ones(4)
dist.all_reduce(t)
if sys.argv[1] == "finish":
    from memfit.distributed.ranks import finish
    finish()
else:
    dist.destroy_process_group()
import time

def alive():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)

for _ in range(30):  # the TCPStore's loop thread ends a moment after the store is freed
    if not alive():
        break
    time.sleep(0.1)
print(",".join(alive()))
"""


def _gloo_threads_after(mode: str) -> str:
    p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""


def test_finish_stops_gloo_threads_a_bare_destroy_leaves_running():
    assert "pt_gloo_runloop" in _gloo_threads_after("destroy")  # the cause, as torch 2.13 behaves
    assert _gloo_threads_after("finish") == ""
