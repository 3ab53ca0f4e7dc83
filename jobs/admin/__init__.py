"""Admin, the orchestration console: templates with inline ordered steps and *Run now*, runs
with a live timeline and cancel / retry, devices with their lock holder and queue, maintenance
windows with when each opens.

Lists stay quick with millions of step runs and events (bench/admin_lists.py measures them):
every list selects its related rows in the same query, step runs and events are read-only and
newest first (primary-key order), filters offer fixed choices instead of scanning for distinct
values, searches match exactly (or a run id's first characters) through an index, and the
runs, step runs and events lists show PostgreSQL's row estimate instead of counting millions
of rows (paging.py). One module per page family; importing them registers them.
"""

from django.contrib import admin
from django.utils.translation import gettext_lazy as _

from . import dashboard, devices, limits, records, runs, templates, windows

admin.site.site_header = _("iotqueue console")
admin.site.site_title = _("iotqueue")

__all__ = ["dashboard", "devices", "limits", "records", "runs", "templates", "windows"]
