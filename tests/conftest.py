"""Suite-wide settings.

The suite runs on ``pytest -n 2`` (two xdist workers on the 2-core CI machine); a search's default of
one worker process per CPU would start two more processes per search test on top. Searches here run
in-process unless a test asks for processes (tests/search/test_process_pool.py exercises the pool and
the default count)."""

from __future__ import annotations

import os

os.environ.setdefault("ECHO_PLAN_PROCESSES", "1")
