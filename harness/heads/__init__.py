"""Draft heads and self-speculation artifacts (reference 0x05, 0x06, 0x0B).

Modules: ``teacher_rows`` (0x06B rows over packed streams), ``data`` (cached target hidden
states), ``models`` (Medusa / Hydra / Clover head banks), ``training``, ``checkpoint``
(versioned artifacts refused against another target), ``artifacts`` (load or train), ``state``
(0x05C ``may_reuse`` and the target hidden-state tap), ``cartesian`` (0x07C). Imports stay lazy:
``harness.config`` imports ``harness.heads.cartesian`` without torch.
"""
