"""Start, use and stop a private local Flower federation (SuperLink, SuperNodes, ``flwr run``).

Used by ``scripts/run_main.sh``, the end-to-end tests and ``benchmarks/many_supernodes.py``; also
handy by hand, from the repository root::

    python -m scripts.launch --mode simulation --num-supernodes 6 \\
        --run-config "local-epochs=5" --results-dir /tmp/fedfiot

Why not plain ``flwr run .``: ``flwr run`` starts a detached local SuperLink that outlives it,
on fixed ports, keeps its state in ``~/.flwr``, and exits 0 even when the run fails. Here every
federation gets its own ``FLWR_HOME`` (temp dir), free ports, processes started in their own
session and stopped by PID, runtime dependency installation disabled (the app runs in this
environment), and success is read from the run's ``results.json``, not from exit codes.

Every process it starts runs under :mod:`scripts.supervise`, so the federation ends with the
launcher however the launcher ends: ``SIGKILL`` and the out-of-memory killer included (the
supervisors see their lifeline pipe close), and ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` through the
launcher's own clean-up, after which it names the run directory to ``--resume``.

Development tooling: it lives outside ``fedfiot_flwr`` so that the wheel does not ship it, and its
TLS helpers need ``cryptography`` (installed by the ``test`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from fedfiot_flwr.extras import require
from scripts.supervise import STOP_SIGNALS, descendants, supervised_command

#: SuperNodes of a launched federation when the run leaves K to the federation (the paper's K).
DEFAULT_NUM_SUPERNODES = 6


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free right now (all bound at once, so the
    OS cannot hand out the same port twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _bin(name: str) -> str:
    """Path of a console script of this environment (``flwr``, ``flower-superlink``...)."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name!r} not found next to {sys.executable} nor on PATH; install flwr")
    return found


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def run_config_arg(values: Mapping[str, Any]) -> str:
    """Format ``{"key": value}`` as one ``flwr run --run-config`` string (TOML values)."""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())


#: One ``key=value`` pair of ``--run-config``, as Flower's own parser finds them.
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def parse_run_config(text: str) -> dict[str, Any]:
    """Parse ``--run-config "key=value ..."`` as ``flwr run`` does, keeping a bare word as a string.

    Each value is read as TOML (``5``, ``0.2``, ``true``, ``'text'``). Unlike Flower's parser,
    a value that is not TOML (``local-epochs=abc``, ``dataset=cifar10``) is kept as the string
    it reads as, so the app names the key and what it allows instead of a TOML error.

    Raises
    ------
    ValueError
        If part of ``text`` is not a ``key=value`` pair (it names that part).
    """
    stray = _PAIR.sub(" ", text).split()
    if stray:
        raise ValueError(f"--run-config: {' '.join(stray)!r} is not key=value (e.g. \"local-epochs=5 alpha=0.2\")")
    return {key: _toml_or_word(value) for key, value in _PAIR.findall(text)}


def _toml_or_word(value: str) -> Any:
    """A run-config value read as TOML, or the word itself when it is not TOML."""
    toml = _toml_module()
    try:
        return toml.loads(f"v = {value}")["v"]
    except toml.TOMLDecodeError:
        return value


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LOG_RECORD = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:")
_TRACEBACK = "Traceback (most recent call last):"


def app_error(log: str, max_lines: int = 10) -> str | None:
    """The exception that ended the last traceback in ``log`` (``"ValueError: ..."``), or None.

    Parameters
    ----------
    log : str
        Output of ``flwr run --stream`` or a process log (colour codes are dropped).
    max_lines : int
        Most lines kept of a message that spans several (it ends at a blank line or a log record).
    """
    lines = _ANSI.sub("", log).splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK]
    if not starts:
        return None
    after = lines[starts[-1] + 1:]
    # The frames are indented; the exception is the first line that is not.
    first = next((i for i, line in enumerate(after) if line and not line[0].isspace()), None)
    if first is None:
        return None
    message = [after[first].rstrip()]
    for line in after[first + 1:first + max_lines]:
        if not line.strip() or _LOG_RECORD.match(line):
            break
        message.append(line.rstrip())
    return "\n".join(message)


def failure_message(results: Mapping[str, Any], logs: Sequence[str], results_path: Path) -> str:
    """Why a run failed: the error its results file recorded, else the app's last exception in ``logs``.

    Parameters
    ----------
    results : mapping
        The run's ``results.json`` (empty when there is none).
    logs : sequence of str
        Texts to search, best first (``flwr run --stream`` output, then the SuperLink's log).
    results_path : Path
        Where the results file was expected (named when nothing else explains the failure).
    """
    if results.get("error"):
        return str(results["error"])
    for text in logs:
        if error := app_error(text):
            return f"the app raised {error}"
    return f"no results file at {results_path} and no exception in the app's log (see the log above)"


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a TLS-enabled SuperLink: the CA certificate and the server's certificate and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def generate_tls_files(directory: str | Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                       days: int = 2) -> TLSFiles:
    """A private CA and a server certificate for ``hosts`` (for loopback tests and local trials).

    Production federations use certificates from their own CA; see ``docs/deployment-security.md``.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedfiot test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(out / "ca.crt", out / "server.pem", out / "server.key")
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    files.server_key.chmod(0o600)
    return files


def generate_supernode_key(directory: str | Path, name: str) -> tuple[Path, Path]:
    """A SuperNode authentication key pair (P-384, OpenSSH format): ``(private key, public key)``.

    The same as ``ssh-keygen -t ecdsa -b 384 -N "" -f <directory>/<name>``.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = out / name, out / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return private, public


@dataclass
class LocalFederation:
    """A private Flower federation on loopback: one SuperLink and, in deployment mode, SuperNodes.

    Parameters
    ----------
    mode : {"simulation", "deployment"}
        ``"simulation"``: a ``flower-superlink --simulation`` (the simulation engine runs the
        ClientApps); ``"deployment"``: a SuperLink plus ``num_supernodes`` real
        ``flower-supernode`` processes with ``partition-id=i num-partitions=K``.
    num_supernodes : int
        Number of (virtual or real) SuperNodes.
    workdir : Path, optional
        Where ``FLWR_HOME`` and the process logs go (default: a new temp dir, removed on stop).
    env : mapping, optional
        Extra environment variables for every process.
    tls : TLSFiles, optional
        Serve the SuperLink over TLS with these files (SuperNodes and ``flwr`` verify it with
        the CA certificate); default: ``--insecure``.
    supernode_auth : bool
        Start the SuperLink with ``--enable-supernode-auth``: only SuperNodes whose public key
        was registered (``flwr supernode register``) may connect.
    supernode_keys : sequence of (private key path or None), optional
        Per SuperNode, the private key it authenticates with (``--auth-supernode-private-key``).
    registered_keys : sequence of Path
        Public keys registered with ``flwr supernode register`` before the SuperNodes start.

    Attributes
    ----------
    processes : dict[str, subprocess.Popen]
        Started processes by role (``"superlink"``, ``"supernode-0"``...).
    """

    mode: str = "simulation"
    num_supernodes: int = 2
    workdir: Path | None = None
    env: Mapping[str, str] | None = None
    tls: TLSFiles | None = None
    supernode_auth: bool = False
    supernode_keys: Sequence[Path | None] | None = None
    registered_keys: Sequence[Path] = ()
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _own_workdir: bool = False
    _logs: list[IO[bytes]] = field(default_factory=list)
    _replaced: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _lifeline: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("simulation", "deployment"):
            raise ValueError(f"mode must be 'simulation' or 'deployment', got {self.mode!r}")
        if self.num_supernodes < 1:
            raise ValueError(f"num_supernodes must be >= 1, got {self.num_supernodes}")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="fedfiot-flwr-"))
            self._own_workdir = True
        self.workdir = Path(self.workdir).resolve()
        self.flwr_home = self.workdir / "flwr-home"
        # SuperLink port, then one Runtime API port per SuperNode (deployment mode).
        self.port, *self.node_ports = free_ports(1 + (self.num_supernodes if self.mode == "deployment" else 0))

    # -- environment ---------------------------------------------------------------------
    def environ(self) -> dict[str, str]:
        """Environment of every process: private FLWR_HOME, no runtime installs, no update check."""
        env = dict(os.environ)
        env.update(
            {
                "FLWR_HOME": str(self.flwr_home),
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "FLWR_DISABLE_UPDATE_CHECK": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.env or {})
        return env

    def _spawn(self, role: str, cmd: Sequence[str], append: bool = False) -> subprocess.Popen[bytes]:
        assert self.workdir is not None
        log = open(self.workdir / f"{role}.log", "ab" if append else "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        # A new session, so that a Ctrl-C meant for the launcher reaches the launcher only; the
        # supervisor stops the process and everything it spawned (ServerApp, simulation engine,
        # ClientApps, in sessions of their own) when asked to, or when this process ends.
        proc = subprocess.Popen(
            self.supervised(cmd), env=self.environ(), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir, pass_fds=(self.lifeline(),),
        )
        if role in self.processes:
            self._replaced.append(self.processes[role])
        self.processes[role] = proc
        return proc

    def lifeline(self) -> int:
        """The read end of this federation's lifeline pipe, which every supervisor watches.

        Only this process holds the write end (it is not inheritable); when this process ends, or
        :meth:`stop` closes it, every supervised process is stopped.
        """
        if self._lifeline is None:
            self._lifeline = os.pipe()
        return self._lifeline[0]

    def supervised(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run under :mod:`scripts.supervise`, tied to this federation's lifeline."""
        return supervised_command(cmd, self.lifeline())

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalFederation:
        """Start the SuperLink (and SuperNodes), write the CLI connection, wait until ready.

        Raises
        ------
        ImportError
            In simulation mode without Ray (``pip install 'fedfiot-flwr[simulation]'``).
        RuntimeError
            If a process exits early or the SuperLink does not become healthy in time.
        """
        # Without Ray the SuperLink would only fail later, in its log. find_spec first: importing
        # Ray here (in the launcher's process) would cost seconds and is not needed.
        if self.mode == "simulation" and importlib.util.find_spec("ray") is None:
            require("ray", "flwr[simulation]", "simulation", "Flower's simulation engine (mode 'simulation')")
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        security = ("insecure = true\n" if self.tls is None
                    else f"root-certificates = {json.dumps(str(self.tls.ca_cert))}\n")
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "fedfiot"\n\n[superlink.fedfiot]\naddress = "127.0.0.1:{self.port}"\n{security}',
            encoding="utf-8",
        )
        self._spawn("superlink", self.superlink_command())
        self._wait_health(timeout)
        for public_key in self.registered_keys:
            self.register_supernode_key(public_key)
        if self.mode == "deployment":
            for i in range(self.num_supernodes):
                self._spawn(f"supernode-{i}", self.supernode_command(i))
            time.sleep(2.0)  # a SuperNode that cannot start (e.g. port taken) exits at once
            for role, proc in self.processes.items():
                if proc.poll() is not None and not self._may_be_refused(role):
                    raise RuntimeError(f"{role} exited with code {proc.returncode}; see {self.log_path(role)}")
        return self

    def superlink_command(self) -> list[str]:
        """The ``flower-superlink`` command line: this federation's port, TLS and database."""
        cmd = [
            _bin("flower-superlink"), *self._superlink_security(), "--isolation", "subprocess",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--database", str(self.flwr_home / "state.db"),
            "--disable-runtime-dependency-installation",
        ]
        return cmd + (["--simulation"] if self.mode == "simulation" else [])

    def restart_superlink(self, timeout: float = 60.0) -> int:
        """Start the SuperLink again (same port, same ``--database``) after it stopped; return its PID.

        The SuperNodes that kept running reconnect on their own. The earlier process's log is
        kept: the new one appends to ``superlink.log``.

        Raises
        ------
        RuntimeError
            If the SuperLink is still running, or does not become healthy in time.
        """
        old = self.processes.get("superlink")
        if old is not None and old.poll() is None:
            raise RuntimeError(f"the SuperLink (PID {old.pid}) is still running; kill it first")
        proc = self._spawn("superlink", self.superlink_command(), append=True)
        self._wait_health(timeout)
        return proc.pid

    def serverapp_pids(self) -> list[int]:
        """PIDs of the ServerApp processes (``flwr-serverapp``) the SuperLink started and that still run."""
        leader = self.processes.get("superlink")
        if leader is None:
            return []
        return [pid for pid, argv in descendants(leader.pid).items()
                if any(Path(a).name == "flwr-serverapp" for a in argv[:2])]

    def _superlink_security(self) -> list[str]:
        args = ["--insecure"] if self.tls is None else [
            "--ssl-ca-certfile", str(self.tls.ca_cert), "--ssl-certfile", str(self.tls.server_cert),
            "--ssl-keyfile", str(self.tls.server_key),
        ]
        return args + (["--enable-supernode-auth"] if self.supernode_auth else [])

    def _key_of(self, i: int) -> Path | None:
        return None if self.supernode_keys is None or i >= len(self.supernode_keys) else self.supernode_keys[i]

    def _may_be_refused(self, role: str) -> bool:
        """With SuperNode authentication, a node without a registered key is expected to stop."""
        return self.supernode_auth and role.startswith("supernode-")

    def supernode_command(self, i: int) -> list[str]:
        """The ``flower-supernode`` command line of SuperNode ``i`` (partition ``i`` of K)."""
        cmd = [_bin("flower-supernode")]
        cmd += ["--insecure"] if self.tls is None else ["--root-certificates", str(self.tls.ca_cert)]
        if (key := self._key_of(i)) is not None:
            cmd += ["--auth-supernode-private-key", str(key)]
        return cmd + [
            "--superlink", f"127.0.0.1:{self.port}", "--port", str(self.node_ports[i]),
            "--node-config", f"partition-id={i} num-partitions={self.num_supernodes}",
        ]

    def register_supernode_key(self, public_key: Path, timeout: float = 60.0) -> str:
        """``flwr supernode register <public key>`` against this SuperLink; returns the CLI output.

        Raises
        ------
        RuntimeError
            If the CLI reports a failure.
        """
        proc = subprocess.run(
            self.supervised([_bin("flwr"), "supernode", "register", str(public_key)]), env=self.environ(),
            capture_output=True, text=True, timeout=timeout, cwd=self.workdir, check=False,
            pass_fds=(self.lifeline(),),
        )
        if proc.returncode != 0:
            raise RuntimeError(f"flwr supernode register {public_key} failed: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def _wait_health(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        proc = self.processes["superlink"]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with code {proc.returncode}; see {self.log_path('superlink')}")
            try:
                if self.tls is None:
                    ok = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=0.5).is_success
                else:
                    context = ssl.create_default_context(cafile=str(self.tls.ca_cert))
                    ok = httpx.get(f"https://127.0.0.1:{self.port}/health", timeout=0.5, verify=context).is_success
                if ok:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"flower-superlink not ready after {timeout:.0f}s; see {self.log_path('superlink')}")

    def log_path(self, role: str) -> Path:
        """Log file of a started process."""
        assert self.workdir is not None
        return self.workdir / f"{role}.log"

    def pids(self) -> dict[str, int]:
        """PIDs of the started processes by role."""
        return {role: p.pid for role, p in self.processes.items()}

    def kill(self, role: str, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Send ``sig`` to one started process (e.g. ``"supernode-2"``) by its PID and wait for it.

        A SuperNode stopped with SIGTERM tells the SuperLink it is leaving, so the SuperLink
        answers its pending instructions with an error at once; after SIGKILL the SuperLink
        notices only when the node's heartbeats stop (about a minute with Flower's defaults).
        The signal goes to the process's supervisor: ``SIGTERM`` (``SIGINT``, ``SIGHUP``) is forwarded
        and what the process spawned (its ClientApp) is stopped after it; ``SIGKILL`` kills the
        supervisor and, through the parent-death signal, the process, and leaves what it spawned to
        :meth:`stop`.
        """
        proc = self.processes[role]
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            proc.wait(timeout=timeout)

    def node_id(self, role: str, timeout: float = 30.0) -> int:
        """The Flower node id a SuperNode logged when it registered (``SuperNode ID: <id>``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path(role).read_text(errors="replace").splitlines():
                if "SuperNode ID:" in line:
                    return int(line.rsplit("SuperNode ID:", 1)[1].split()[0])
            time.sleep(0.2)
        raise TimeoutError(f"{role} logged no node id within {timeout:.0f}s; see {self.log_path(role)}")

    def flwr_run(
        self,
        app_dir: str | Path,
        run_config: Mapping[str, Any] | None = None,
        run_config_file: str | Path | None = None,
        timeout: float = 600.0,
    ) -> subprocess.CompletedProcess[str]:
        """``flwr run <app_dir> --stream``; returns when the run ends (its exit code means little).

        Parameters
        ----------
        app_dir : str or Path
            The Flower app (directory with pyproject.toml).
        run_config : mapping, optional
            Run-config overrides.
        run_config_file : str or Path, optional
            A TOML run-config file (e.g. ``configs/digits-oneshot.toml``), applied before
            ``run_config``.
        timeout : float
            Seconds before ``flwr run`` is killed.
        """
        return subprocess.run(
            self.supervised(self.flwr_run_command(app_dir, run_config, run_config_file)), env=self.environ(),
            capture_output=True, text=True, timeout=timeout, cwd=self.workdir, check=False,
            pass_fds=(self.lifeline(),),
        )

    def flwr_run_command(
        self,
        app_dir: str | Path,
        run_config: Mapping[str, Any] | None = None,
        run_config_file: str | Path | None = None,
    ) -> list[str]:
        """The ``flwr run <app_dir> --stream`` command line of :meth:`flwr_run`."""
        cmd = [_bin("flwr"), "run", str(Path(app_dir).resolve()), "--stream"]
        if self.mode == "simulation":
            cmd += ["--federation-config", f"num-supernodes={self.num_supernodes}"]
        # Flower refuses a TOML file next to key=value pairs: merge them into one set of pairs.
        values: dict[str, Any] = {}
        if run_config_file is not None:
            values.update(_load_toml(Path(run_config_file)))
        values.update(run_config or {})
        if values:
            cmd += ["--run-config", run_config_arg(values)]
        return cmd

    def start_flwr_run(
        self, app_dir: str | Path, run_config: Mapping[str, Any] | None = None, role: str = "flwr-run",
    ) -> subprocess.Popen[bytes]:
        """:meth:`flwr_run` in the background, as a started process ``role`` (its output in ``role``'s log).

        Like every started process it is stopped by PID in :meth:`stop`, or with :meth:`kill`.
        """
        return self._spawn(role, self.flwr_run_command(app_dir, run_config))

    def stop(self, grace: float = 10.0) -> None:
        """Stop every started process by PID (SIGTERM, then SIGKILL), with its process group.

        Each is a supervisor (:mod:`scripts.supervise`): it forwards the signal and stops what its
        process spawned. Processes replaced by a restart are included. Last, the lifeline closes, so
        a supervisor that is somehow still running stops its process too.
        """
        for proc in reversed([*self._replaced, *self.processes.values()]):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.poll() is None:
                    try:
                        os.kill(proc.pid, sig)
                    except ProcessLookupError:
                        pass
                    try:
                        proc.wait(timeout=grace)
                    except subprocess.TimeoutExpired:
                        continue
            self._kill_group(proc.pid, grace)
        for log in self._logs:
            log.close()
        self._logs.clear()
        self._close_lifeline()

    @staticmethod
    def _kill_group(pgid: int, grace: float) -> None:
        """Signal what is left of the process group the process led (children it spawned)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                try:
                    os.killpg(pgid, 0)
                except (ProcessLookupError, PermissionError):
                    return
                time.sleep(0.1)

    def cleanup(self) -> None:
        """Stop everything and remove the temp work dir (when this object created it)."""
        self.stop()
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def wait_for_results(path: str | Path, timeout: float = 600.0, poll: float = 1.0) -> dict[str, Any]:
    """Wait until ``results.json`` at ``path`` says "finished" or "failed"; return its content.

    Raises
    ------
    TimeoutError
        If the file does not reach a final status in time.
    """
    target = Path(path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if target.exists():
            try:
                data = json.loads(target.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                data = {}
            if data.get("status") in ("finished", "failed"):
                return data
        time.sleep(poll)
    raise TimeoutError(f"{target} did not reach status finished/failed within {timeout:.0f}s")


class LauncherStopped(Exception):
    """The launcher was asked to stop by a signal (``SIGINT``, ``SIGTERM``, ``SIGHUP``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise LauncherStopped(signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", default=".", help="Flower app directory (default: .)")
    parser.add_argument("--mode", choices=("simulation", "deployment"), default="simulation")
    parser.add_argument("--num-supernodes", type=int, default=None,
                        help=f"default: the run's num-partitions, or {DEFAULT_NUM_SUPERNODES} (the paper's K) "
                             "when it is 0 (follow the federation)")
    parser.add_argument("--run-config-file", default=None, help="TOML run config, e.g. configs/digits-oneshot.toml")
    parser.add_argument("--run-config", default="", help='overrides, e.g. "local-epochs=5 alpha=0.2"')
    parser.add_argument("--results-dir", default="results", help="where results/<run-name>/ goes (default: ./results)")
    parser.add_argument("--run-name", default=None, help="a new directory's name (default: main-<timestamp>)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--keep-workdir", action="store_true", help="keep FLWR_HOME and process logs")
    parser.add_argument("--resume", default=None, metavar="RUN_DIR",
                        help="go on after the last complete round of this earlier run directory, with its settings "
                             "(--run-config may change the total num-server-rounds); results go to a new directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: run the app once on a private federation, print the results, return 0 only on success.

    Exit codes: 0 finished, 1 the run failed, 2 refused before a federation started (a bad run
    config, a checkpoint that cannot be resumed from, a run directory that exists or that a live
    run holds), 128 + the signal's number when stopped by ``SIGINT``, ``SIGTERM`` or ``SIGHUP``.
    """
    args = _parser().parse_args(argv)
    try:
        overrides = parse_run_config(args.run_config)
        if args.resume:
            overrides = resumed_run_config(args.resume, args.run_config_file, overrides)
            args.run_config_file = None  # merged into the overrides
        k = (args.num_supernodes or _count(overrides.get("num-partitions"))
             or _num_partitions(args.app, args.run_config_file) or DEFAULT_NUM_SUPERNODES)
        run_dir = _new_run_dir(Path(args.results_dir).resolve(), args.run_name, args.resume)
    except ValueError as exc:  # a bad run config, a checkpoint that cannot be resumed from, a taken run name
        print(f"[fedfiot] FAILED: {exc}", file=sys.stderr)
        return 2
    overrides.update({"results-dir": str(run_dir.parent), "run-name": run_dir.name})
    results_path = run_dir / "results.json"

    # SIGINT too: a launcher started in the background by a script inherits it ignored.
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in STOP_SIGNALS}
    fed = LocalFederation(mode=args.mode, num_supernodes=k)
    stopped: int | None = None
    data: dict[str, Any] = {}
    try:
        data, output = _run_app(fed, args.app, overrides, args.run_config_file, args.timeout, results_path)
        logs = [output, _read(fed.log_path("superlink"))]
    except (KeyboardInterrupt, LauncherStopped) as exc:
        stopped = exc.signum if isinstance(exc, LauncherStopped) else signal.SIGINT
    finally:
        # A second Ctrl-C must not cut the stop short (the supervisors would still stop everything).
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        try:
            _stop_federation(fed, args.keep_workdir, dump=stopped is None and not _finished(results_path))
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if stopped is not None:
        print(f"[fedfiot] stopped by {signal.Signals(stopped).name}; the federation is stopped. "
              f"{_resume_hint(run_dir)}", file=sys.stderr)
        return 128 + stopped
    if data.get("status") != "finished":
        print(f"[fedfiot] FAILED: {failure_message(data, logs, results_path)}", file=sys.stderr)
        return 1
    _print_final(data, results_path)
    return 0


def _new_run_dir(results_dir: Path, run_name: str | None, resume: str | None) -> Path:
    """Where the run will write: a directory that does not exist yet (the ServerApp creates it).

    Raises
    ------
    ValueError
        When ``--run-name`` names an existing directory: the launcher never points a run at an
        earlier run's directory (a live run's lock holder is named).
    """
    if run_name is not None:
        target = results_dir / run_name
        if target.exists():
            _refuse_held(target)
            raise ValueError(f"{target} exists: every run writes into a new directory (choose another --run-name, "
                             f"or go on from that run with --resume {target})")
        return target
    stamp = time.strftime('%Y%m%d-%H%M%S')
    base = f"{Path(resume).resolve().name}-resumed-{stamp}" if resume else f"main-{stamp}"
    return next(results_dir / name for name in (base, *(f"{base}-{i}" for i in range(2, 10_000)))
                if not (results_dir / name).exists())


def _finished(results_path: Path) -> bool:
    try:
        return json.loads(results_path.read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def _stop_federation(fed: LocalFederation, keep_workdir: bool, dump: bool) -> None:
    """Stop every process of ``fed``; print the processes' logs first when ``dump`` (a failed run)."""
    if keep_workdir:
        fed.stop()
        print(f"[fedfiot] logs kept in {fed.workdir}")
        return
    if dump:
        _dump_logs(fed)
    fed.cleanup()


def _resume_hint(run_dir: Path) -> str:
    """How to go on from ``run_dir`` (its last complete round), or that no round was complete."""
    from fedfiot_flwr.server.checkpoint import complete_rounds

    if not (complete := complete_rounds(run_dir)):
        return f"No round was complete in {run_dir}; nothing to resume from."
    return f"Round {complete[-1]} was the last complete one: go on with --resume {run_dir}"


def _print_final(data: Mapping[str, Any], results_path: Path) -> None:
    final = data.get("final", {})
    ours = (final.get("test") or {}).get("accuracy")
    base = (final.get("fedavg_test") or {}).get("accuracy")
    own = (final.get("own_test") or {}).get("accuracy")
    label = str(data.get("config", {}).get("strategy", "FedFiOT"))  # the strategy's class name
    fmt = lambda x: "n/a" if x is None else f"{100 * x:.2f}%"  # noqa: E731
    note = "" if own is None else f" (FedAvg won the validation choice; FedFiOT's own merge: {fmt(own)})"
    print(f"[fedfiot] final test accuracy: {label} {fmt(ours)} | FedAvg on the same uploads {fmt(base)}{note}")
    print(f"[fedfiot] results: {results_path}")


def resumed_run_config(
    run_dir: str | Path, run_config_file: str | Path | None, overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """The run config that goes on from ``run_dir``: the settings its last complete round recorded,
    then ``run_config_file``'s and ``overrides``, and ``resume-from``.

    Raises
    ------
    ValueError
        (a :class:`~fedfiot_flwr.server.checkpoint.CheckpointError`) When ``run_dir`` holds no
        checkpoint to resume from, naming the file and what is wrong; or when a live run holds
        ``run_dir`` (see :mod:`fedfiot_flwr.server.run_lock`), naming that run's process.
    """
    from fedfiot_flwr.server.checkpoint import load_resume_point, run_dir_of

    _refuse_held(run_dir_of(run_dir))  # before reading: a live run may not even have a complete round yet
    point = load_resume_point(run_dir)
    recorded = point.state.get("config", {}).get("app", {})
    values = {k: v for k, v in recorded.items() if k not in ("results-dir", "run-name", "resume-from")}
    if run_config_file is not None:
        values.update(_load_toml(Path(run_config_file)))
    values.update(overrides)
    values["resume-from"] = str(Path(run_dir).expanduser().resolve())
    return values


def _refuse_held(run_dir: Path) -> None:
    """Raise ValueError naming the live run that holds ``run_dir``, if one does."""
    from fedfiot_flwr.server.run_lock import RunDirectoryHeld, lock_holder

    if run_dir.is_dir() and (holder := lock_holder(run_dir)) is not None:
        raise ValueError(str(RunDirectoryHeld(run_dir, holder)))


def _run_app(
    fed: LocalFederation, app: str, overrides: Mapping[str, Any], run_config_file: str | None, timeout: float,
    results_path: Path,
) -> tuple[dict[str, Any], str]:
    """Start ``fed`` and run the app on it once, echoing ``flwr run``'s output.

    Returns
    -------
    tuple
        ``(results, output)``: the run's ``results.json`` (empty when there is none, or when the
        federation or the run failed) and what ``flwr run --stream`` printed (the app's log).
    """
    output = ""
    try:
        fed.start()
        print(f"[fedfiot] {fed.mode} federation: SuperLink 127.0.0.1:{fed.port}, PIDs {fed.pids()}, "
              f"FLWR_HOME {fed.flwr_home}", flush=True)
        proc = fed.flwr_run(app, overrides, run_config_file, timeout=timeout)
        output = proc.stdout + proc.stderr
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        # The stream ends with the run; a results file still marked "running" means the ServerApp died.
        return (wait_for_results(results_path, timeout=10.0) if results_path.exists() else {}), output
    except subprocess.TimeoutExpired as exc:
        output = _text(exc.stdout) + _text(exc.stderr)
        sys.stdout.write(output)
        print(f"[fedfiot] run failed: {exc}", file=sys.stderr)
    except (TimeoutError, RuntimeError) as exc:
        print(f"[fedfiot] run failed: {exc}", file=sys.stderr)
    return {}, output


def _read(path: Path) -> str:
    """A process log's text ('' when the process never started)."""
    return path.read_text(errors="replace") if path.exists() else ""


def _toml_module() -> ModuleType:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


def _load_toml(path: Path) -> dict[str, Any]:
    return dict(_toml_module().loads(path.read_text(encoding="utf-8")))


def _count(value: Any) -> int:
    """``value`` as a positive integer (``4`` or ``"4"``), else 0: a bad ``num-partitions`` is the app's to report."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _text(output: bytes | str | None) -> str:
    """Captured output of a timed-out process (bytes even with ``text=True``) as text."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _num_partitions(app: str, run_config_file: str | None) -> int:
    """K fixed by the run-config file or the app's pyproject.toml (0: follow the federation)."""
    if run_config_file:
        cfg = _load_toml(Path(run_config_file))
        if "num-partitions" in cfg:
            return _count(cfg["num-partitions"])
    py = _load_toml(Path(app) / "pyproject.toml")
    return _count(py["tool"]["flwr"]["app"]["config"].get("num-partitions", 0))


def _dump_logs(fed: LocalFederation, tail: int = 60) -> None:
    for role in fed.processes:
        path = fed.log_path(role)
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            print(f"----- {role} log (last {len(lines)} lines) -----", file=sys.stderr)
            print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
