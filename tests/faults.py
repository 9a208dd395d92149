"""Fault injection for the lifecycle tests, installed from outside the training code: the job
loads this file through ``MOETRAIN_FAULT_HOOK`` (set by conftest.py for every process the tests
start) and calls :func:`install`, which reads the test's variables:

* ``MOETRAIN_TEST_HANG="<rank>:<step>"`` — that rank hangs at the start of that step;
* ``MOETRAIN_TEST_SLOW="<seconds>:<attempts>"`` — attempts with a restart count below
  ``attempts`` idle that long before each step, so that a test's signal, preemption or node
  failure lands mid-run;
* ``MOETRAIN_TEST_KILL="<rank>:<step>"`` — in the first attempt, that rank SIGKILLs itself in the
  forward pass of that step (mid-step).
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger("moetrain")


def install(trainer, rank: int, restart: int) -> None:
    hang, slow, kill = (os.environ.get(f"MOETRAIN_TEST_{k}") for k in ("HANG", "SLOW", "KILL"))
    hang_at = int(hang.split(":")[1]) if hang and int(hang.split(":")[0]) == rank else None
    delay = float(slow.split(":")[0]) if slow and restart < int(slow.split(":")[1]) else 0.0

    def before_step(step: int) -> None:
        if step == hang_at:
            log.warning("fault injection: hanging at step %d", step)
            while True:
                time.sleep(3600)
        if delay:
            time.sleep(delay)

    if hang_at is not None or delay:
        trainer.before_step = before_step
    if kill and int(kill.split(":")[0]) == rank and restart == 0:
        step = int(kill.split(":")[1])

        def sigkill(module, args) -> None:
            if trainer.step == step - 1:
                log.warning("fault injection: SIGKILL in step %d", step)
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.model_parts[0].register_forward_pre_hook(sigkill)
