"""Verifiers: pure selection functions over compiled trees (see ``base``)."""

from harness.verifiers import (
    builtin,  # noqa: F401  (registers the built-in verifiers)
    typical,  # noqa: F401  (registers the heuristic `typical`, exact=False)
)
from harness.verifiers.base import VERIFIERS, NegotiationError, Verifier, get_verifier, negotiate, register

__all__ = ["VERIFIERS", "NegotiationError", "Verifier", "get_verifier", "negotiate", "register"]
