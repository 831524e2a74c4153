"""Claims of the papers, checked by real computation (run by ``attnopt reproduce``).

One module per paper registers its claims with :func:`attnopt.claims.claim`; modules in
this package are discovered automatically.
"""
from attnopt.claims._registry import (
    Claim,
    ClaimContext,
    ClaimResult,
    Verdict,
    all_claims,
    claim,
    verdict,
)

__all__ = ["Claim", "ClaimContext", "ClaimResult", "Verdict", "all_claims", "claim", "verdict"]
