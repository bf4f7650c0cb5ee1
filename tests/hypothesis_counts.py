"""How many examples a property gets: the count written beside it in the suite (chosen for what that property
needs to find its bugs in seconds), or under ``pytest --hypothesis-profile=long`` (registered in ``conftest.py``)
ten times as many and at least the profile's 1,000, for a long run before a release."""

from __future__ import annotations

from hypothesis import settings


def examples(count: int) -> int:
    if settings.get_current_profile_name() == "long":
        return max(10 * count, settings.default.max_examples)
    return count
