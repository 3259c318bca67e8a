#!/usr/bin/env python3
"""Checks what the helm chart renders against the real `tandem` binary and against itself.

Usage: check-deploy.py TANDEM_BIN DOCKERFILE RENDERED.yaml

For every container that runs the tandem image it rebuilds the command line Kubernetes would run
(the Dockerfile's ENTRYPOINT, then the container's args, with $(VAR) expanded from the container's
env as the kubelet does; values from the downward API become sample values) and runs it:
`router|prefill|decode|up ...` with `--check` appended (the binary validates every flag and exits),
`model pull NAME` as it is (idempotent; the model cache is this machine's). It also checks that
gRPC probes ask a port the container declares for a service tandem serves, that a node
asks for a GPU exactly when it runs on one and mounts /dev/shm, that terminationGracePeriodSeconds
covers the preStop sleep plus the --drain-timeout, and that every ServiceMonitor endpoint names a
port of a Service it selects.

Exit status 0 when everything holds; otherwise one line per failure on stderr and status 1.
"""

import json
import os
import re
import subprocess
import sys

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


def check_container(tandem, entry, where, pod, c):
    if c.get("command"):
        argv = list(c["command"]) + list(c.get("args", []))
    else:
        argv = list(entry) + list(c.get("args", []))
    env = container_env(c)
    argv = [expand(str(a), env) for a in argv]
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


def check_probes_and_grace(where, pod, c, args):
    ports = {p["containerPort"] for p in c.get("ports", [])} | {p["name"] for p in c.get("ports", []) if "name" in p}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind)
        if not probe:
            fail(f"{where}: no {kind}")
            continue
        grpc = probe.get("grpc")
        if not grpc:
            fail(f"{where}: {kind} is not a gRPC probe")
            continue
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
                check_container(tandem, entry, where, pod, c)
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
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
