"""Shared test configuration.

Every ``@pytest.mark.asyncio`` test runs once per event loop implementation: the default asyncio
loop and uvloop (when installed), via pytest-asyncio's ``pytest_asyncio_loop_factories`` hook. The
test ids carry the loop name (``[asyncio]``, ``[uvloop]``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
    uvloop = None


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories
