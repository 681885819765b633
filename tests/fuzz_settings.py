"""Example counts for the property tests: 500 per property in the normal run, more in
``bench/fuzz.py`` (which sets ``KVTUNE_FUZZ_EXAMPLES`` before importing the test modules)."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("KVTUNE_FUZZ_EXAMPLES", "500"))
"""Examples per property (at least 500 in ``make test``)."""

PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""Settings of every property test: no per-example deadline (a loaded 2-core host), no example
database written into the checkout."""
