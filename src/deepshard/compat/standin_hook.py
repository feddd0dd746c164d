"""The start-up hook of ``python -m deepshard.compat.standin on``: ``import deepspeed`` finds deepshard in
every Python process of the environment, when no real DeepSpeed is installed.

``standin on`` writes a ``.pth`` file into site-packages whose one line runs this file (by path, so that
starting Python imports nothing of deepshard). It appends a finder to the *end* of ``sys.meta_path``:

- the finders before it look first, so a real DeepSpeed, when installed, is found and imported as
  usual: this hook never shadows one;
- asked for ``deepspeed`` (or ``deepspeed.*``) that nothing else found, it calls
  ``deepshard.compat.install()`` (the finder of :mod:`deepshard.compat.finder`, and the CPU adjustments of
  Accelerate and transformers) and answers from it: only then is deepshard, and torch, imported;
- asked for the ``deepspeed`` distribution's metadata (Accelerate's ``is_deepspeed_available()`` checks
  it before importing), it answers with the one :mod:`deepshard.compat.finder` reports.

``DEEPSHARD_STANDIN=0`` in the environment turns it off for that process.
"""
import os
import sys


class DeepshardStandIn:
    """Last on ``sys.meta_path``: ``deepspeed`` names nobody else answered resolve to deepshard."""

    busy = False  # while activating: install() itself looks for a real ``deepspeed``, which must not find this

    def _activate(self) -> object:
        import deepshard.compat as compat

        if not compat.is_installed():
            self.busy = True
            try:
                compat.install()
            finally:
                self.busy = False
        return next(f for f in sys.meta_path if isinstance(f, compat.DeepSpeedFinder))

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if self.busy or (fullname != "deepspeed" and not fullname.startswith("deepspeed.")):
            return None
        imported = sys.modules.get("deepspeed")
        if imported is not None and "_deepshard_target" not in vars(imported):
            return None  # a real DeepSpeed is imported: its missing submodules stay missing
        return self._activate().find_spec(fullname, path, target)  # type: ignore[attr-defined]

    def find_distributions(self, context: object = None) -> object:
        name = getattr(context, "name", None)
        if self.busy or name is None or name.replace("-", "_").lower() != "deepspeed":
            return iter(())
        return self._activate().find_distributions(context)  # type: ignore[attr-defined]


def register() -> None:
    """Append the hook (once) unless ``DEEPSHARD_STANDIN=0``."""
    if os.environ.get("DEEPSHARD_STANDIN", "") == "0":
        return
    if not any(type(f).__name__ == "DeepshardStandIn" for f in sys.meta_path):
        sys.meta_path.append(DeepshardStandIn())


if __name__ != "deepshard.compat.standin_hook":  # run from the .pth line (imported, it only defines)
    register()
