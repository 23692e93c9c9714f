"""What the Ray Serve benchmarks share: the tenants' system prompts and a percentile."""

import random

WORDS = (
    "account balance card limit transfer fee policy branch loan rate deposit credit "
    "statement fraud alert payment schedule interest mortgage savings checking wire "
    "dispute refund charge merchant travel notice overdraft protection identity verify"
).split()


def tenant_prompt(t: int, words: int) -> str:
    """Tenant t's system prompt: the same words for the same t in every run."""
    rng = random.Random(1000 + t)
    return f"Tenant {t} operating manual. " + " ".join(rng.choice(WORDS) for _ in range(words))


def pct(xs, p):
    """The p-th percentile of xs (nearest rank); NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
