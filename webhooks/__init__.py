"""Run events out: webhooks, lifecycle events on MQTT and e-mail to admins on failed runs."""
