#!/usr/bin/env bash
# CI: what a user of the wheel gets. Build the sdist and, from it, the wheel (`python -m build`); install the wheel
# into a new venv outside the checkout; from a directory outside the checkout run `kvserve --version`, `kvserve
# plan` and a short `kvserve generate` against a tiny random model, and check that the installed package, not the
# checkout, is what ran. The venv sees CI's packages (--system-site-packages) and pip installs the wheel alone
# (--no-deps --no-index), so nothing is downloaded. Seconds, not minutes.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH

fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }

# The checkout's files (tracked and new, not ignored), copied: an egg-info or build/ left in the checkout (pip
# install -e writes one) must not leak into the sdist, and the build must not write into the checkout.
mkdir "$WORK/src"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$REPO" ls-files -z --cached --others --exclude-standard \
        | tar -C "$REPO" --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$WORK/src" -xf -
else
    cp -a "$REPO/." "$WORK/src"
fi
# --no-isolation: build with CI's setuptools instead of downloading one.
"$PYTHON" -m build --no-isolation --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log" >&2; fail "python -m build"; }
wheels=("$WORK"/dist/kvserve-*.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || fail "expected one wheel in $WORK/dist, found: $(ls "$WORK/dist")"
ls "$WORK"/dist/kvserve-*.tar.gz >/dev/null || fail "no sdist in $WORK/dist"

"$PYTHON" -m venv --system-site-packages "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --no-deps --no-index "${wheels[0]}" 2>"$WORK/pip.log" \
    || { cat "$WORK/pip.log" >&2; fail "pip install ${wheels[0]}"; }
KVSERVE="$WORK/venv/bin/kvserve"

# A 2-layer random Llama with a one-character-per-token tokenizer, made by the tests' own helpers.
"$PYTHON" -c "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1])
from tests.conftest import make_tiny_model, save_char_tokenizer
save_char_tokenizer(make_tiny_model(Path(sys.argv[2])))" "$REPO" "$WORK/tiny-llama" >"$WORK/tiny.log" 2>&1 \
    || { cat "$WORK/tiny.log" >&2; fail "building the tiny test model"; }

mkdir "$WORK/run"
cd "$WORK/run"
export KVSERVE_CACHE="$WORK/cache"

# The package that imports is the wheel's, in the venv, with the wheel's version in its metadata.
version="$("$WORK/venv/bin/python" -c "import sys, kvserve
from importlib.metadata import version
from pathlib import Path
installed = Path(kvserve.__file__).resolve()
assert installed.is_relative_to(Path(sys.prefix).resolve()), f'kvserve imported from {installed}, not the venv'
assert version('kvserve') == kvserve.__version__, (version('kvserve'), kvserve.__version__)
print(kvserve.__version__)")" || fail "the venv does not import the installed wheel"
case "${wheels[0]}" in *"/kvserve-$version-"*) ;; *) fail "wheel ${wheels[0]} is not version $version" ;; esac

[ "$("$KVSERVE" --version)" = "kvserve $version" ] || fail "kvserve --version printed '$("$KVSERVE" --version)'"
[ "$("$WORK/venv/bin/python" -m kvserve --version)" = "kvserve $version" ] || fail "python -m kvserve --version"

# The planner's presets are package data: without them the preset is unknown. Exit 1: 131,072 tokens do not fit.
status=0
"$KVSERVE" plan llama-3.1-8b --gpu rtx-4090 >"$WORK/plan.out" 2>&1 || status=$?
[ "$status" -eq 1 ] || { cat "$WORK/plan.out" >&2; fail "kvserve plan exited $status, not 1"; }
grep -q "KV cache: 2,632 blocks × 16 tokens = 42,112 tokens" "$WORK/plan.out" \
    || { cat "$WORK/plan.out" >&2; fail "kvserve plan printed no 42,112-token capacity line"; }

"$KVSERVE" generate "The capital of France is" --model "$WORK/tiny-llama" --max-tokens 8 --kv-cache-memory 8MiB \
    >"$WORK/generate.out" 2>"$WORK/generate.err" \
    || { cat "$WORK/generate.out" "$WORK/generate.err" >&2; fail "kvserve generate"; }
grep -q "^KV cache (float32[;)]" "$WORK/generate.err" \
    || { cat "$WORK/generate.err" >&2; fail "kvserve generate logged no start-up capacity line"; }
# compiled decode steps are the default: the fresh install compiles (or says why it runs eagerly)
grep -q "^decode steps: compiled" "$WORK/generate.err" \
    || { cat "$WORK/generate.err" >&2; fail "kvserve generate did not compile its decode steps by default"; }
[ -n "$(tr -d '[:space:]' <"$WORK/generate.out")" ] || fail "kvserve generate printed no text"

echo "check_wheel: $(basename "${wheels[0]}") and its sdist built; installed outside the checkout, kvserve $version" \
     "ran --version, plan and generate"
