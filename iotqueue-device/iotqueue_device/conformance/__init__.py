"""The conformance kit: `python -m iotqueue_device.conformance --mqtt-url ... --device NAME
--api ... --token ...` drives a device under test through iotqueue's protocol cases and prints
a pass/fail table (exit status 1 on any failure). kit.py has the cases, actions.py the three
actions a device under test must handle."""
