"""iotqueue: jobs on IoT devices over MQTT, run by Django and Celery."""

from .celery import app as celery_app

__all__ = ("celery_app",)
