#!/usr/bin/env python3
"""Offline checks of the shardserve Helm chart and the deployment files (the helm_* ctest tests).

No cluster and no Helm binary: tests/helm/render renders the chart with Helm's template engine
(Go text/template + Sprig + Helm's own functions), then every rendered manifest is validated
against the Kubernetes API schemas of the pinned kubernetes-validate (strict: unknown fields are
errors) for the oldest Kubernetes the chart supports and the newest the validator knows, yamllint
reads the output, and cross-object rules that a schema cannot see are checked (selectors match pod
labels, the address each worker advertises is its headless Service's DNS name, the coordinator
waits for as many workers as the StatefulSets run, ...).

  check_chart.py --tools DIR render SET...    render and validate value sets (default, or
                                              helm/shardserve/ci/SET-values.yaml)
  check_chart.py --tools DIR bad-values       every tests/helm/bad-values file must be rejected
                                              with the message it names
  check_chart.py --tools DIR chart            Chart.yaml, values.yaml vs schema and README,
                                              yamllint of the chart's YAML, dashboards in sync
  check_chart.py images [--bin DIR]           deploy/docker: pinned bases, the install script and
                                              build outputs they use, runtime library closure
  check_chart.py prometheus                   deploy/prometheus scrape configuration

--tools is the folder tests/helm/setup.sh filled (the renderer and the venv this runs in).
"""
import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "shardserve"
HERE = ROOT / "tests" / "helm"
RELEASE = "shardserve-ci"
NAMESPACE = "llm"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas of the
# pinned kubernetes-validate (tests/helm/requirements.txt).
K8S_VERSIONS = ["1.25.0", "1.37.0"]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class Failures:
    def __init__(self):
        self.items = []

    def check(self, ok, message):
        if not ok:
            self.items.append(message)
        return ok

    def report(self, what):
        if self.items:
            print(f"FAILED: {what}")
            for m in self.items:
                print(f"  - {m}")
            return 1
        print(f"ok: {what}")
        return 0


# ------------------------------------------------------------------------------------------------
# Rendering


def value_file(name):
    return None if name == "default" else CHART / "ci" / f"{name}-values.yaml"


def render(tools, values_files, kube_version="1.30.0", notes=None):
    cmd = [str(Path(tools) / "render"), "--chart", str(CHART), "--release", RELEASE, "--namespace",
           NAMESPACE, "--kube-version", kube_version]
    for f in values_files:
        cmd += ["-f", str(f)]
    if notes:
        cmd += ["--notes", str(notes)]
    return subprocess.run(cmd, capture_output=True, text=True)


def documents(text):
    return [d for d in yaml.safe_load_all(text) if d is not None]


# ------------------------------------------------------------------------------------------------
# Validation of one rendered value set


def validate_schemas(docs, fail):
    import jsonschema
    import kubernetes_validate
    custom = {}
    for path in (HERE / "schemas").glob("*.json"):
        schema = json.loads(path.read_text())
        api = schema["properties"]["apiVersion"]["const"]
        kind = schema["properties"]["kind"]["const"]
        custom[(api, kind)] = schema
    for d in docs:
        what = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
        key = (d.get("apiVersion"), d.get("kind"))
        if key in custom:
            errors = sorted(jsonschema.Draft7Validator(custom[key]).iter_errors(d), key=lambda e: list(e.path))
            for e in errors:
                fail.check(False, f"{what}: {'.'.join(map(str, e.path))}: {e.message}")
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                fail.check(False, f"{what} (Kubernetes {version}): {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                fail.check(False, f"{what}: no schema to validate it with ({e.message}); add one to tests/helm/schemas")


def yamllint(paths, config, fail):
    paths = paths if isinstance(paths, list) else [paths]
    r = subprocess.run(["yamllint", "-f", "parsable", "-c", str(config)] + [str(p) for p in paths],
                       capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        if line.strip():
            fail.check(False, f"yamllint: {line}")
    if r.returncode != 0 and not (r.stdout + r.stderr).strip():
        fail.check(False, f"yamllint exited {r.returncode}")


def pod_spec(d):
    if d["kind"] in ("Deployment", "StatefulSet"):
        return d["spec"]["template"]["spec"], d["spec"]["template"]["metadata"].get("labels", {})
    if d["kind"] == "Pod":
        return d["spec"], d["metadata"].get("labels", {})
    return None, None


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def args_of(container):
    out = {}
    for a in container.get("args", []) + container.get("command", []):
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            out[k] = v
    return out


def env_field(container, name):
    for e in container.get("env", []):
        if e["name"] == name:
            return e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    return None


def check_objects(docs, values, fail):
    """Rules across objects that the API schemas do not see."""
    seen = set()
    by_kind = {}
    for d in docs:
        md = d["metadata"]
        name = md["name"]
        what = f"{d['kind']}/{name}"
        by_kind.setdefault(d["kind"], []).append(d)
        fail.check((d["kind"], md.get("namespace"), name) not in seen, f"{what}: defined twice")
        seen.add((d["kind"], md.get("namespace"), name))
        fail.check(len(name) <= 63 and DNS_LABEL.match(name), f"{what}: the name is not a DNS label of 63 characters at most")
        fail.check(md.get("namespace") in (NAMESPACE, "monitoring"), f"{what}: namespace {md.get('namespace')!r}")
        labels = md.get("labels", {})
        for key in ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                    "app.kubernetes.io/version", "app.kubernetes.io/managed-by"):
            fail.check(key in labels, f"{what}: label {key} missing")
        fail.check(labels.get("app.kubernetes.io/instance") == RELEASE, f"{what}: instance label is not the release")

    pods = []  # (owner, pod spec, pod labels)
    for d in docs:
        spec, labels = pod_spec(d)
        if spec is None:
            continue
        what = f"{d['kind']}/{d['metadata']['name']}"
        pods.append((d, spec, labels))
        if d["kind"] != "Pod":
            sel = d["spec"]["selector"]["matchLabels"]
            fail.check(matches(sel, labels), f"{what}: selector {sel} does not select its own pods")
        psc = spec.get("securityContext", {})
        fail.check(psc.get("runAsNonRoot") is True, f"{what}: pods may run as root")
        fail.check(isinstance(psc.get("runAsUser"), int) and psc["runAsUser"] > 0, f"{what}: no non-root runAsUser")
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec["containers"]:
            cwhat = f"{what} container {c['name']}"
            sc = c.get("securityContext", {})
            fail.check(sc.get("allowPrivilegeEscalation") is False, f"{cwhat}: allowPrivilegeEscalation is not false")
            fail.check(sc.get("readOnlyRootFilesystem") is True, f"{cwhat}: root filesystem is writable")
            fail.check("ALL" in sc.get("capabilities", {}).get("drop", []), f"{cwhat}: capabilities not dropped")
            image = c["image"]
            fail.check(("@sha256:" in image) or (":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")),
                       f"{cwhat}: image {image} has no tag or digest")
            for m in c.get("volumeMounts", []):
                fail.check(m["name"] in volumes, f"{cwhat}: mounts undeclared volume {m['name']}")
        for c in spec["containers"]:
            cwhat = f"{what} container {c['name']}"
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            if d["kind"] != "Pod":
                fail.check(bool(c.get("resources", {}).get("requests")), f"{cwhat}: no resource requests")
            for probe in ("livenessProbe", "readinessProbe"):
                p = c.get(probe)
                if not p:
                    continue
                if "grpc" in p:
                    fail.check(p["grpc"]["port"] in ports.values(), f"{cwhat}: {probe} gRPC port is not a container port")
                if "tcpSocket" in p:
                    fail.check(p["tcpSocket"]["port"] in ports, f"{cwhat}: {probe} port is not a named container port")

    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    for s in services.values():
        what = f"Service/{s['metadata']['name']}"
        selected = [(o, spec) for o, spec, labels in pods if o["kind"] != "Pod" and matches(s["spec"]["selector"], labels)]
        fail.check(bool(selected), f"{what}: selects no pods of the chart")
        for port in s["spec"]["ports"]:
            for o, spec in selected:
                names = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
                fail.check(port["targetPort"] in names, f"{what}: targetPort {port['targetPort']} is not a port of {o['metadata']['name']}")

    coordinators = [d for d in by_kind.get("Deployment", []) if d["metadata"]["labels"].get("app.kubernetes.io/component") == "coordinator"]
    fail.check(len(coordinators) == 1, "there is not exactly one coordinator Deployment")
    workers = [d for d in by_kind.get("StatefulSet", []) if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    fail.check(len(workers) >= 1, "no worker StatefulSet")
    if len(coordinators) != 1:
        return
    coord = coordinators[0]
    cspec = coord["spec"]["template"]["spec"]
    cargs = args_of(cspec["containers"][0])
    fail.check(coord["spec"]["replicas"] == 1, "the coordinator Deployment must have one replica")
    total = sum(w["spec"]["replicas"] for w in workers)
    fail.check(cargs.get("expected_workers") == str(total),
               f"coordinator --expected_workers={cargs.get('expected_workers')} but the StatefulSets run {total} worker(s)")
    model_mounts = [m["mountPath"] for m in cspec["containers"][0]["volumeMounts"] if m["name"] == "model"]
    fail.check(len(model_mounts) == 1 and (cargs.get("model", "") + "/").startswith(model_mounts[0].rstrip("/") + "/"),
               f"coordinator --model={cargs.get('model')} is not inside its model mount {model_mounts}")
    csvc = [s for s in services.values() if matches(s["spec"]["selector"], coord["spec"]["template"]["metadata"]["labels"])]
    fail.check(len(csvc) == 1, "the coordinator is not behind exactly one Service")
    domain = values.get("clusterDomain", "cluster.local")
    if csvc:
        # Workers dial the coordinator's control port, never its public gRPC port.
        grpc_port = [p["port"] for p in csvc[0]["spec"]["ports"] if p["name"] == "control"]
        coordinator_address = f"{csvc[0]['metadata']['name']}.{NAMESPACE}.svc.{domain}:{grpc_port[0] if grpc_port else '?'}"
        fail.check(csvc[0]["spec"].get("publishNotReadyAddresses") is True,
                   "the coordinator Service must publish the not-ready coordinator (workers register before it is ready)")
    for w in workers:
        what = f"StatefulSet/{w['metadata']['name']}"
        fail.check(len(w["metadata"]["name"]) <= 52, f"{what}: name longer than 52 characters")
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        a = args_of(c)
        svc = services.get(w["spec"]["serviceName"])
        if not fail.check(svc is not None, f"{what}: serviceName {w['spec']['serviceName']} is not a Service of the chart"):
            continue
        fail.check(svc["spec"].get("clusterIP") == "None", f"{what}: its Service is not headless")
        fail.check(svc["spec"].get("publishNotReadyAddresses") is True, f"{what}: its headless Service hides not-ready pods")
        fail.check(matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]), f"{what}: its Service does not select its pods")
        grpc = [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"][0]
        expected_advertise = f"$(POD_NAME).{svc['metadata']['name']}.{NAMESPACE}.svc.{domain}:{grpc}"
        fail.check(a.get("advertise") == expected_advertise, f"{what}: --advertise={a.get('advertise')}, expected {expected_advertise}")
        fail.check(a.get("listen", "").endswith(f":{grpc}"), f"{what}: --listen={a.get('listen')} is not the gRPC port")
        fail.check(env_field(c, "POD_NAME") == "metadata.name", f"{what}: POD_NAME is not the pod's name")
        fail.check(env_field(c, "NODE_NAME") == "spec.nodeName", f"{what}: NODE_NAME does not come from spec.nodeName")
        fail.check(a.get("node_name") == "$(NODE_NAME)", f"{what}: --node_name is not $(NODE_NAME)")
        if csvc:
            fail.check(a.get("coordinator") == coordinator_address, f"{what}: --coordinator={a.get('coordinator')}, expected {coordinator_address}")
        mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "model"]
        fail.check(mounts == model_mounts, f"{what}: the model is mounted at {mounts}, the coordinator's at {model_mounts}")
        limits = c.get("resources", {}).get("limits", {})
        gpus = {k: v for k, v in limits.items() if k.endswith("/gpu")}
        devices = a.get("devices", "")
        if devices.startswith("cuda"):
            fail.check(bool(gpus), f"{what}: --devices={devices} without a GPU limit")
        else:
            fail.check(not gpus, f"{what}: a CPU worker asks for GPUs")
            fail.check(w["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-cpu"), f"{what}: a CPU worker runs the CUDA image")

    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"]["matchLabels"]
        fail.check(any(matches(sel, labels) for o, spec, labels in pods if o["kind"] != "Pod"),
                   f"PodDisruptionBudget/{pdb['metadata']['name']}: selects no workload")
    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"]
        hits = [s for s in services.values() if matches(sel.get("matchLabels", {}), s["metadata"]["labels"])
                and all(e["key"] in s["metadata"]["labels"] for e in sel.get("matchExpressions", []) if e["operator"] == "Exists")]
        fail.check(bool(hits), f"ServiceMonitor/{sm['metadata']['name']}: selects no Service")
        for s in hits:
            ports = {p["name"] for p in s["spec"]["ports"]}
            for e in sm["spec"]["endpoints"]:
                fail.check(e["port"] in ports, f"ServiceMonitor: Service {s['metadata']['name']} has no port {e['port']}")
            fail.check(sm["spec"].get("jobLabel", "") in s["metadata"]["labels"], f"ServiceMonitor: Service {s['metadata']['name']} lacks the job label")
    dashboards = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    cms = [c for c in by_kind.get("ConfigMap", []) if c["metadata"]["name"].endswith("-dashboards")]
    if dashboards and values["grafana"]["dashboards"]["enabled"]:
        if fail.check(len(cms) == 1, "the dashboards ConfigMap is missing"):
            fail.check(sorted(cms[0]["data"]) == dashboards, f"dashboards ConfigMap holds {sorted(cms[0]['data'])}, expected {dashboards}")
            for k, v in cms[0]["data"].items():
                try:
                    json.loads(v)
                except ValueError as e:
                    fail.check(False, f"dashboard {k} is not JSON: {e}")
            g = values["grafana"]["dashboards"]
            fail.check(cms[0]["metadata"]["labels"].get(g["label"]) == g["labelValue"], "dashboards ConfigMap lacks the sidecar label")
    else:
        fail.check(not cms, "a dashboards ConfigMap without dashboards")


def secret_volume(workload, name):
    """The Secret behind the volume `name` of a workload's pod, or None."""
    for v in workload["spec"]["template"]["spec"].get("volumes", []):
        if v["name"] == name:
            return v.get("secret", {}).get("secretName")
    return None


def tls_checks(coord, workers, kinds, fail, what):
    """With tls.enabled: every process runs with --tls_dir from its Secret, and the probes are TCP."""
    for w in [coord] + list(workers.values()):
        c = w["spec"]["template"]["spec"]["containers"][0]
        n = w["metadata"]["name"]
        fail.check(args_of(c).get("tls_dir") == "/etc/shardserve/tls", f"{what}: {n} runs with --tls_dir")
        fail.check(any(m["name"] == "tls" and m["mountPath"] == "/etc/shardserve/tls" for m in c["volumeMounts"]),
                   f"{what}: {n} mounts its TLS Secret")
        for probe in ("livenessProbe", "readinessProbe"):
            if probe in c:
                fail.check("grpc" not in c[probe], f"{what}: {n}'s {probe} is a gRPC probe, which speaks no TLS")


def gpu_limit(sts):
    return sts["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")


# What each value set must produce, beyond the rules every set follows.
def expectations(name, docs, fail):
    kinds = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    coord = [d for d in kinds["Deployment"]][0]
    cargs = args_of(coord["spec"]["template"]["spec"]["containers"][0])
    workers = {d["metadata"]["name"]: d for d in kinds["StatefulSet"]}
    wargs = {n: args_of(w["spec"]["template"]["spec"]["containers"][0]) for n, w in workers.items()}
    main = workers.get(f"{RELEASE}-worker") or workers.get("llm-worker")

    def anti(w):
        return w["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})

    if name == "default":
        fail.check(main["spec"]["replicas"] == 1 and gpu_limit(main) == 1, "default: one worker with one GPU")
        fail.check(wargs[main["metadata"]["name"]]["devices"] == "cuda:all", "default: --devices=cuda:all")
        fail.check(cargs["tp"] == cargs["pp"] == cargs["replicas"] == "0", "default: parallelism auto (0)")
        fail.check(main["spec"]["template"]["spec"]["initContainers"][0]["name"] == "fetch-model", "default: the model is downloaded")
        fail.check("requiredDuringSchedulingIgnoredDuringExecution" in anti(main), "default: one worker per node (required anti-affinity)")
        fail.check("ServiceMonitor" not in kinds, "default: no ServiceMonitor")
        fail.check(any(d["kind"] == "Pod" for d in docs), "default: the helm test pod")
        fail.check(len(kinds.get("NetworkPolicy", [])) == 2, "default: NetworkPolicies for the coordinator and the workers")
        fail.check(all("Egress" not in p["spec"]["policyTypes"] for p in kinds.get("NetworkPolicy", [])),
                   "default: no egress rules while an init container downloads the model")
        fail.check("tls_dir" not in cargs, "default: TLS off")
    elif name == "cpu-single-node":
        fail.check(all(gpu_limit(w) is None for w in workers.values()), "cpu: no GPU limits")
        fail.check(main["spec"]["replicas"] == 2 and wargs[main["metadata"]["name"]]["devices"] == "cpu:2", "cpu: 2 workers, --devices=cpu:2")
        fail.check((cargs["tp"], cargs["pp"], cargs["replicas"]) == ("2", "2", "1"), "cpu: --tp=2 --pp=2 --replicas=1")
        fail.check(cargs.get("prefix_caching") == "true", "cpu: --prefix_caching=true by default")
        fail.check(not anti(main), "cpu: no anti-affinity (both workers on one node)")
        vol = [v for v in main["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"][0]
        fail.check(vol.get("hostPath", {}).get("path") == "/var/lib/shardserve/models", "cpu: model from hostPath")
        fail.check(main["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.1.0-cpu"), "cpu: the -cpu worker image")
    elif name == "gpu-2x8-tp8-pp2":
        fail.check(main["spec"]["replicas"] == 2 and gpu_limit(main) == 8, "2x8: 2 workers with 8 GPUs each")
        fail.check((cargs["tp"], cargs["pp"], cargs["replicas"], cargs["expected_workers"]) == ("8", "2", "1", "2"),
                   f"2x8: coordinator flags {cargs}")
        fail.check("requiredDuringSchedulingIgnoredDuringExecution" in anti(main), "2x8: one worker per node")
        vol = [v for v in main["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"][0]
        fail.check(vol.get("persistentVolumeClaim", {}).get("claimName") == "llm-models", "2x8: model from the PVC")
        fail.check(len(kinds.get("ServiceMonitor", [])) == 1, "2x8: a ServiceMonitor")
        svc = [s for s in kinds["Service"] if s["metadata"]["name"].endswith("-coordinator")][0]
        fail.check(svc["spec"]["type"] == "LoadBalancer", "2x8: LoadBalancer Service")
        for w in list(workers.values()) + [coord]:
            spec = w["spec"]["template"]["spec"]
            fail.check(all(c["image"].startswith("registry.example.com/ml/") for c in spec["containers"]), "2x8: images from the registry")
            fail.check(spec.get("imagePullSecrets") == [{"name": "registry-credentials"}], "2x8: pull secret")
        fail.check(main["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "2x8: node selector")
    elif name == "moe-expert-workers":
        fail.check(len(workers) == 2, "moe: two worker StatefulSets")
        experts = workers.get(f"{RELEASE}-worker-experts")
        if fail.check(experts is not None, "moe: the experts StatefulSet"):
            fail.check(experts["spec"]["replicas"] == 2 and gpu_limit(experts) == 2, "moe: 2 expert workers with 2 GPUs")
            fail.check(experts["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, "moe: experts on the A100 pool")
            fail.check(experts["spec"]["template"]["metadata"]["labels"]["shardserve.io/worker-group"] == "experts", "moe: group label")
            sel = anti(experts)["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"]["matchLabels"]
            fail.check("shardserve.io/worker-group" not in sel, "moe: one worker per node across all groups")
        fail.check(cargs["expected_workers"] == "4" and cargs["tp"] == "4" and cargs["pp"] == "2", f"moe: coordinator flags {cargs}")
        init = main["spec"]["template"]["spec"]["initContainers"][0]
        env = {e["name"]: e for e in init["env"]}
        fail.check(env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}, "moe: HF token from the Secret")
        fail.check(env["HF_REPO"]["value"] == "mistralai/Mixtral-8x7B-Instruct-v0.1", "moe: the repository")
        fail.check(len(kinds.get("PodDisruptionBudget", [])) == 2, "moe: a PodDisruptionBudget per worker group")
    elif name == "security":
        tls_checks(coord, workers, kinds, fail, "security")
        certs = {c["spec"]["uris"][0]: c for c in kinds.get("Certificate", []) if c["spec"].get("uris")}
        fail.check(sorted(certs) == ["spiffe://shardserve/coordinator", "spiffe://shardserve/worker"],
                   f"security: one Certificate per role, got {sorted(certs)}")
        ca = [c for c in kinds.get("Certificate", []) if c["spec"].get("isCA")]
        fail.check(len(ca) == 1 and len(kinds.get("Issuer", [])) == 2, "security: the chart's CA (self-signed Issuer, CA Certificate, CA Issuer)")
        for uri, sts in (("spiffe://shardserve/coordinator", coord), ("spiffe://shardserve/worker", main)):
            vol = secret_volume(sts, "tls")
            fail.check(uri in certs and vol == certs[uri]["spec"]["secretName"], f"security: {uri} mounted from its Certificate's Secret ({vol})")
        coord_cert = certs.get("spiffe://shardserve/coordinator", {"spec": {}})
        fail.check({f"{RELEASE}-coordinator.{NAMESPACE}.svc.cluster.local", "llm.example.com"} <= set(coord_cert["spec"].get("dnsNames", [])),
                   "security: the coordinator's certificate names its Service and the extra DNS name")
        worker_cert = certs.get("spiffe://shardserve/worker", {"spec": {}})
        want = {f"*.{sts}.{NAMESPACE}.svc.cluster.local" for sts in workers}
        fail.check(want and set(worker_cert["spec"].get("dnsNames", [])) == want,
                   f"security: the workers' certificate names what each group's workers advertise ({want})")
        fail.check(cargs.get("api_keys_file") == "/etc/shardserve/api-keys/api_keys", "security: --api_keys_file from the Secret")
        fail.check(secret_volume(coord, "api-keys") == "shardserve-api-keys", "security: the API keys Secret is mounted")
        fail.check(not any(d["kind"] == "Pod" for d in docs), "security: no test pod (it would need an API key)")
        pols = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p for p in kinds.get("NetworkPolicy", [])}
        fail.check(set(pols) == {"coordinator", "worker"}, "security: a NetworkPolicy for the coordinator and one for the workers")
        if set(pols) == {"coordinator", "worker"}:
            rules = {tuple(p["port"] for p in r["ports"]): r.get("from") for r in pols["coordinator"]["spec"]["ingress"]}
            fail.check(rules.get(("grpc", "http")) == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "frontend"}}}],
                       f"security: clients reach only the public ports, from networkPolicy.clients ({rules})")
            control = rules.get(("control",)) or []
            fail.check([f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in control] == ["worker"],
                       "security: only workers reach the control port")
            w = pols["worker"]["spec"]
            sources = [f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in w["ingress"] if r["ports"][0]["port"] == "grpc" for f in r["from"]]
            fail.check(sorted(sources) == ["coordinator", "worker"], "security: workers take calls only from the coordinator and workers")
            fail.check("Egress" in w["policyTypes"] and any(p.get("port") == 7001 for r in w["egress"] for p in r.get("ports", [])),
                       "security: workers' egress restricted (the coordinator's control port, workers, DNS)")
    elif name == "tls-secrets":
        tls_checks(coord, workers, kinds, fail, "tls-secrets")
        fail.check(secret_volume(coord, "tls") == "llm-coordinator-tls" and secret_volume(main, "tls") == "llm-worker-tls",
                   "tls-secrets: the given Secrets are mounted")
        fail.check("Certificate" not in kinds and "NetworkPolicy" not in kinds, "tls-secrets: no Certificate, no NetworkPolicy")
        pod = [d for d in docs if d["kind"] == "Pod"]
        if fail.check(len(pod) == 1, "tls-secrets: the test pod"):
            pa = args_of(pod[0]["spec"]["containers"][0])
            fail.check(pa.get("tls_ca_file") == "/etc/shardserve/tls/ca.crt" and pa.get("server", "").endswith(":7000"),
                       "tls-secrets: the test pod checks the coordinator against the CA, on the public port")
    elif name == "options":
        fail.check("ServiceAccount" not in kinds, "options: no ServiceAccount created")
        fail.check(coord["spec"]["template"]["spec"]["serviceAccountName"] == "llm-serving", "options: the existing ServiceAccount")
        fail.check(cargs.get("http_listen") == "[::]:8000", "options: --http_listen")
        fail.check(cargs.get("prefix_caching") == "false", "options: --prefix_caching=false")
        fail.check(coord["spec"]["template"]["spec"]["containers"][0]["image"].endswith("@sha256:" + "0123456789abcdef" * 4), "options: digest")
        fail.check(not any(d["kind"] == "Pod" for d in docs), "options: no test pod")
        fail.check(wargs["llm-worker"]["devices"] == "cuda:0,1", "options: --devices override")
        fail.check(cargs.get("hidden_wire_dtype") == "bf16", "options: the coordinator's --hidden_wire_dtype")
        fail.check("hidden_wire_dtype" not in wargs["llm-worker"],
                   "options: workers take the wire dtype from the coordinator")
        a = main["spec"]["template"]["spec"]["affinity"]
        fail.check("nodeAffinity" in a and "preferredDuringSchedulingIgnoredDuringExecution" in a["podAntiAffinity"], "options: user affinity + soft anti-affinity")
        fail.check(all(d["metadata"]["labels"].get("team") == "inference" for d in docs), "options: commonLabels everywhere")
        fail.check(len(kinds.get("PodDisruptionBudget", [])) == 2, "options: coordinator and worker PodDisruptionBudgets")
        fail.check(wargs["llm-worker"]["coordinator"] == "llm-coordinator.llm.svc.k8s.example.internal:7001", "options: cluster domain")


def coalesce(user, defaults):
    """Helm's coalescing of user values over the chart's (a null deletes a default)."""
    out = copy.deepcopy(user) if isinstance(user, dict) else {}
    for k, dv in defaults.items():
        if k not in out:
            out[k] = copy.deepcopy(dv)
        elif out[k] is None:
            del out[k]
        elif isinstance(out[k], dict) and isinstance(dv, dict):
            out[k] = coalesce(out[k], dv)
    return {k: v for k, v in out.items() if v is not None}


def chart_values(files):
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    user = {}
    for f in files:
        user = merge(user, yaml.safe_load(Path(f).read_text()) or {})
    return coalesce(user, defaults)


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def cmd_render(args):
    status = 0
    work = Path(args.tools) / "out"
    work.mkdir(parents=True, exist_ok=True)
    for name in args.sets:
        fail = Failures()
        vf = value_file(name)
        if vf is not None and not vf.exists():
            print(f"no value set {vf}")
            return 1
        files = [vf] if vf else []
        out = work / f"{name}.yaml"
        notes = work / f"{name}.NOTES.txt"
        r = render(args.tools, files, notes=notes)
        if r.returncode != 0:
            print(f"FAILED: value set {name}: the chart does not render:\n{r.stderr}")
            status = 1
            continue
        out.write_text(r.stdout)
        docs = documents(r.stdout)
        values = chart_values(files)
        counts = {}
        for d in docs:
            counts[d["kind"]] = counts.get(d["kind"], 0) + 1
        print(f"value set {name}: {len(docs)} manifests {dict(sorted(counts.items()))} -> {out}")
        validate_schemas(docs, fail)
        yamllint(out, HERE / "yamllint-rendered.yaml", fail)
        check_objects(docs, values, fail)
        expectations(name, docs, fail)
        text = notes.read_text()
        coordinator = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"][0]
        fail.check("shardserve generate" in text and f"deploy/{coordinator}" in text and f"svc/{coordinator}" in text,
                   "NOTES.txt does not tell how to send the first request to the coordinator")
        fail.check("<no value>" not in r.stdout + text, "a template printed <no value>")
        status |= fail.report(f"value set {name} (Kubernetes {', '.join(K8S_VERSIONS)} schemas, strict; yamllint; cross-object rules)")
    return status


# ------------------------------------------------------------------------------------------------


def cmd_bad_values(args):
    import jsonschema
    schema = json.loads((CHART / "values.schema.json").read_text())
    fail = Failures()
    files = sorted((HERE / "bad-values").glob("*.yaml"))
    for f in files:
        header = f.read_text()
        expect = re.search(r"^# expect: (.+)$", header, re.M)
        by = re.search(r"^# by: (schema|chart)$", header, re.M)
        if not fail.check(expect and by, f"{f.name}: needs '# expect: MESSAGE' and '# by: schema|chart' lines"):
            continue
        r = render(args.tools, [f])
        message = r.stderr.strip()
        if not fail.check(r.returncode != 0, f"{f.name}: the chart accepted these values"):
            continue
        fail.check(expect.group(1) in message, f"{f.name}: the error does not say '{expect.group(1)}':\n      {message}")
        # The schema alone must decide the 'schema' cases, and a second JSON Schema implementation
        # (python-jsonschema) must agree with the renderer's (gojsonschema, as in Helm 3).
        values = chart_values([f])
        errors = list(jsonschema.Draft7Validator(schema).iter_errors(values))
        if by.group(1) == "schema":
            fail.check(message.startswith("Error: values don't meet the specifications of the schema(s)"),
                       f"{f.name}: not rejected by values.schema.json: {message}")
            fail.check(bool(errors), f"{f.name}: python-jsonschema accepts what the renderer rejected")
        else:
            fail.check(not errors, f"{f.name}: meant to pass the schema and fail in the templates, but the schema rejects it")
            fail.check("execution error at (shardserve/templates/" in message, f"{f.name}: not a template failure: {message}")
        print(f"  {f.name}: {message.splitlines()[-1].strip() if message else '(no message)'}")
    r = render(args.tools, [], kube_version="1.24.0")
    fail.check(r.returncode != 0 and "incompatible with Kubernetes v1.24.0" in r.stderr,
               f"Kubernetes 1.24 is not refused by the chart's kubeVersion: {r.stderr.strip()}")
    return fail.report(f"{len(files)} bad value files rejected with their messages; Kubernetes 1.24 refused")


# ------------------------------------------------------------------------------------------------


def cmd_chart(args):
    import jsonschema
    fail = Failures()
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    fail.check(meta.get("apiVersion") == "v2", "Chart.yaml: apiVersion is not v2")
    fail.check(meta.get("name") == CHART.name, "Chart.yaml: name is not the folder's")
    fail.check(re.match(r"^\d+\.\d+\.\d+$", str(meta.get("version", ""))), "Chart.yaml: version is not SemVer")
    for key in ("description", "appVersion", "kubeVersion", "type"):
        fail.check(meta.get(key), f"Chart.yaml: {key} missing")
    fail.check(meta.get("kubeVersion") == f">={K8S_VERSIONS[0]}-0", "Chart.yaml kubeVersion and the oldest validated Kubernetes differ")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for e in jsonschema.Draft7Validator(schema).iter_errors(values):
        fail.check(False, f"values.yaml does not pass values.schema.json: {'.'.join(map(str, e.path))}: {e.message}")
    for vf in sorted((CHART / "ci").glob("*-values.yaml")):
        for e in jsonschema.Draft7Validator(schema).iter_errors(chart_values([vf])):
            fail.check(False, f"{vf.name} does not pass values.schema.json: {'.'.join(map(str, e.path))}: {e.message}")
    # Every value has a description, and the README holds the table values_doc.py makes of them.
    sys.path.insert(0, str(HERE))
    import values_doc
    table, undocumented = values_doc.table()
    for p in undocumented:
        fail.check(False, f"values.yaml: no '# --' description for {p}")
    readme = (CHART / "README.md").read_text()
    fail.check(f"{values_doc.START}\n{table}{values_doc.END}" in readme,
               "helm/shardserve/README.md does not hold the current values table: run python3 tests/helm/values_doc.py --write")
    paths = [r for r in table.splitlines()[2:]]
    yamllint([CHART / "Chart.yaml", CHART / "values.yaml"] + sorted((CHART / "ci").glob("*.yaml"))
             + sorted((HERE / "bad-values").glob("*.yaml")), HERE / "yamllint-chart.yaml", fail)
    # Dashboards: the chart ships a copy of every dashboard in deploy/grafana.
    for src in sorted((ROOT / "deploy" / "grafana").glob("*.json")):
        dst = CHART / "dashboards" / src.name
        fail.check(dst.exists() and dst.read_bytes() == src.read_bytes(),
                   f"helm/shardserve/dashboards/{src.name} is missing or differs from deploy/grafana/{src.name} "
                   f"(cp deploy/grafana/{src.name} helm/shardserve/dashboards/)")
    for f in sorted((CHART / "dashboards").glob("*.json")):
        fail.check((ROOT / "deploy" / "grafana" / f.name).exists(),
                   f"helm/shardserve/dashboards/{f.name} has no source in deploy/grafana (dashboards are written there)")
        try:
            d = json.loads(f.read_text())
            fail.check(isinstance(d, dict) and d.get("title"), f"dashboards/{f.name}: no title")
        except ValueError as e:
            fail.check(False, f"dashboards/{f.name}: not JSON: {e}")
    # NOTES.txt and the templates render without the renderer's help for missing values.
    fail.check((CHART / "templates" / "NOTES.txt").exists(), "templates/NOTES.txt missing")
    return fail.report(f"chart metadata, schema, README covers {len(paths)} values, yamllint, dashboards")


# ------------------------------------------------------------------------------------------------


def dockerfile_stages(path):
    """[(FROM image, stage name, [instructions])] with ARG defaults substituted."""
    args = {}
    stages = []
    lines = []
    buf = ""
    for raw in path.read_text().splitlines():
        if raw.strip().startswith("#") and not buf:
            continue
        if raw.endswith("\\"):
            buf += raw[:-1] + " "
            continue
        lines.append((buf + raw).strip())
        buf = ""
    for line in lines:
        if not line:
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "ARG" and not stages:
            k, _, v = rest.partition("=")
            v = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), v.strip().strip('"'))
            args[k.strip()] = v
            continue
        if op == "FROM":
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), rest.split()[0])
            name = rest.split()[2] if len(rest.split()) >= 3 and rest.split()[1].upper() == "AS" else ""
            stages.append((image, name, []))
            continue
        if stages:
            stages[-1][2].append((op, rest))
    return args, stages


def binary_names():
    names = {}
    for cm in ROOT.glob("**/CMakeLists.txt"):
        if any(part.startswith("build") for part in cm.relative_to(ROOT).parts):
            continue
        for m in re.finditer(r"shardserve_cc_binary\(NAME (\S+) OUTPUT_NAME (\S+)", cm.read_text()):
            names[m.group(2)] = m.group(1)
    return names


def cmd_images(args):
    fail = Failures()
    docker = ROOT / "deploy" / "docker"
    binaries = binary_names()
    cmake_options = set(re.findall(r"(SHARDSERVE_\w+)", (ROOT / "CMakeLists.txt").read_text() + (ROOT / "cmake" / "ShardserveCuda.cmake").read_text()))
    ignore = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    for needed in ["CMakeLists.txt", "cmake/ShardserveHelpers.cmake", "proto", "common", "worker", "coordinator", "sdk", "tests/CMakeLists.txt",
                   ".ci/install_deps.sh", "deploy/docker/collect-runtime-libs.sh"]:
        excluded = False
        for pat in ignore:
            neg = pat.startswith("!")
            p = pat.lstrip("!").rstrip("/")
            if Path(needed).match(p) or needed == p or needed.startswith(p + "/") or p in ("*", "**"):
                excluded = not neg
        fail.check(not excluded, f".dockerignore excludes {needed}, which the image build needs")
    for excluded in ["build", "build-asan", ".git"]:
        fail.check(any(p.rstrip("/").lstrip("/") in (excluded, "build*") or (excluded.startswith("build") and p.rstrip("/").lstrip("/") == "build*") for p in ignore),
                   f".dockerignore does not exclude {excluded}")
    for name, flavour in (("Dockerfile.cuda", "cuda"), ("Dockerfile.cpu", "cpu")):
        path = docker / name
        if not fail.check(path.exists(), f"deploy/docker/{name} missing"):
            continue
        text = path.read_text()
        argdefaults, stages = dockerfile_stages(path)
        stage_names = {s[1] for s in stages}
        targets = [s for s in stages if s[1] in ("coordinator", "worker")]
        fail.check({s[1] for s in targets} == {"coordinator", "worker"}, f"{name}: needs the targets coordinator and worker")
        for image, stage, instructions in stages:
            if image in stage_names:
                continue
            fail.check(re.match(r"^[\w./-]+:[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?$", image) is not None and "latest" not in image,
                       f"{name}: base image {image} is not pinned to a version")
        built = []
        for image, stage, instructions in stages:
            for op, rest in instructions:
                if op == "RUN":
                    for script in re.findall(r"bash (\S+\.sh)", rest):
                        fail.check((ROOT / script).exists(), f"{name}: runs {script}, which the repository lacks")
                    for opt in re.findall(r"-D(SHARDSERVE_\w+)=", rest):
                        fail.check(opt in cmake_options, f"{name}: -D{opt} is not an option of the CMake project")
                    m = re.search(r"ninja -C build((?: bin/[\w.-]+)+)", rest)
                    if m:
                        built += re.findall(r"bin/([\w.-]+)", m.group(1))
                    for out in re.findall(r" build/bin/([\w.-]+)", rest):
                        fail.check(out in built, f"{name}: uses build/bin/{out}, which the build stage does not build")
                if op == "COPY" and "--from=build" in rest:
                    for src in re.findall(r"/src/build/bin/([\w.-]+)", rest):
                        fail.check(src in built, f"{name}: copies build/bin/{src}, which the build stage does not build")
        for out in built:
            fail.check(out in binaries, f"{name}: builds bin/{out}, which no shardserve_cc_binary produces")
        fail.check({"shardserve-coordinator", "shardserve-worker", "shardserve"} <= set(built),
                   f"{name}: does not build the coordinator, the worker and the CLI")
        for image, stage, instructions in stages:
            if stage in ("coordinator", "worker"):
                users = [r for o, r in instructions if o == "USER"]
                fail.check(users and re.match(r"^[1-9]\d*(:\d+)?$", users[-1]), f"{name} {stage}: no numeric non-root USER")
                entry = [r for o, r in instructions if o == "ENTRYPOINT"]
                fail.check(entry and f"shardserve-{stage}" in entry[-1], f"{name} {stage}: ENTRYPOINT is not shardserve-{stage}")
        fail.check("install_deps.sh" in text, f"{name}: does not install with the project's .ci/install_deps.sh")
        fail.check(("SHARDSERVE_CUDA=ON" if flavour == "cuda" else "SHARDSERVE_CUDA=OFF") in text, f"{name}: SHARDSERVE_CUDA not set for {flavour}")
    # The runtime-library closure the images copy, tried on this build's binaries.
    script = docker / "collect-runtime-libs.sh"
    fail.check(script.exists(), "deploy/docker/collect-runtime-libs.sh missing")
    bins = [Path(args.bin) / b for b in ("shardserve-coordinator", "shardserve-worker", "shardserve")] if args.bin else []
    bins = [b for b in bins if b.exists()]
    if script.exists() and bins:
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run(["bash", str(script), tmp] + [str(b) for b in bins], capture_output=True, text=True)
            if fail.check(r.returncode == 0, f"collect-runtime-libs.sh failed: {r.stderr}"):
                copied = sorted(os.listdir(tmp))
                fail.check(not any(re.match(r"^(libc|libm|libpthread|libdl|librt|ld-linux)[.-]", n) for n in copied), f"the closure copies glibc: {copied}")
                fail.check(any(n.startswith("libgrpc++") for n in copied), f"the closure lacks libgrpc++: {copied}")
                # With only the copied folder and glibc, every library resolves.
                for b in bins:
                    env = dict(os.environ, LD_LIBRARY_PATH=tmp)
                    out = subprocess.run(["ldd", str(b)], capture_output=True, text=True, env=env).stdout
                    fail.check("not found" not in out, f"{b.name}: unresolved libraries with the closure: {out}")
                    for line in out.splitlines():
                        m = re.match(r"\s*(\S+) => (\S+)", line)
                        if m and not m.group(2).startswith(tmp):
                            fail.check(re.match(r"^(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|ld-linux|libcuda|libcudart|libcublas|libcublasLt|libnccl|linux-vdso)[.-]", m.group(1)) is not None,
                                       f"{b.name}: {m.group(1)} resolves outside the copied closure ({m.group(2)})")
                print(f"  closure of {', '.join(b.name for b in bins)}: {len(copied)} libraries")
    elif not bins:
        print("  (no built binaries given with --bin: the library closure is not tried)")
    return fail.report("deploy/docker: pinned bases, install script, build outputs, non-root users, library closure")


def cmd_prometheus(args):
    fail = Failures()
    path = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    if not fail.check(path.exists(), "deploy/prometheus/prometheus.yml missing"):
        return fail.report("deploy/prometheus")
    yamllint(path, HERE / "yamllint-chart.yaml", fail)
    cfg = yaml.safe_load(path.read_text())
    jobs = {j["job_name"]: j for j in cfg.get("scrape_configs", [])}
    for job in ("shardserve-coordinator", "shardserve-worker"):
        if not fail.check(job in jobs, f"no scrape job {job}"):
            continue
        j = jobs[job]
        fail.check(j.get("metrics_path", "/metrics") == "/metrics", f"{job}: metrics_path")
        targets = [t for sc in j.get("static_configs", []) for t in sc.get("targets", [])]
        fail.check(bool(targets), f"{job}: no targets")
        for t in targets:
            fail.check(re.match(r"^[\w.-]+:\d+$", t) is not None, f"{job}: target {t} is not HOST:PORT")
    # The chart's ServiceMonitor gives its targets the same job names (the shardserve.io/job label).
    for tpl in ("coordinator-service.yaml", "worker-service.yaml"):
        text = (CHART / "templates" / tpl).read_text()
        fail.check(any(f"shardserve.io/job: {job}" in text for job in jobs), f"{tpl}: job label differs from deploy/prometheus")
    if shutil.which("promtool"):
        r = subprocess.run(["promtool", "check", "config", "--syntax-only", str(path)], capture_output=True, text=True)
        fail.check(r.returncode == 0, f"promtool: {r.stdout}{r.stderr}")
    else:
        print("  (promtool not installed: checked the structure only)")
    return fail.report("deploy/prometheus scrape configuration")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=str(ROOT / "build" / "helm"), help="folder tests/helm/setup.sh prepared")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("sets", nargs="+")
    sub.add_parser("bad-values")
    sub.add_parser("chart")
    i = sub.add_parser("images")
    i.add_argument("--bin", default="", help="folder with the built binaries (build/bin)")
    sub.add_parser("prometheus")
    args = p.parse_args()
    return {"render": cmd_render, "bad-values": cmd_bad_values, "chart": cmd_chart, "images": cmd_images,
            "prometheus": cmd_prometheus}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
