"""The deployment artefacts agree with each other and with the repository.

No container engine or Kubernetes cluster is needed: these tests parse deploy/*.yaml,
docker-compose.yml and deploy/Dockerfile, and pin what must stay consistent across them:
two images (the CPU data nodes' without CUDA), one serve command, one config path, the ports, the worker groups, the Ray and
torch versions of .ci/constraints.txt, the API token coming from a secret, and the Ray
cluster's auth token reaching every pod and every compose service from one Secret or the
caller's environment.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
IMAGE = "tokenmill:latest"
DATA_IMAGE = "tokenmill-data:latest"  # the CPU data nodes: deploy/Dockerfile --target data
SERVE = "python -m service serve --config"
MANIFESTS = [
    "deploy/raycluster.yaml",
    "deploy/rayjob.yaml",
    "deploy/service.yaml",
    "docker-compose.yml",
]
DATA_GROUP, GPU_GROUP = "data-cpu", "trainer-gpu"
GPU = "nvidia.com/gpu"
# The Secret holding the Ray cluster's token. KubeRay's authOptions.secretName requires the
# key `auth_token`.
RAY_AUTH_SECRET = {"name": "tokenmill-ray-auth", "key": "auth_token"}
RAY_TOKEN_AUTH_MIN = (2, 52)  # the first Ray with token authentication


def _load(rel: str) -> list[dict]:
    with open(ROOT / rel) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _one(rel: str, kind: str) -> dict:
    docs = [d for d in _load(rel) if d.get("kind") == kind]
    assert len(docs) == 1, f"{rel}: expected one {kind}, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def cluster_spec() -> dict:
    return _one("deploy/raycluster.yaml", "RayCluster")["spec"]


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return _one("deploy/rayjob.yaml", "RayJob")


@pytest.fixture(scope="module")
def compose() -> dict:
    (doc,) = _load("docker-compose.yml")
    return doc["services"]


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            instr, _, args = line.strip().partition(" ")
            out.append((instr.upper(), " ".join(args.split())))
    return out


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci/constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip()
    return pins


def _groups(spec: dict) -> dict[str, dict]:
    """Every Ray node group of a RayCluster spec by name, the head as 'head'."""
    groups = {"head": spec["headGroupSpec"]}
    for g in spec["workerGroupSpecs"]:
        groups[g["groupName"]] = g
    return groups


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _pod_templates(cluster_spec: dict, rayjob: dict) -> dict[str, dict]:
    """Every pod template of both KubeRay manifests: each node group's, and the RayJob's
    submitter if it has one."""
    templates = {}
    for where, spec in [("raycluster", cluster_spec), ("rayjob", rayjob["spec"]["rayClusterSpec"])]:
        for name, group in _groups(spec).items():
            templates[f"{where}/{name}"] = group["template"]
    if "submitterPodTemplate" in rayjob["spec"]:
        templates["rayjob/submitter"] = rayjob["spec"]["submitterPodTemplate"]
    return templates


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _resources(group: dict) -> dict:
    """The Ray container's requests and limits merged (limits win)."""
    res = _containers(group)[0].get("resources", {})
    return {**res.get("requests", {}), **res.get("limits", {})}


def _command(service: dict) -> str:
    cmd = service["command"]
    return cmd if isinstance(cmd, str) else " ".join(cmd)


def _flag(command: str, name: str) -> str:
    """The value of `--name V` or `--name=V` in a shell command line."""
    words = shlex.split(command)
    for i, w in enumerate(words):
        if w == name:
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    raise AssertionError(f"{name} not in {command!r}")


def _published(port) -> tuple[int, int]:
    """(host, container) for a compose port in short ('[ip:]host:container') or long form."""
    if isinstance(port, dict):
        return int(port["published"]), int(port["target"])
    *_, host, container = str(port).split("/")[0].split(":")
    return int(host), int(container)


def test_every_manifest_parses():
    for rel in MANIFESTS:
        docs = _load(rel)
        assert docs, f"{rel}: no YAML documents"
        for doc in docs:
            assert isinstance(doc, dict), f"{rel}: a document is not a mapping"
    for rel in MANIFESTS[:3]:
        for doc in _load(rel):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{rel}: not a k8s object"


def test_one_image_everywhere(cluster_spec, rayjob, compose):
    images = {}
    for where, spec in [("raycluster", cluster_spec), ("rayjob", rayjob["spec"]["rayClusterSpec"])]:
        for name, group in _groups(spec).items():
            for c in _containers(group):
                images[f"{where}/{name}/{c['name']}"] = c.get("image")
    for c in rayjob["spec"].get("submitterPodTemplate", {}).get("spec", {}).get("containers", []):
        images[f"rayjob/submitter/{c['name']}"] = c.get("image")
    for name, svc in compose.items():
        images[f"compose/{name}"] = svc.get("image")
    assert len(images) >= 10  # 3 groups x 2 manifests + 4 compose services
    data = {k for k in images if f"/{DATA_GROUP}/" in k or k == "compose/ray-worker"}
    assert len(data) == 3, data
    assert {k: v for k, v in images.items() if v != (DATA_IMAGE if k in data else IMAGE)} == {}


def test_compose_builds_the_image_from_the_dockerfile(compose):
    for name, svc in compose.items():
        build = svc.get("build")
        assert build, f"compose service {name!r} does not build {IMAGE}"
        context = ROOT / build["context"]
        assert context.resolve() == ROOT, f"{name}: build context must be the repo root"
        assert (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        want = "data" if svc["image"] == DATA_IMAGE else None
        assert build.get("target") == want, f"{name}: builds target {build.get('target')!r}"


def test_worker_groups_and_resources(cluster_spec):
    groups = _groups(cluster_spec)
    assert set(groups) == {"head", DATA_GROUP, GPU_GROUP}

    # The head advertises no CPUs, so Ray Data work goes to the workers.
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"
    assert groups["head"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"

    gpu = groups[GPU_GROUP]
    assert int(_resources(gpu).get(GPU, 0)) >= 1, f"{GPU_GROUP} requests no {GPU}"
    # Ray must advertise the GPUs the pod actually gets.
    assert gpu["rayStartParams"]["num-gpus"] == str(_resources(gpu)[GPU])

    data = groups[DATA_GROUP]
    assert GPU not in _resources(data), f"{DATA_GROUP} must not hold a GPU"
    assert "num-gpus" not in data["rayStartParams"] or data["rayStartParams"]["num-gpus"] == "0"
    # One single-threaded tokenizer per core the pod really has.
    assert data["rayStartParams"]["num-cpus"] == str(_resources(data)["cpu"])
    assert int(data["replicas"]) >= 1


def test_rayjob_runs_the_same_cluster(cluster_spec, rayjob):
    assert rayjob["spec"]["rayClusterSpec"] == cluster_spec


def test_rayjob_entrypoint_and_lifecycle(rayjob):
    spec = rayjob["spec"]
    assert spec["entrypoint"].startswith(SERVE), spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["RAYON_NUM_THREADS"] == "1"
    for secret in ("TOKENMILL_API_TOKEN", "RAY_AUTH_TOKEN"):
        assert secret not in spec["runtimeEnvYAML"], "no secrets in the runtime env"


def test_config_path_is_the_same_everywhere(rayjob, compose, dockerfile):
    job_config = _flag(rayjob["spec"]["entrypoint"], "--config")
    compose_config = _flag(_command(compose["tokenmill"]), "--config")
    assert job_config == compose_config
    # The path lies inside the tree the image copies the repository to.
    (app,) = {args.split()[-1] for instr, args in dockerfile if instr == "COPY"}  # both images
    assert Path(job_config).is_relative_to(app), f"{job_config} is outside {app}"


def test_compose_tokenmill_service(compose):
    svc = compose["tokenmill"]
    assert SERVE in _command(svc)
    assert (8000, 8000) in [_published(p) for p in svc["ports"]]
    env = svc["environment"]
    assert env["TOKENMILL_HOST"] == "0.0.0.0"
    # The token is required from the caller's environment, never written in the file.
    assert re.fullmatch(r"\$\{TOKENMILL_API_TOKEN:\?[^}]*\}", env["TOKENMILL_API_TOKEN"])


def test_compose_cluster_wiring(compose):
    head = _command(compose["ray-head"])
    assert "--head" in shlex.split(head)
    gcs = f"ray-head:{_flag(head, '--port')}"
    assert _flag(head, "--num-cpus") == "0"
    assert _flag(_command(compose["ray-worker"]), "--address") == gcs
    assert int(_flag(_command(compose["ray-worker"]), "--num-cpus")) > 0
    for name in ("tokenmill", "trainer"):
        assert _flag(_command(compose[name]), "--address") == gcs, name
    trainer = _command(compose["trainer"])
    assert "torchrun" in trainer and "trainer.train" in trainer
    assert _flag(trainer, "--service") == "tokenmill"
    assert "ray-head" in compose["ray-worker"]["depends_on"]
    assert "tokenmill" in compose["trainer"]["depends_on"]
    for name in ("ray-head", "ray-worker"):
        assert compose[name]["shm_size"] == "2gb", f"{name}: Ray's object store needs /dev/shm"


def _stages(dockerfile) -> dict[str, list[str]]:
    """RUN arguments of each named build stage."""
    stages, name = {}, None
    for instr, args in dockerfile:
        if instr == "FROM":
            name = args.split(" AS ")[-1] if " AS " in args else args
            stages[name] = []
        elif instr == "RUN":
            stages[name].append(args)
    return stages


def test_dockerfile_installs_pinned(dockerfile):
    assert dockerfile[0] == ("FROM", "python:3.11-slim AS base")
    stages = _stages(dockerfile)
    assert list(stages) == ["base", "data", "full"], list(stages)  # `full` is the default
    pins = _pins()
    extras = {"data": ".[serve,mds]", "full": ".[serve,mds,trainer,dev]"}
    for stage, runs in stages.items():
        if stage == "base":
            assert not any("pip install" in r for r in runs)
            continue
        project = [r for r in runs if "pip install" in r and "-e" in shlex.split(r)]
        assert len(project) == 1, runs
        words = shlex.split(project[0])
        assert words[words.index("-c") + 1] == ".ci/constraints.txt"
        assert words[words.index("-e") + 1] == extras[stage]
        # torch/torchvision are installed first, with the same pins as CI.
        torch = [r for r in runs if "torch==" in r]
        assert torch and runs.index(torch[0]) < runs.index(project[0])
        for pkg in ("torch", "torchvision"):
            assert f"{pkg}=={pins[pkg]}" in shlex.split(torch[0]), f"{pkg} pin differs from CI"
        # The CPU data image takes PyTorch's CPU-only wheels: no CUDA libraries.
        cpu_index = "https://download.pytorch.org/whl/cpu" in torch[0]
        assert cpu_index == (stage == "data"), stage
        assert any("default_tokenizer_file()" in r for r in runs), "tokenizer cache not pre-built"
        assert any("service corpus" in r for r in runs), "demo corpus not built"
    assert (ROOT / ".ci/constraints.txt").is_file()
    env = " ".join(args for instr, args in dockerfile if instr == "ENV")
    assert "RAYON_NUM_THREADS=1" in env and "TOKENIZERS_PARALLELISM=false" in env


def test_ray_version_matches_the_image(cluster_spec):
    assert cluster_spec["rayVersion"] == _pins()["ray"]


def test_ports_agree(cluster_spec, dockerfile):
    exposed = {
        int(p.split("/")[0])
        for instr, args in dockerfile
        if instr == "EXPOSE"
        for p in args.split()
    }
    assert {8000, 6379, 8265, 10001} <= exposed
    head_ports = {
        p["containerPort"] for p in _containers(cluster_spec["headGroupSpec"])[0]["ports"]
    }
    assert {8000, 6379, 8265, 10001} <= head_ports <= exposed

    svc = _one("deploy/service.yaml", "Service")
    assert {p["port"] for p in svc["spec"]["ports"]} == {8000, 8265}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= head_ports


def test_service_selects_the_head_of_either_manifest(cluster_spec, rayjob):
    selector = _one("deploy/service.yaml", "Service")["spec"]["selector"]
    assert selector.pop("ray.io/node-type") == "head"  # KubeRay's label on head pods
    assert selector, "select more than ray.io/node-type, or every Ray cluster's head matches"
    for spec in (cluster_spec, rayjob["spec"]["rayClusterSpec"]):
        labels = spec["headGroupSpec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()


def test_api_token_comes_from_the_secret(cluster_spec):
    for name, group in _groups(cluster_spec).items():
        for c in _containers(group):
            env = {e["name"]: e for e in c.get("env", [])}
            token = env.get("TOKENMILL_API_TOKEN")
            assert token is not None, f"{name}/{c['name']}: no TOKENMILL_API_TOKEN"
            assert "value" not in token, f"{name}: the token must not be written in the manifest"
            assert token["valueFrom"]["secretKeyRef"] == {"name": "tokenmill-api", "key": "token"}
    head_env = {
        e["name"]: e.get("value") for e in _containers(cluster_spec["headGroupSpec"])[0]["env"]
    }
    assert head_env["TOKENMILL_HOST"] == "0.0.0.0", "the API must listen beyond loopback"


def test_kuberay_token_auth_names_our_secret(cluster_spec):
    # KubeRay (>= 1.6.0) then injects the token into the containers it adds itself (wait-gcs-ready,
    # the RayJob submitter) and presents it on its own job API calls, from the same Secret.
    assert cluster_spec["authOptions"] == {"mode": "token", "secretName": RAY_AUTH_SECRET["name"]}
    ray = tuple(int(x) for x in cluster_spec["rayVersion"].split(".")[:2])
    assert ray >= RAY_TOKEN_AUTH_MIN, f"Ray {cluster_spec['rayVersion']} has no token auth"


def test_ray_token_reaches_every_pod(cluster_spec, rayjob):
    templates = _pod_templates(cluster_spec, rayjob)
    assert "rayjob/submitter" in templates, "the submitter calls the job API: it needs the token"
    assert len(templates) == 7  # 3 groups x 2 manifests + the submitter
    for where, template in templates.items():
        spec = template["spec"]
        containers = spec["containers"] + spec.get("initContainers", [])
        assert containers, where
        for c in containers:
            env = _env(c)
            at = f"{where}/{c['name']}"
            assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{at}: RAY_AUTH_MODE"
            token = env.get("RAY_AUTH_TOKEN")
            assert token is not None, f"{at}: no RAY_AUTH_TOKEN"
            assert "value" not in token, f"{at}: the Ray token must not be written in the manifest"
            assert token["valueFrom"]["secretKeyRef"] == RAY_AUTH_SECRET, at


def test_compose_ray_token(compose):
    ray_services = {name for name, svc in compose.items() if "ray start" in _command(svc)}
    assert ray_services == {"ray-head", "ray-worker", "tokenmill", "trainer"}
    for name in ray_services:
        env = compose[name].get("environment") or {}
        assert isinstance(env, dict), f"{name}: environment as a mapping"
        assert env.get("RAY_AUTH_MODE") == "token", name
        # Required from the caller's environment, never written in the file.
        assert re.fullmatch(r"\$\{RAY_AUTH_TOKEN:\?[^}]*\}", env.get("RAY_AUTH_TOKEN", "")), name


def test_no_token_is_written_anywhere():
    for rel in MANIFESTS:
        text = (ROOT / rel).read_text()
        # Something shaped like `openssl rand -hex 32` output, or a UUID-hex Ray token.
        assert not re.search(r"\b[0-9a-fA-F]{32,}\b", text), f"{rel}: a literal token?"
        for doc in _load(rel):
            assert doc.get("kind") != "Secret", f"{rel}: create Secrets with kubectl, not here"


def test_docs_create_the_secret_the_manifests_read():
    create = (
        f"kubectl create secret generic {RAY_AUTH_SECRET['name']} "
        f"--from-literal={RAY_AUTH_SECRET['key']}="
    )
    for rel in ("deploy/raycluster.yaml", "deploy/rayjob.yaml", "deploy/README.md"):
        assert create in (ROOT / rel).read_text(), f"{rel} does not say how to create the Secret"
    assert "export RAY_AUTH_TOKEN=" in (ROOT / "docker-compose.yml").read_text()
