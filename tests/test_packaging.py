"""Packaging and the container image: the wheel, a fresh install, the Dockerfile.

- The wheel is built from exactly what the Dockerfile's builder stage copies, and
  holds ``hashring/``, ``router/`` and ``admin/`` (no tests, no load tests).
  Installed as the builder stage installs it (a virtual environment without pip,
  ``pip install --no-index --find-links`` over wheels of the runtime dependencies
  only), its ``prefix-router`` answers ``--help`` and ``serve --help``, and
  ``serve`` with the image's default config runs from that environment alone:
  the image's own HEALTHCHECK command passes against its admin API (and fails
  against a 503), nothing is written to its working directory, SIGTERM exits 0.
- The Dockerfile and .dockerignore are checked statically, always: multi-stage,
  slim Python 3.11, a fixed non-root user, the entrypoint, the ports, the
  health check, every COPY source inside the build context.
- ``docker build`` runs where a Docker daemon answers, and is skipped with the
  reason where none does (this machine has the client and no daemon).

The dependency wheels (and setuptools, to build ours without an index) are
downloaded once into ``<venv>/wheelhouse/<digest of the requirements>``; after
that the packaging tests need no network.  Measured here: ~5 s a run with the
wheelhouse in place, a few seconds more to fill it from pip's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.config import build_config, load_toml, parse_address
from tests.harness.dockerfile import DockerIgnore, Stage, read

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
IMAGE_CONFIG = "/etc/prefix-router/config.toml"
IMAGE_UID = "10001"
# The packages the wheel must hold, and top-level folders it must not.
PACKAGES = {"hashring", "router", "admin"}
NOT_SHIPPED = {"tests", "loadtests", "deploy"}
# The first test to ask for the wheel pays for the wheelhouse (a download on a new
# machine), the build and the venv: ~5 s here, more on a loaded or fresh machine.
# A guard against a hang, not a speed claim.
WHEEL_SETUP = pytest.mark.timeout(300)


def pyproject() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a child that must not see this checkout's modules."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def pip(*args: str, cwd: Path | None = None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(),
        timeout=300,
    )
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def stages() -> list[Stage]:
    return read(DOCKERFILE)[1]


def builder_sources() -> list[str]:
    """What the builder stage COPYs from the build context (it builds the wheel from these)."""
    return [
        source
        for copy in stages()[0].all("COPY")
        if "from" not in copy.flags
        for source in copy.rest.split()[:-1]
    ]


# -- the wheel and a fresh install ----------------------------------------------------


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of the runtime dependencies and of the build backend, fetched once."""
    data = pyproject()
    requirements = sorted(data["project"]["dependencies"])  # type: ignore[index]
    requirements += sorted(data["build-system"]["requires"])  # type: ignore[index]
    tag = f"{sys.implementation.cache_tag}-{platform.machine()}-{sys.platform}"
    digest = hashlib.sha256(json.dumps([tag, requirements]).encode()).hexdigest()[:16]
    in_venv = sys.prefix != sys.base_prefix
    base = Path(sys.prefix) / "wheelhouse" if in_venv else tmp_path_factory.mktemp("wheelhouse")
    house = base / digest
    if (house / ".complete").is_file():
        return house
    staging = tmp_path_factory.mktemp("wheelhouse-staging")
    pip("download", "--only-binary=:all:", "--dest", str(staging), *requirements)
    (staging / ".complete").write_text("\n".join(requirements) + "\n")
    base.mkdir(parents=True, exist_ok=True)
    if not house.exists():  # another run may have filled it meanwhile: theirs is as good
        shutil.copytree(staging, house)
    return house


@pytest.fixture(scope="session")
def wheel(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built (no index) from a copy of what the builder stage copies."""
    source = tmp_path_factory.mktemp("context")
    for name in builder_sources():
        origin = ROOT / name
        if origin.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
            shutil.copytree(origin, source / name, ignore=ignore)
        else:
            shutil.copy2(origin, source / name)
    dist = tmp_path_factory.mktemp("dist")
    pip(
        "wheel",
        "--no-deps",
        "--no-index",
        "--find-links",
        str(wheelhouse),
        "-w",
        str(dist),
        ".",
        cwd=source,
    )
    (built,) = dist.glob("prefix_router-*.whl")
    return built


@pytest.fixture(scope="session")
def fresh_venv(wheel: Path, wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with the wheel and its runtime dependencies only."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip(
        "--python",
        str(python),
        "install",
        "--no-index",
        "--find-links",
        str(wheelhouse),
        str(wheel),
    )
    return venv


@WHEEL_SETUP
def test_the_wheel_holds_the_three_packages_and_no_tests(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == PACKAGES, names
    assert not tops & NOT_SHIPPED
    assert not [name for name in names if "/test_" in name or name.endswith(".pyc")]
    # Every module of the source tree is in the wheel (no package left out by find).
    for package in PACKAGES:
        for module in (ROOT / package).rglob("*.py"):
            assert module.relative_to(ROOT).as_posix() in names
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as archive:
        assert "prefix-router = admin.cli:main" in archive.read(entry_points).decode()


@WHEEL_SETUP
def test_the_installed_command_answers_help_from_the_fresh_venv(fresh_venv: Path) -> None:
    command = fresh_venv / "bin" / "prefix-router"
    top = subprocess.run([command, "--help"], capture_output=True, text=True, env=clean_env())
    assert top.returncode == 0, top.stderr
    assert "serve" in top.stdout
    assert "demo" in top.stdout
    serve = subprocess.run(
        [command, "serve", "--help"], capture_output=True, text=True, env=clean_env()
    )
    assert serve.returncode == 0, serve.stderr
    assert serve.stdout.startswith("usage: prefix-router serve")
    assert "--config FILE" in serve.stdout
    # It ran from the venv, not from this checkout.
    where = subprocess.run(
        [fresh_venv / "bin" / "python", "-c", "import router, admin; print(router.__file__)"],
        capture_output=True,
        text=True,
        cwd=fresh_venv,
        env=clean_env(),
    )
    assert where.stdout.startswith(str(fresh_venv)), where


def healthcheck_command(venv: Path) -> list[str]:
    """The image's HEALTHCHECK, with `python` resolved as the image's PATH resolves it."""
    (check,) = stages()[-1].all("HEALTHCHECK")
    argv = check.rest.removeprefix("CMD").strip()
    command = json.loads(argv)
    assert command[0] == "python"
    return [str(venv / "bin" / "python"), *command[1:]]


@pytest.fixture
def served(fresh_venv: Path, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """``prefix-router serve`` from the fresh venv with the image's default config
    (ports made ephemeral); yields the admin port and its (empty) working directory."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    proc = subprocess.Popen(
        [
            fresh_venv / "bin" / "prefix-router",
            "serve",
            "--config",
            ROOT / "deploy" / "docker" / "config.toml",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        cwd=workdir,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        seen = []
        admin_port = None
        for _ in range(100):  # a handful of start-up lines; bounded all the same
            line = proc.stderr.readline()
            assert line, f"serve exited before its admin API listened: {seen}"
            event = json.loads(line)
            seen.append(event)
            if event["event"] == "admin listening":
                admin_port = int(event["address"].rpartition(":")[2])
                break
        assert admin_port is not None, seen
        yield admin_port, workdir
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@WHEEL_SETUP
def test_the_fresh_venv_serves_and_passes_the_image_healthcheck(
    served: tuple[int, Path], fresh_venv: Path
) -> None:
    admin_port, workdir = served
    command = healthcheck_command(fresh_venv)

    def check(path: str) -> subprocess.CompletedProcess[str]:
        url = f"http://127.0.0.1:{admin_port}{path}"
        # A proxy in the environment (port 9, discard: nothing listens) must not catch it.
        proxy = {"http_proxy": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}
        env = clean_env(PREFIX_ROUTER_HEALTH_URL=url, **proxy)
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=30)

    healthy = check("/healthz")
    assert healthy.returncode == 0, healthy.stderr
    # The same command fails on a non-2xx: /readyz is 503 with no backends.
    not_ready = check("/readyz")
    assert not_ready.returncode != 0
    assert "503" in not_ready.stderr
    assert list(workdir.iterdir()) == []  # nothing written where it runs


# -- the Dockerfile, statically --------------------------------------------------------


def test_the_dockerfile_is_multi_stage_on_one_slim_python_3_11_base() -> None:
    global_args, found = read(DOCKERFILE)
    assert len(found) >= 2
    builder, runtime = found[0], found[-1]
    assert builder.name == "builder"
    assert runtime.base.startswith("python:3.11-slim"), runtime.base
    # The builder's virtual environment is copied whole: its interpreter symlink
    # only holds if both stages have the same base.
    assert builder.base == runtime.base
    assert "PYTHON_IMAGE" in global_args


def test_the_runtime_stage_gets_the_environment_and_not_the_sources() -> None:
    builder, runtime = stages()[0], stages()[-1]
    (install,) = (run for run in builder.all("RUN") if "pip wheel" in run.rest)
    assert "venv --without-pip /opt/prefix-router" in install.rest
    assert "install --no-index --find-links /wheels" in install.rest
    assert "[dev]" not in install.rest
    copies = runtime.all("COPY")
    from_builder = [c for c in copies if c.flags.get("from") == "builder"]
    assert [c.rest for c in from_builder] == ["/opt/prefix-router /opt/prefix-router"]
    from_context = [c.rest.split()[0] for c in copies if "from" not in c.flags]
    assert from_context == ["deploy/docker/config.toml"]
    assert runtime.env()["PATH"].startswith("/opt/prefix-router/bin:")
    assert not runtime.all("ADD")


def test_the_image_runs_as_a_fixed_non_root_user() -> None:
    runtime = stages()[-1]
    users = runtime.all("USER")
    assert users, "no USER: the image would run as root"
    args = runtime.args()
    user = users[-1].rest.replace("${UID}", args["UID"]).replace("${GID}", args["GID"])
    uid, _, gid = user.partition(":")
    # Numeric, so the kubelet can enforce runAsNonRoot without reading /etc/passwd.
    assert uid == IMAGE_UID
    assert gid.isdigit()
    assert gid != "0"
    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert users[-1].line < entrypoint.line
    adduser = next(run for run in runtime.all("RUN") if "useradd" in run.rest)
    assert '--uid "${UID}"' in adduser.rest
    assert "--shell /usr/sbin/nologin" in adduser.rest


def test_the_entrypoint_serves_the_mounted_config() -> None:
    runtime = stages()[-1]
    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert entrypoint.exec_form == ["prefix-router", "serve", "--config", IMAGE_CONFIG]
    scripts = pyproject()["project"]["scripts"]  # type: ignore[index]
    assert "prefix-router" in scripts
    (cmd,) = runtime.all("CMD")
    assert cmd.exec_form == []  # `docker run IMAGE --flag ...` adds serve flags
    (config_copy,) = (c for c in runtime.all("COPY") if c.rest.endswith(IMAGE_CONFIG))
    assert config_copy.rest.split()[0] == "deploy/docker/config.toml"


def test_the_default_config_matches_the_exposed_ports_and_the_healthcheck() -> None:
    runtime = stages()[-1]
    config = build_config(load_toml(ROOT / "deploy" / "docker" / "config.toml"))
    exposed = {int(port.split("/")[0]) for e in runtime.all("EXPOSE") for port in e.rest.split()}
    listen_port = config.listen_address[1]
    admin_host, admin_port = parse_address(config.admin_listen)
    assert exposed == {listen_port, admin_port}
    assert config.listen_address[0] == "0.0.0.0"  # reachable through -p
    # Loopback: the image starts without a token, and the health check reaches it.
    assert admin_host == "127.0.0.1"
    url = runtime.env()["PREFIX_ROUTER_HEALTH_URL"]
    assert url == f"http://{admin_host}:{admin_port}/healthz"
    assert config.backends == []


def test_the_healthcheck_uses_the_stdlib_and_the_health_url() -> None:
    (check,) = stages()[-1].all("HEALTHCHECK")
    assert check.rest.startswith("CMD [")
    command = json.loads(check.rest.removeprefix("CMD"))
    assert command[:2] == ["python", "-c"]
    code = command[2]
    assert "urllib.request" in code
    assert "PREFIX_ROUTER_HEALTH_URL" in code
    assert "ProxyHandler({})" in code  # an HTTP_PROXY in the environment must not catch it
    assert "curl" not in check.rest
    assert "wget" not in check.rest
    assert {"interval", "timeout", "start-period", "retries"} <= set(check.flags)


def test_the_image_writes_nothing_outside_tmp_and_its_state_dir() -> None:
    runtime = stages()[-1]
    env = runtime.env()
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # the venv was compiled at install
    state = next(run for run in runtime.all("RUN") if "install -d" in run.rest)
    assert "/var/lib/prefix-router" in state.rest
    (workdir,) = runtime.all("WORKDIR")
    assert workdir.rest == "/var/lib/prefix-router"
    assert not runtime.all("VOLUME")  # no anonymous volumes behind the operator's back


def test_every_copy_source_is_in_the_build_context() -> None:
    ignore = DockerIgnore((ROOT / ".dockerignore").read_text())
    sources = [*builder_sources(), "deploy/docker/config.toml"]
    for source in sources:
        path = ROOT / source
        assert path.exists(), source
        files = [p for p in path.rglob("*.py")] if path.is_dir() else [path]
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            if "__pycache__" not in relative:
                assert not ignore.excluded(relative), f"{relative} is left out by .dockerignore"
    # ... and what the image must not be built from is left out.
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/test_packaging.py",
        "loadtests/bench.py",
        "results/x.json",
        "router/__pycache__/app.cpython-311.pyc",
        "deploy/kubernetes/deployment.yaml",
    ):
        assert ignore.excluded(path), path


def test_the_dockerignore_reader_follows_dockers_rules() -> None:
    ignore = DockerIgnore("# c\n*.md\n!README.md\nbuild/\n**/*.pyc\n!keep/**/*.pyc\n")
    assert ignore.excluded("NOTES.md")
    assert not ignore.excluded("README.md")
    assert not ignore.excluded("docs/x.md")  # * stays within one segment
    assert ignore.excluded("build/lib/x.py")  # a matched directory takes its contents
    assert ignore.excluded("a/b/c.pyc")
    assert not ignore.excluded("keep/a/c.pyc")
    assert not ignore.excluded("router/app.py")


# -- docker build, where a daemon answers ---------------------------------------------


def docker_unavailable() -> str | None:
    """Why ``docker build`` cannot run here, or None if it can."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker client on PATH"
    try:
        info = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        return f"`{docker} info` did not answer within 30 s"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"docker client at {docker} but no daemon answers `docker info`: {last}"
    return None


@pytest.mark.timeout(1800)  # pulls the base image and PyPI wheels the first time
def test_docker_build_and_run_help() -> None:
    reason = docker_unavailable()
    if reason is not None:
        pytest.skip(reason)
    image = f"prefix-router:test-{os.getpid()}"

    def docker(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=1500)

    built = docker("build", "--tag", image, str(ROOT))
    assert built.returncode == 0, built.stdout + built.stderr
    try:
        helped = docker("run", "--rm", "--read-only", "--tmpfs", "/tmp", image, "--help")
        assert helped.returncode == 0, helped.stderr
        assert helped.stdout.startswith("usage: prefix-router serve")
        uid = docker("run", "--rm", "--entrypoint", "id", image, "-u")
        assert uid.stdout.strip() == IMAGE_UID
        inspected = docker("image", "inspect", image, "--format", "{{json .Config}}")
        config = json.loads(inspected.stdout)
        assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
        assert config["Healthcheck"]["Test"][0] == "CMD"
        # Runtime dependencies only: neither pip nor the dev extra is in the environment.
        for module in ("pip", "pytest"):
            found = docker("run", "--rm", "--entrypoint", "python", image, "-c", f"import {module}")
            assert found.returncode != 0, module
    finally:
        docker("image", "rm", "--force", image)
