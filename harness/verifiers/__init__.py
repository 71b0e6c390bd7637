"""Verifiers: pure selection functions over compiled trees (see ``base``)."""

from harness.verifiers import (
    builtin,  # noqa: F401  (registers the built-in verifiers)
    typical,  # noqa: F401  (registers the heuristic `typical`, exact=False)
)
from harness.verifiers.base import (  # noqa: F401
    VERIFIERS,
    Capabilities,
    NegotiationError,
    Verifier,
    get_verifier,
    negotiate,
    register,
)
