"""Admin, the orchestration console: templates with inline ordered steps and *Run now*, runs
with a live timeline and cancel / retry, devices with their lock holder and queue.

Lists stay quick with millions of step runs and events: every list selects its related rows
in the same query, step runs and events are read-only and newest first (primary-key order),
filters offer fixed choices instead of scanning for distinct values, and Django's extra
unfiltered count is off. One module per page family; importing them registers them.
"""

from . import devices, records, runs, templates

__all__ = ["devices", "records", "runs", "templates"]
