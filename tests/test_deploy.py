"""The Kubernetes manifests (``deploy/kubernetes/``), checked offline.

- Every object validates, strictly (unknown fields refused), against the
  Kubernetes OpenAPI-derived JSON schemas that ``kubernetes-validate`` ships, for
  the oldest version we claim and the newest it knows; mutated copies with a
  wrong type, a misspelt field or a missing required one are refused, so the
  check is not a YAML parse in disguise.
- The ConfigMap's config.toml is a valid router config, read by the loader
  ``serve --config`` uses; the Deployment's args, after the image's entrypoint,
  are accepted by the real ``prefix-router serve`` parser and make a valid
  config with that file, discovery flags (``--discover k8s --k8s-*``) included.
- What the objects say of each other holds: ports and probes match the config's
  listeners and the admin API's open paths, selectors match the pod labels, the
  grace period outlasts preStop plus the router's drain, the pod runs as the
  image's user with a read-only root, the Role grants the EndpointSlice watch to
  the ServiceAccount the pods use, kustomization lists every manifest.
"""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError, latest_version

from admin import cli
from admin.auth import OPEN_PATHS, requires_token
from admin.routes import ROUTES
from router.config import Config, build_config, load_toml, parse_address
from tests.harness.dockerfile import read

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are written for, and the newest schemas we have.
VERSIONS = ("1.30", latest_version())


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) of every manifest but kustomization.yaml."""
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def one(kind: str) -> dict[str, Any]:
    (found,) = (doc for _, doc in documents() if doc["kind"] == kind)
    return found


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = one("Deployment")["spec"]["template"]["spec"]
    return spec


def container() -> dict[str, Any]:
    (router,) = pod_spec()["containers"]
    assert isinstance(router, dict)
    return router


def configmap_config(tmp_path: Path) -> tuple[Path, Config]:
    """The ConfigMap's config.toml, written out and read as `serve --config` reads it."""
    path = tmp_path / "config.toml"
    path.write_text(one("ConfigMap")["data"]["config.toml"])
    return path, build_config(load_toml(path))


def serve_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The real `prefix-router` parser with its `serve` subcommand (parsing only)."""
    parser = argparse.ArgumentParser(prog="prefix-router")
    sub = parser.add_subparsers(dest="command", required=True)
    cli._serve_parser(sub)
    return parser, sub.choices["serve"]


def command_line() -> list[str]:
    """The image's entrypoint and the Deployment's args, $(VAR) expanded as the kubelet does."""
    runtime = read(ROOT / "Dockerfile")[1][-1]
    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert entrypoint.exec_form is not None
    env = {item["name"]: f"<{item['name']}>" for item in container().get("env", [])}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container()["args"]]
    return [*entrypoint.exec_form, *args]


def parsed(argv: list[str], config: Path) -> argparse.Namespace:
    """``argv`` (from `prefix-router` on) through the real parser; --config set to ``config``."""
    assert argv[:2] == ["prefix-router", "serve"]
    parser, serve = serve_parser()
    # Whole names: argparse also takes a prefix, which breaks once another flag shares it.
    flags = [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]
    unknown = [flag for flag in flags if flag not in serve._option_string_actions]
    assert not unknown, f"not flags of prefix-router serve: {unknown}"
    args = parser.parse_args(argv[1:])
    assert args.config == "/etc/prefix-router/config.toml"
    args.config = str(config)
    return args


# -- schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("name", "doc"),
    documents(),
    ids=[f"{name}:{doc['kind']}" for name, doc in documents()],
)
def test_every_manifest_validates_strictly_against_the_kubernetes_schemas(
    name: str, doc: dict[str, Any], version: str
) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value


DELETE = object()
TEMPLATE = "spec.template.spec"
BROKEN = [
    ("Deployment", "spec.replicas", "two"),  # a string where an integer goes
    ("Deployment", f"{TEMPLATE}.containers.0.ports.0.containerPort", "8080"),
    ("Deployment", f"{TEMPLATE}.containers.0.readinesProbe", {"httpGet": {"port": 9091}}),
    ("Deployment", "spec.selector", DELETE),  # required
    ("Deployment", f"{TEMPLATE}.securityContext.runAsNonRoot", "yes"),
    ("Service", "spec.ports.0.port", {"number": 8080}),
    ("Role", "rules.0.verbs", "get"),  # a string where a list goes
    ("PodDisruptionBudget", "spec.minAvailabe", 1),  # misspelt
    ("ConfigMap", "data.config.toml", 42),  # data values are strings
]


@pytest.mark.parametrize(("kind", "path", "value"), BROKEN, ids=[f"{k}:{p}" for k, p, _ in BROKEN])
def test_the_schema_check_refuses_a_broken_copy(kind: str, path: str, value: Any) -> None:
    doc = copy.deepcopy(one(kind))
    if kind == "ConfigMap":  # the key has a dot in it
        doc["data"]["config.toml"] = value
    else:
        _set(doc, path, value)
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_and_sets_the_namespace() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert kustomization["namespace"]
    # The image it rewrites is the one the Deployment names.
    (image,) = kustomization["images"]
    assert container()["image"].split(":")[0] == image["name"]


# -- the router's view of them ------------------------------------------------------


def test_the_configmap_holds_a_valid_sagemaker_shaped_config(tmp_path: Path) -> None:
    text = one("ConfigMap")["data"]["config.toml"]
    assert "[RoutingConfig]" in text
    _, config = configmap_config(tmp_path)
    assert config.routing.strategy.value == "PREFIX_AWARE"
    assert config.routing.prefix_aware.prefix_length == 4096
    assert config.backends == []  # discovery supplies them
    assert config.state_file is None  # nothing to write: the root filesystem is read-only
    document = config.routing.document()
    assert set(document) == {"RoutingConfig"}


def test_the_entrypoint_reads_the_configmap_file() -> None:
    argv = command_line()
    config_path = Path(argv[argv.index("--config") + 1])
    (mount,) = (m for m in container()["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    (volume,) = (v for v in pod_spec()["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    assert config_path.name in one("ConfigMap")["data"]


def test_the_deployment_args_parse_and_build_a_config(tmp_path: Path) -> None:
    """The Deployment's args, through the real serve parser and config builder."""
    path, _ = configmap_config(tmp_path)
    args = parsed(command_line(), path)
    config = cli.config_from_args(args)
    assert config.discover is not None
    assert (config.discover.source, config.discover.service) == ("k8s", "vllm")
    host, _ = parse_address(config.admin_listen)
    # Off loopback the daemon refuses to start without a token: the args give the
    # file, and it is where the Secret volume is mounted, under the Secret's key.
    assert requires_token(host)
    token = Path(args.admin_token_file)
    (secret,) = (v for v in pod_spec()["volumes"] if "secret" in v)
    (mount,) = (m for m in container()["volumeMounts"] if m["name"] == secret["name"])
    assert str(token.parent) == mount["mountPath"]
    assert token.name == "token"


def test_ports_and_probes_match_the_config_and_the_admin_api(tmp_path: Path) -> None:
    _, config = configmap_config(tmp_path)
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {
        "http": config.listen_address[1],
        "admin": parse_address(config.admin_listen)[1],
    }
    assert config.listen_address[0] == "0.0.0.0"
    get_paths = {path for method, path, _ in ROUTES if method == "GET"}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        http_get = container()[probe]["httpGet"]
        assert http_get == {"path": path, "port": "admin"}
        assert path in get_paths
        assert path in OPEN_PATHS  # the kubelet sends no token
    service = one("Service")
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in ports


def test_selectors_all_match_the_pod_labels() -> None:
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert one("Service")["spec"]["selector"] == labels
    assert one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == labels
    (term,) = pod_spec()["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == labels
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert deployment["spec"]["replicas"] == 2
    assert one("PodDisruptionBudget")["spec"]["minAvailable"] == 1


def test_the_grace_period_outlasts_the_prestop_and_the_drain(tmp_path: Path) -> None:
    _, config = configmap_config(tmp_path)
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    grace = pod_spec()["terminationGracePeriodSeconds"]
    # SIGTERM comes after preStop; the router then drains for up to shutdown_grace.
    assert grace > pre_stop + config.timeouts.shutdown_grace


def test_the_pod_runs_as_the_image_user_with_a_read_only_root() -> None:
    runtime = read(ROOT / "Dockerfile")[1][-1]
    pod = pod_spec()["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert str(pod["runAsUser"]) == runtime.args()["UID"]
    assert str(pod["runAsGroup"]) == runtime.args()["GID"]
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    box = container()["securityContext"]
    assert box["readOnlyRootFilesystem"] is True
    assert box["allowPrivilegeEscalation"] is False
    assert box["capabilities"] == {"drop": ["ALL"]}
    resources = container()["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    # The one writable place is an emptyDir /tmp; the config comes read-only.
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    assert mounts["/etc/prefix-router"]["readOnly"] is True
    (tmp,) = (v for v in pod_spec()["volumes"] if v["name"] == mounts["/tmp"]["name"])
    assert "emptyDir" in tmp


def test_rbac_grants_the_endpointslice_watch_to_the_pods_service_account() -> None:
    account = one("ServiceAccount")["metadata"]["name"]
    assert pod_spec()["serviceAccountName"] == account
    role = one("Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = one("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert (subject["kind"], subject["name"]) == ("ServiceAccount", account)
    # The router watches the namespace it runs in: the args name it from the pod.
    argv = container()["args"]
    assert argv[argv.index("--k8s-namespace") + 1] == "$(POD_NAMESPACE)"
    (env,) = (e for e in container()["env"] if e["name"] == "POD_NAMESPACE")
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
