"""A module plugin: the module itself is the plugin and its functions are the hooks.

test_entry_points.py installs it as the fake entry point ``finish-log``;
docs/writing-plugins.md shows it.
"""

from __future__ import annotations

from schedkit import hookimpl

finished: list[str] = []


@hookimpl
def schedkit_on_request_finished(request, now):
    finished.append(request.request_id)
