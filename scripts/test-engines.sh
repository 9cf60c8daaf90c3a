#!/usr/bin/env bash
# The serving-engine integrations, inside the engines: one venv per engine (vLLM and SGLang
# pin different torch versions), each with the engine and a2ad installed, then the tests that
# drive the engine's own code (tests/engines/run_<engine>.py) in 2 and 4 rank processes on a
# real host-backend daemon. Installing an engine takes minutes and gigabytes, once: the venvs
# are kept and reused (A2AD_ENGINE_VENVS, default ${TMPDIR:-/tmp}/a2ad-engine-venvs).
# A2AD_ENGINES picks engines (default "vllm sglang"); extra arguments go to pytest.
# An engine that cannot be installed for want of the package registry is a SKIP (with the
# reason); any other failure, and any failing test, makes the exit status non-zero.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
venvs=${A2AD_ENGINE_VENVS:-${TMPDIR:-/tmp}/a2ad-engine-venvs}
engines=${A2AD_ENGINES:-vllm sglang}
declare -A spec=([vllm]="vllm==0.33.0" [sglang]="sglang==0.5.23")
python=${A2AD_PYTHON:-python3}
mkdir -p "$venvs"
status=0
registry_problem='No matching distribution|Could not find a version|Failed to establish a new connection|Network is unreachable|Temporary failure in name resolution|Name or service not known|ProxyError|Max retries exceeded|ConnectTimeout|ReadTimeout'

for e in $engines; do
    if [ -z "${spec[$e]:-}" ]; then
        echo "FAIL $e: unknown engine (known: ${!spec[*]})"; status=1; continue
    fi
    venv=$venvs/$e
    want=${spec[$e]#*==}
    t0=$(date +%s)
    if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$e') != '$want')" 2>/dev/null; then
        echo "== $e: installing ${spec[$e]} into $venv (once; several minutes, about 10 GB)"
        rm -rf "$venv"
        if ! "$python" -m venv "$venv"; then echo "FAIL $e: could not create $venv"; status=1; continue; fi
        log=$venv.install.log
        if ! "$venv/bin/pip" install -q --disable-pip-version-check "${spec[$e]}" pytest pytest-timeout >"$log" 2>&1; then
            if grep -qE "$registry_problem" "$log"; then
                echo "SKIP $e: cannot install ${spec[$e]} from the package registry: $(grep -E "$registry_problem" "$log" | tail -1)"
                rm -rf "$venv"
                continue
            fi
            echo "FAIL $e: installing ${spec[$e]} failed (last lines of $log):"; tail -20 "$log"; status=1; continue
        fi
    fi
    # a2ad itself, from this checkout, every run (its dependencies are already there or small)
    if ! "$venv/bin/pip" install -q --disable-pip-version-check "$repo" >"$venv.a2ad.log" 2>&1; then
        echo "FAIL $e: installing a2ad into $venv failed:"; tail -20 "$venv.a2ad.log"; status=1; continue
    fi
    t1=$(date +%s)
    echo "== $e $want: venv ready in $((t1 - t0)) s; running tests/engines/run_$e.py"
    # run outside the checkout, so that the installed a2ad (with its entry points) is imported
    if (cd "$venvs" && env -u PYTHONPATH "$venv/bin/pytest" -q -p no:cacheprovider -c "$repo/pyproject.toml" \
            --rootdir "$repo" "$repo/tests/engines/run_$e.py" "$@"); then
        echo "== $e: tests passed in $(( $(date +%s) - t1 )) s"
    else
        echo "FAIL $e: tests failed (after $(( $(date +%s) - t1 )) s)"; status=1
    fi
done
exit $status
