"""The demo's step task: a firmware catalogue lookup whose result a device step flashes.

Development tooling like the rest of the demo: the product never imports it; the dev stack
lists it in CELERY_IMPORTS (devtools/devstack.py), so its worker and web process know it.
"""

from celery import shared_task

from jobs.tasksteps import step_task

# What the pretend catalogue holds: the newest firmware per device model.
CATALOGUE = {"lamp": "2.4.1", "gate": "1.9.0"}


@step_task
@shared_task(name="demo.firmware_url")
def firmware_url(model: str, channel: str = "stable") -> dict:
    """Where the newest firmware for `model` is; stands in for an HTTP call to a catalogue."""
    version = CATALOGUE[model]
    return {"url": f"https://fw.example.com/{model}/{channel}/{version}.bin", "version": version}
