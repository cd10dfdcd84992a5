#!/usr/bin/env bash
# Prints the Python interpreter setup.sh builds its virtualenv with: $PYTHON when set,
# else the newest of python3.13, python3.12, python3.11, python3 on PATH that runs and is
# at least MINIMUM (mlx-lm 0.32 needs 3.11). Where there is none, one line says what to
# install, on stderr, and the exit status is 1.
set -uo pipefail

MINIMUM="3.11"
CANDIDATES=(python3.13 python3.12 python3.11 python3)

# A name on PATH may not run (a pyenv shim of a version not selected): ask it.
version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
at_least() { [ "$(printf '%s\n%s\n' "$MINIMUM" "$1" | sort -V | head -n1)" = "$MINIMUM" ]; }

if [ -n "${PYTHON:-}" ]; then
  version="$(version_of "$PYTHON")"
  if [ -z "$version" ]; then
    echo "setup.sh: PYTHON=$PYTHON does not run; set PYTHON to a Python $MINIMUM or newer, or unset it" >&2
    exit 1
  fi
  if ! at_least "$version"; then
    echo "setup.sh: PYTHON=$PYTHON is Python $version; omlx-core needs $MINIMUM or newer (mlx-lm 0.32 requires it): set PYTHON to one, or unset it" >&2
    exit 1
  fi
  command -v "$PYTHON"
  exit 0
fi

for candidate in "${CANDIDATES[@]}"; do
  command -v "$candidate" >/dev/null 2>&1 || continue
  version="$(version_of "$candidate")"
  if [ -n "$version" ] && at_least "$version"; then
    command -v "$candidate"
    exit 0
  fi
done
echo "setup.sh: no Python $MINIMUM or newer found (tried ${CANDIDATES[*]}); install one (Debian/Ubuntu: sudo apt-get install python3.11 python3.11-venv) or set PYTHON=/path/to/python3.11" >&2
exit 1
