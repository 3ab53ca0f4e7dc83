"""E-mail to the site's ADMINS when a run ends badly (IOTQUEUE_FAILED_RUN_EMAIL)."""

from __future__ import annotations

from typing import Any

from django.core.mail import mail_admins


def failed_run_mail_send(*, event: dict[str, Any]) -> None:
    """Mail one failed-run event (the payload webhooks get) to ADMINS; raises on SMTP errors."""
    subject = f"run {event['status']}: {event['template']} {str(event['run'])[:8]}"
    lines = [
        f"Run {event['run']} of template {event['template']} ended {event['status']} at {event['time']}.",
        "",
        f"Error: {event['error'] or '-'}",
    ]
    mail_admins(subject, "\n".join(lines), fail_silently=False)
