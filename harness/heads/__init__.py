"""Draft heads and self-speculation artifacts: what is trained or searched, versioned and loaded.

Modules: ``models`` (Medusa / Hydra / Clover head banks), ``published`` (Medusa and Hydra
checkpoints read in their authors' layouts, with their published forward), ``eagle`` (EAGLE-1/2 and
EAGLE-3 draft networks and their KV cache), ``eagle_formats`` (published EAGLE checkpoints),
``recipes``, ``checkpoint`` (versioned artifacts refused against another target), ``artifacts``
(loading), ``early_exit``, ``partial``, ``state`` (the ``may_reuse`` state check and the target
hidden-state tap). Training lives in :mod:`harness.prepare`. Imports stay lazy: ``harness.config``
imports ``harness.topology.budgets`` without torch.
"""
