"""Hydra plugins of the harness (Hydra loads launchers only from the ``hydra_plugins`` namespace)."""
