"""One seed for the randomized tests (hypothesis, schemathesis), fixed so a run can be
repeated, and printed in pytest's header and in every failure they report. Another seed:
TANDOOR_TEST_SEED=<n> scripts/test.sh."""

from __future__ import annotations

import os

SEED = int(os.environ.get("TANDOOR_TEST_SEED", "20261130"))


def seed_note() -> str:
    return f"random test seed {SEED} (repeat with TANDOOR_TEST_SEED={SEED})"
