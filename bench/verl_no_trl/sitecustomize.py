"""Hides TRL from the verl peer's processes (bench/e2e_verl.py puts this folder first on their PYTHONPATH, so
Python imports this file at start-up in the main_ppo process and in every Ray worker).

The device's /tmp/site holds TRL 1.16 for the TRL peer. verl 0.9.1 patches TRL's value-head model whenever
`importlib.util.find_spec("trl")` finds TRL, importing `trl.experimental.ppo.AutoModelForCausalLMWithValueHead`
or else `trl.AutoModelForCausalLMWithValueHead`; TRL 1.16 has neither, so verl's actor failed at start-up on the
H200 (ImportError in verl/models/transformers/monkey_patch.py). verl needs nothing else of TRL's, and with TRL
not found it skips that patch.
"""

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
