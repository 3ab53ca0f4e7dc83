"""iotqueue-device: a device agent for iotqueue's MQTT device protocol v1.1, and its conformance kit.

`Agent` is the MQTT device; `CommandBook` (core.py) the socket-free rules it applies to every
command, shared with iotqueue's simulator.
"""

from .agent import Abandoned, Agent, CommandFailed, Context, Rejected
from .core import CommandBook, Decision, Verdict
from .protocol import Command, Topics

__all__ = [
    "Abandoned",
    "Agent",
    "Command",
    "CommandBook",
    "CommandFailed",
    "Context",
    "Decision",
    "Rejected",
    "Topics",
    "Verdict",
]
__version__ = "0.1.0"
