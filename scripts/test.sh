#!/usr/bin/env bash
# The whole test suite on a fresh machine (as root): set up .venv, start the local Slurm cluster
# and sshd (scripts/local-cluster/start.sh), build the offline test models, run pytest.
# Extra arguments go to pytest. This is the README's test command; .ci/run calls it.
# The venv is pinned (scripts/setup.sh); to see upstream drift, run the suite on the newest releases too:
#   TGI_HPC_DEPS=newest TGI_HPC_VENV=.venv-newest bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TGI_HPC_VENV:-.venv}
# The cluster starts beside the venv's set-up and the test models' build: on a bare machine it waits mostly on
# apt, then on its daemons and a probe job, and needs neither. A clean cluster every run: jobs left in Slurm's
# saved state by an earlier, killed run would come back as RUNNING and hold the node's CPUs and GPUs.
CLUSTER_OUT=$(mktemp)
TGI_HPC_CLUSTER_FRESH="${TGI_HPC_CLUSTER_FRESH:-1}" bash scripts/local-cluster/start.sh > "$CLUSTER_OUT" &
CLUSTER_PID=$!
bash scripts/setup.sh
"$VENV/bin/python" scripts/make_models.py all >/dev/null
wait "$CLUSTER_PID" || { echo "test.sh: the local cluster did not start (its messages are above)" >&2; exit 1; }
ENV_FILE=$(cat "$CLUSTER_OUT")
rm -f "$CLUSTER_OUT"
# shellcheck disable=SC1090
. "$ENV_FILE"
export TGI_HPC_REQUIRE_CLUSTER=1 PYTHONUNBUFFERED=1
set +e
# Two workers (pytest-xdist; tests/conftest.py sends each file whole to one, and every cluster test to the
# same one), each with one torch thread: one process on the cores leaves them ~40% idle while it waits on
# the engines it starts, and two workers with two threads each would oversubscribe the cores.
# TGI_HPC_TEST_WORKERS=0 runs everything in this process.
WORKERS=${TGI_HPC_TEST_WORKERS:-2}
[ "$WORKERS" = 0 ] || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "$WORKERS" "$@"
status=$?
set -e
# pytest's 5 means "no tests collected": a suite that ran nothing has not passed.
exit "$status"
