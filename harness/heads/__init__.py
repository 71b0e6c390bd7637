"""Draft heads and self-speculation artifacts: what is trained or searched, versioned and loaded.

Modules: ``teacher_rows`` (Hydra teacher rows over packed streams), ``data`` (cached target hidden
states), ``models`` (Medusa / Hydra / Clover head banks), ``training``, ``checkpoint`` (versioned
artifacts refused against another target), ``artifacts`` (load or train), ``published`` (Medusa
and Hydra checkpoints read in their authors' layouts, with their published forward), ``state`` (the
``may_reuse`` state check and the target hidden-state tap), ``cartesian`` (Cartesian future-head
trees). Imports stay lazy: ``harness.config`` imports ``harness.topology.budgets`` without torch.
"""
