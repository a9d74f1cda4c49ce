"""A pytest plugin that prints each collected test's tier, for tests/tiers (`-p tests.support.tier_report`)."""

from __future__ import annotations

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        mark = item.get_closest_marker("tier")
        print(f"TIER {mark.args[0] if mark else '-'} {item.nodeid}")
