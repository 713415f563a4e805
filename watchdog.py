"""The rollout watchdog: `deadline(what, timeout_s)` around every blocking engine call (rollout.py's vLLM engine,
hf_rollout.py's), so a stuck call ends in a TimeoutError naming it, or in stack dumps and an exit (no silent hang).

    with watchdog.deadline("generate", cfg.timeout_s):
        outputs = llm.generate(...)
"""

from __future__ import annotations

import _thread
import contextlib
import faulthandler
import threading
import time
from collections.abc import Iterator

HARD_EXIT_GRACE_S = 60.0  # after a timeout, how long an uninterruptible call gets before the process exits


@contextlib.contextmanager
def deadline(what: str, timeout_s: float) -> Iterator[None]:
    """TimeoutError in the main thread when the block outlives `timeout_s`; a hard exit if that cannot land.

    A Timer thread calls `_thread.interrupt_main()`, which raises at the main thread's next Python bytecode (vLLM's
    engine loop and HF generate are Python loops). For a call stuck in C code (a hung collective), faulthandler's
    C watchdog dumps every stack and exits `HARD_EXIT_GRACE_S` later. faulthandler has one process-wide deadline:
    the block owns it. An interrupt that the block swallowed (one landing in a finalizer is only printed) still
    ends in the TimeoutError when the block returns; one still pending then is taken here, not left to land later.
    """
    if threading.current_thread() is not threading.main_thread():
        # A background call (rollout.async_steps=1): an interrupt would land in the main thread's training, so only
        # the hard-exit watchdog guards it; the main thread waits on it under its own timeout (rl.RolloutAhead).
        faulthandler.dump_traceback_later(timeout_s + HARD_EXIT_GRACE_S, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
        return
    lock, state = threading.Lock(), {"done": False, "fired": False}

    def fire() -> None:
        with lock:  # once the block is done no interrupt is sent; once one is sent the block reports it
            if state["done"]:
                return
            state["fired"] = True
            print(f"rollout: {what} still running after {timeout_s:.0f}s; interrupting", flush=True)
            _thread.interrupt_main()

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    faulthandler.dump_traceback_later(timeout_s + HARD_EXIT_GRACE_S, exit=True)
    timer.start()
    timed_out = TimeoutError(f"rollout: {what} did not finish within timeout_s={timeout_s:.0f}s")
    try:
        yield
        # Returned although interrupted: the interrupt was swallowed, or is still pending; a pending one lands at
        # one of these bytecodes, and the except below takes it.
        if state["fired"]:
            for _ in range(100):
                time.sleep(0)
            raise timed_out
    except KeyboardInterrupt:
        if state["fired"]:
            raise timed_out from None
        raise
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
