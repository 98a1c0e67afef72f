#!/usr/bin/env bash
# Set-up for tests/it/record_vllm.rs: a cached virtualenv with the real
# `vllm` 0.33.0 package on CPU. vLLM's own dependency list pulls CUDA
# kernels, FlashInfer, TileLang and a web stack the scheduler never imports,
# so vllm is installed with --no-deps over torch (PyPI has only the CUDA
# build, which imports on CPU) and the pinned modules that importing
# vLLM's Scheduler, KV cache manager and NixlConnector scheduler side
# needs (found by running the driver until no import failed). 6.6 GB
# (torch and its CUDA libraries are 5.4 GB of it); a fresh build took 26 min
# wall under `nice` on the shared 2-core machine at load ~20 (1 min 45 s of
# CPU: most of it is downloading and unpacking); see docs/capture-vllm.md.
#
# Idempotent: the venv lives outside the repository, under
# ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}, and is reused when its marker file
# exists. The test finds it through the same path (or KVTRAIL_VLLM_VENV).
set -euo pipefail

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_VLLM_VENV:-$CACHE/venv-vllm-0.33.0}"
# vllm 0.33.0 is an abi3 wheel; tested with python3.11.
PY="${KVTRAIL_PYTHON:-$(command -v python3.11 || command -v python3)}"

# The marker is versioned: bump it when the package list changes.
MARK="$VENV/.kvtrail-ready-v1"
if [ -f "$MARK" ]; then
  echo "32-vllm: cached venv ready at $VENV"
  exit 0
fi

start=$(date +%s)
mkdir -p "$(dirname "$VENV")"
rm -rf "$VENV"
if ! "$PY" -m venv "$VENV"; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt-get install -y "python$ver-venv" || apt-get install -y python3-venv
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
  else
    echo "32-vllm: '$PY -m venv' failed; install the venv module (python3-venv)" >&2
    exit 1
  fi
fi
PIP=("$VENV/bin/pip" install --quiet --no-cache-dir --disable-pip-version-check)
"${PIP[@]}" torch==2.14.0
"${PIP[@]}" --no-deps vllm==0.33.0 \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
  annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 \
  blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 \
  charset-normalizer==3.5.3 click==8.5.1 cloudpickle==3.1.3 einops==0.8.2 \
  fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 hf-xet==1.8.0 httpcore2==2.16.2 \
  httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 jiter==0.19.0 llguidance==1.9.1 \
  markdown-it-py==4.3.0 mdurl==0.1.2 msgspec==0.23.0 multidict==7.2.1 numpy==2.4.6 \
  openai==3.57.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 packaging==26.4 \
  partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0 \
  propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 \
  pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 pyzmq==27.3.0 \
  regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 \
  shellingham==1.5.4 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 \
  tqdm==4.70.1 transformers==5.24.0 truststore==0.10.5 typer==0.29.2 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 uvloop==0.23.0 \
  xgrammar==0.2.9 yarl==1.25.1
"$VENV/bin/python" -W ignore -c "import vllm.v1.core.sched.scheduler, blake3"
touch "$MARK"
echo "32-vllm: venv built in $(( $(date +%s) - start )) s at $VENV ($(du -sh "$VENV" | cut -f1))"
