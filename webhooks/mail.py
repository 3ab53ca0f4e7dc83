"""E-mail to the site's ADMINS when a run ends badly (IOTQUEUE_FAILED_RUN_EMAIL)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage


def failed_run_mail_send(*, event: dict[str, Any]) -> None:
    """Mail one failed-run event (the payload webhooks get) to ADMINS; raises on SMTP errors."""
    subject = f"run {event['status']}: {event['template']} {str(event['run'])[:8]}"
    lines = [
        f"Run {event['run']} of template {event['template']} ended {event['status']} at {event['time']}.",
        "",
        f"Error: {event['error'] or '-'}",
    ]
    if not settings.ADMINS:
        return
    # Not mail_admins: Django 5.2's wants (name, address) tuples, Django 6's plain addresses.
    EmailMessage(
        f"{settings.EMAIL_SUBJECT_PREFIX}{subject}",
        "\n".join(lines),
        settings.SERVER_EMAIL,
        list(settings.ADMINS),
    ).send(fail_silently=False)
