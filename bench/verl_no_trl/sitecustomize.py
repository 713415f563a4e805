"""Start-up hooks for the verl peer's processes (bench/e2e_verl.py puts this folder first on their PYTHONPATH, so
Python imports this file at start-up in the main_ppo process, in every Ray worker and in the processes they spawn).

1. Hides TRL. The device's /tmp/site holds TRL 1.16 for the TRL peer. verl 0.9.1 patches TRL's value-head model
   whenever `importlib.util.find_spec("trl")` finds TRL, importing `trl.experimental.ppo.AutoModelForCausalLMWithValueHead`
   or else `trl.AutoModelForCausalLMWithValueHead`; TRL 1.16 has neither, so verl's actor failed at start-up on the
   H200 (ImportError in verl/models/transformers/monkey_patch.py). verl needs nothing else of TRL's, and with TRL
   not found it skips that patch.
2. Stack dumps on demand. Where FLATRL_VERL_STACKS names a folder, each process registers faulthandler on SIGUSR1
   (every thread, into <folder>/<pid>.txt, created now), so that e2e_verl.py can see where a stalled run waits,
   whatever Ray does with the process's stderr. A forked child (a DataLoader worker) gets its own file.
"""

import faulthandler
import os
import signal
import sys


class _HideTRL:
    """A meta-path finder that reports TRL as absent: verl catches ModuleNotFoundError from find_spec."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(
                f"No module named {name!r} (hidden from verl by bench/verl_no_trl)", name=name
            )
        return None


sys.meta_path.insert(0, _HideTRL())

_stacks = None  # the open dump file: faulthandler writes to its descriptor, so it must stay open


def _register_stack_dump() -> None:
    """SIGUSR1 -> every thread's Python stack into FLATRL_VERL_STACKS/<pid>.txt (nothing without the variable)."""
    global _stacks
    folder = os.environ.get("FLATRL_VERL_STACKS")
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        _stacks = open(os.path.join(folder, f"{os.getpid()}.txt"), "a")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):  # a read-only folder, a thread other than the main one
        _stacks = None


_register_stack_dump()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_register_stack_dump)
