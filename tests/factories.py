"""factory_boy factories for devices, templates and steps."""

import uuid

import factory

from devices.models import Device
from jobs.models import JobStep, JobTemplate

# Device names are unique across a session so device locks (keyed by name in Redis) of
# one test never meet another test's.
SESSION_TAG = uuid.uuid4().hex[:6]


class DeviceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Device

    name = factory.Sequence(lambda n: f"dev-{SESSION_TAG}-{n}")
    online = True


class JobTemplateFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = JobTemplate

    name = factory.Sequence(lambda n: f"template-{SESSION_TAG}-{n}")


class JobStepFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = JobStep

    template = factory.SubFactory(JobTemplateFactory)
    position = factory.Sequence(lambda n: n)
    device = factory.SubFactory(DeviceFactory)
    action = "noop"
    timeout_seconds = 30


def template_with_steps(*steps: tuple[Device, str, dict]) -> JobTemplate:
    """A template whose steps are (device, action, args) in order."""
    template = JobTemplateFactory()
    for position, (device, action, args) in enumerate(steps):
        JobStepFactory(template=template, position=position, device=device, action=action, args=args)
    return template
