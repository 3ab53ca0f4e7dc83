"""The devtools app: installed in a checkout (settings), so its simulate, demo and webhook_demo
commands exist there; it has no models, no admin and no signals."""

from django.apps import AppConfig


class DevtoolsConfig(AppConfig):
    name = "devtools"
    verbose_name = "Development tooling"
