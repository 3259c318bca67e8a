#!/usr/bin/env python3
"""Checks what the helm chart renders against the real `tandem` binary and against itself.

Usage: check-deploy.py TANDEM_BIN DOCKERFILE RENDERED.yaml

For every container that runs the tandem image it rebuilds the command line Kubernetes would run
(the Dockerfile's ENTRYPOINT, then the container's args, with $(VAR) expanded from the container's
env as the kubelet does; values from the downward API become sample values) and runs it:
`router|prefill|decode|up ...` with `--check` appended (the binary validates every flag and exits),
`model pull NAME` as it is (idempotent; the model cache is this machine's). Paths inside mounted
Secrets (TLS certificates, the API-key file) point at stand-ins made here (a throwaway CA from
`tandem cert`, a sample key). It also checks that gRPC probes ask a port the container declares for a
service tandem serves (and, where the container serves TLS, which kubelet's gRPC probes cannot
speak, that its probes are TCP on the gRPC port or GET /health where tandem serves it), that a node
asks for a GPU exactly when it runs on one and mounts /dev/shm, that terminationGracePeriodSeconds
covers the preStop sleep plus the --drain-timeout, and that every ServiceMonitor endpoint names a
port of a Service it selects.

Exit status 0 when everything holds; otherwise one line per failure on stderr and status 1.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

# The grpc.health.v1 service names tandem's servers answer (tests/tests/cluster.rs checks them on
# real processes).
HEALTH_SERVICES = {"", "tandem.v1.Tandem", "tandem.node.v1.Prefill", "tandem.node.v1.Decode"}
SERVERS = {"router", "prefill", "decode", "up"}
# What the downward API would give a pod.
DOWNWARD = {"status.podIP": "10.1.2.3", "metadata.name": "tandem-decode-7c9f-abcde", "metadata.namespace": "default"}

failures = []


def fail(msg):
    failures.append(msg)


def entrypoint(dockerfile):
    """The last ENTRYPOINT of the Dockerfile, in exec form."""
    found = None
    for line in open(dockerfile, encoding="utf-8"):
        m = re.match(r"\s*ENTRYPOINT\s+(\[.*\])\s*$", line)
        if m:
            found = json.loads(m.group(1))
    if not found:
        sys.exit(f"{dockerfile}: no ENTRYPOINT in exec form")
    return found


def expand(arg, env):
    """Kubernetes' $(VAR) expansion: defined variables are replaced, $$ escapes, others stay."""
    def sub(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def container_env(container):
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
            env[e["name"]] = DOWNWARD[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def flag(argv, name):
    for a in argv:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    for i, a in enumerate(argv[:-1]):
        if a == name:
            return argv[i + 1]
    return None


def secret_files(pod, c, argv, tandem, scratch):
    """Where the container mounts a Secret, files this machine can check the command line with:
    paths under such a mount are rewritten into a scratch directory holding what the Secret would
    (tls.crt, tls.key and ca.crt: a throwaway CA's from `tandem cert`; any other file: an API key).
    Returns the rewritten argv."""
    secret_volumes = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
    mounts = [m for m in c.get("volumeMounts", []) if m["name"] in secret_volumes]
    out = []
    for a in argv:
        for m in mounts:
            mp = m["mountPath"].rstrip("/") + "/"
            key, sep, path = a.partition("=")
            if sep and path.startswith(mp):
                local = os.path.join(scratch, m["name"])
                name = path[len(mp):]
                materialize(tandem, local, name)
                a = f"{key}={os.path.join(local, name)}"
        out.append(a)
    return out


def materialize(tandem, local, name):
    os.makedirs(local, exist_ok=True)
    target = os.path.join(local, name)
    if os.path.exists(target):
        return
    if name in ("tls.crt", "tls.key", "ca.crt"):
        certs = os.path.join(local, "made")
        if not os.path.exists(certs):
            subprocess.run([tandem, "cert", "--out", certs, "--hosts", "10.1.2.3,localhost", "--names", "pod"],
                           check=True, capture_output=True, timeout=60)
        src = {"tls.crt": "pod.pem", "tls.key": "pod-key.pem", "ca.crt": "ca.pem"}[name]
        with open(os.path.join(certs, src), "rb") as f, open(target, "wb") as g:
            g.write(f.read())
    else:
        with open(target, "w", encoding="utf-8") as g:
            g.write("sk-check-deploy-0123456789\n")


def check_container(tandem, entry, where, pod, c, scratch):
    if c.get("command"):
        argv = list(c["command"]) + list(c.get("args", []))
    else:
        argv = list(entry) + list(c.get("args", []))
    env = container_env(c)
    argv = [expand(str(a), env) for a in argv]
    argv = secret_files(pod, c, argv, tandem, scratch)
    if os.path.basename(argv[0]) != "tandem":
        fail(f"{where}: runs {argv[0]!r}, not tandem")
        return
    args = argv[1:]
    run_env = dict(os.environ)
    run_env.update({k: v for k, v in env.items() if not k.startswith("TANDEM_CACHE_DIR")})
    if args[:1] and args[0] in SERVERS:
        cmd = [tandem] + args + ["--check"]
        want = f"tandem {args[0]}: command line ok"
    elif args[:2] == ["model", "pull"]:
        # Really pulled, into this machine's model cache (the pod's cache path is the only difference).
        cmd = [tandem] + args
        want = None
    else:
        fail(f"{where}: `tandem {' '.join(args)}` is not a command the chart should render")
        return
    out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or (want and out.stdout.strip() != want):
        msg = (out.stderr.strip() or out.stdout.strip()).splitlines()
        fail(f"{where}: `tandem {' '.join(args)}` refused (exit {out.returncode}): {msg[0] if msg else ''}")
    else:
        print(f"ok {where}: tandem {' '.join(args)}")
    if args[:1] and args[0] in SERVERS:
        check_probes_and_grace(where, pod, c, args)


def port_number(c, port):
    """A probe's port (a number or a declared port's name) as a number, or None if undeclared."""
    for p in c.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def check_plain_probe(where, kind, probe, c, args):
    """Probes of a TLS deployment (kubelet's gRPC probes speak no TLS): TCP on the gRPC port, or GET
    /health on the router's HTTPS API or a node's plain-HTTP metrics port."""
    tls = flag(args, "--tls-cert") is not None
    if not tls:
        fail(f"{where}: {kind} is not a gRPC probe, though the container serves no TLS")
        return
    if "tcpSocket" in probe:
        port = port_number(c, probe["tcpSocket"]["port"])
        listen = flag(args, "--listen") or ""
        if port is None or not listen.endswith(f":{port}"):
            fail(f"{where}: {kind} connects to port {probe['tcpSocket']['port']}, not the --listen port ({listen})")
        return
    get = probe.get("httpGet")
    if not get:
        fail(f"{where}: {kind} is neither gRPC, TCP nor HTTP GET")
        return
    port = port_number(c, get["port"])
    if get.get("path") != "/health":
        fail(f"{where}: {kind} asks {get.get('path')!r}, tandem's health is /health")
    if args[0] in ("router", "up"):
        want, scheme = flag(args, "--http-listen") or "", "HTTPS"
    else:
        want, scheme = flag(args, "--metrics-listen") or "", "HTTP"
    if port is None or not want.endswith(f":{port}"):
        fail(f"{where}: {kind} asks port {get['port']}, where tandem serves no /health ({want or 'nothing'})")
    if get.get("scheme", "HTTP") != scheme:
        fail(f"{where}: {kind} uses {get.get('scheme', 'HTTP')}, the port speaks {scheme}")


def check_probes_and_grace(where, pod, c, args):
    ports = {p["containerPort"] for p in c.get("ports", [])} | {p["name"] for p in c.get("ports", []) if "name" in p}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind)
        if not probe:
            fail(f"{where}: no {kind}")
            continue
        grpc = probe.get("grpc")
        if not grpc:
            check_plain_probe(where, kind, probe, c, args)
            continue
        if flag(args, "--tls-cert") is not None:
            fail(f"{where}: {kind} is a gRPC probe, which kubelet cannot send over the container's TLS")
        if grpc["port"] not in ports:
            fail(f"{where}: {kind} asks port {grpc['port']}, which the container does not declare")
        listen = flag(args, "--listen")
        if listen is None or not listen.endswith(f":{grpc['port']}"):
            fail(f"{where}: {kind} asks port {grpc['port']} but tandem listens on {listen}")
        if grpc.get("service", "") not in HEALTH_SERVICES:
            fail(f"{where}: {kind} asks for health service {grpc.get('service')!r}, which tandem does not serve")
    if args[0] in ("prefill", "decode"):
        device = flag(args, "--device") or "cpu"
        gpus = int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        if device.startswith("cuda") != (gpus > 0):
            fail(f"{where}: --device {device} with nvidia.com/gpu {gpus}")
        if not any(m["mountPath"] == "/dev/shm" for m in c.get("volumeMounts", [])):
            fail(f"{where}: no /dev/shm mount")
    drain = int(flag(args, "--drain-timeout") or 30)
    sleep = 0
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if pre[:1] == ["sleep"]:
        sleep = int(pre[1])
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace < sleep + drain:
        fail(f"{where}: terminationGracePeriodSeconds {grace} < preStop sleep {sleep} + --drain-timeout {drain}")


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def main():
    tandem, dockerfile, rendered = sys.argv[1:4]
    entry = entrypoint(dockerfile)
    scratch = tempfile.mkdtemp(prefix="check-deploy-")
    docs = [d for d in yaml.safe_load_all(open(rendered, encoding="utf-8")) if d]
    image_repo = None
    checked = 0
    services = [d for d in docs if d["kind"] == "Service"]
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            pod = d["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                if "etcd" in c["image"].split(":")[0].split("/")[-1]:
                    continue
                where = f"{d['kind']}/{d['metadata']['name']}/{c['name']}"
                repo = c["image"].rsplit(":", 1)[0]
                if image_repo and repo != image_repo:
                    fail(f"{where}: image {c['image']} is not the tandem image {image_repo}")
                image_repo = repo
                check_container(tandem, entry, where, pod, c, scratch)
                checked += 1
        if d["kind"] == "ServiceMonitor":
            selected = [s for s in services if selects(d["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
            if not selected:
                fail(f"ServiceMonitor/{d['metadata']['name']}: selects no Service")
            names = {p.get("name") for s in selected for p in s["spec"]["ports"]}
            for ep in d["spec"]["endpoints"]:
                if ep["port"] not in names:
                    fail(f"ServiceMonitor/{d['metadata']['name']}: endpoint port {ep['port']!r} is on no selected Service")
    if checked == 0:
        fail("no tandem container rendered")
    shutil.rmtree(scratch, ignore_errors=True)
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
