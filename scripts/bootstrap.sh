#!/usr/bin/env bash
# Installs what fs3 needs on a fresh Debian machine (as root) or a developer box:
# system packages when absent, then a .venv with the project and its test extras.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

need_apt=()
command -v "$PYTHON" >/dev/null 2>&1 || need_apt+=(python3 python3-venv python3-dev)
if command -v "$PYTHON" >/dev/null 2>&1 && ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    need_apt+=(python3-venv)
fi
command -v gcc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# The FUSE mount: libfuse3 to build pyfuse3 against, fusermount3 to unmount; git and sqlite3
# are programs the mount tests run on it.
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
[ -f /usr/include/fuse3/fuse_lowlevel.h ] || need_apt+=(libfuse3-dev)
command -v git >/dev/null 2>&1 || need_apt+=(git)
command -v sqlite3 >/dev/null 2>&1 || need_apt+=(sqlite3)
command -v fio >/dev/null 2>&1 || need_apt+=(fio)         # bench/fuse_bench.py, mount tests
command -v dbench >/dev/null 2>&1 || need_apt+=(dbench)   # mount tests
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)  # chaos suite: packet loss on a link
command -v e2fsck >/dev/null 2>&1 || need_apt+=(e2fsprogs)  # chaos suite: a disk that turns read-only
# The Node.js client of the gRPC API test (tests/grpc_node, tests/test_grpc_node.py).
command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
command -v npm >/dev/null 2>&1 || need_apt+=(npm)

if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing system packages: ${need_apt[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
    else
        echo "bootstrap: missing system packages: ${need_apt[*]} (install them, or run as root on Debian)" >&2
        exit 1
    fi
fi

# The HAI dashboard's browser test (tests/test_hai_dashboard.py) drives Debian's chromium through
# chromium-driver (Selenium); without recommends, it needs no desktop. Offline, the test skips and says why.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing chromium and chromium-driver (the dashboard's browser test)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver \
            || { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
                 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } \
            || echo "bootstrap: could not install chromium: the dashboard's browser test will skip" >&2
    else
        echo "bootstrap: chromium or chromedriver missing (Debian: chromium chromium-driver): the dashboard's browser test will skip" >&2
    fi
fi

# install_without_service PACKAGE SKIPS: install a Debian package whose server must not start (nor
# start at boot) on a developer's machine: service starts are refused while it installs (a
# policy-rc.d of our own, removed afterwards; one already there is left alone), and its unit is
# disabled afterwards. SKIPS names what skips without it, for the messages.
install_without_service() {
    local package=$1 skips=$2
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: $package missing (Debian package $package): $skips" >&2
        return 0
    fi
    echo "bootstrap: installing Debian package $package (its service is not started)"
    local policy=${POLICY_RC_D:-/usr/sbin/policy-rc.d} made_policy=0  # POLICY_RC_D: for its test
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
    fi
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" \
            || { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
                 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package"; }; then
        if command -v systemctl >/dev/null 2>&1; then systemctl disable --quiet "$package.service" 2>/dev/null || true; fi
    else
        echo "bootstrap: could not install $package: $skips" >&2
    fi
    if [ "$made_policy" = 1 ]; then rm -f "$policy"; fi
}

# promtool checks the alert rules in deploy/prometheus (tests/test_metrics.py); it comes with Debian's
# prometheus package, whose server must not run on a developer's machine.
if ! command -v promtool >/dev/null 2>&1; then
    install_without_service prometheus "promtool is missing: the alert-rule tests will skip"
fi

# A private PostgreSQL server for the tests (tests/postgres.py runs initdb and pg_ctl from
# /usr/lib/postgresql/<version>/bin). Debian's postgresql package creates and starts a system
# cluster when it installs: not here, so nothing listens on 5432 afterwards.
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
    install_without_service postgresql "the PostgreSQL halves of the hai tests will skip"
fi

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"fs3 needs Python >= 3.11, found {sys.version.split()[0]}")
PY

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
echo "bootstrap: installing fs3 with the FUSE, training and test extras into $VENV"
# constraints.txt holds torch at the release that installs as a CPU build (any other resolves to a
# multi-GB CUDA build), whichever extra or package asks for torch.
"$VENV/bin/python" -m pip install -q -c constraints.txt -e '.[fuse,train,test]'

# The Node.js test client's packages, at the versions package-lock.json pins (npm ci), when the
# lock file changed since the last install. Offline, the rest of the project still installs: the
# test that needs them says why it skipped.
node_client=tests/grpc_node
if [ "$node_client/package-lock.json" -nt "$node_client/node_modules/.package-lock.json" ]; then
    echo "bootstrap: installing the Node.js gRPC test client's packages (npm ci in $node_client)"
    (cd "$node_client" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) \
        || echo "bootstrap: warning: npm ci in $node_client failed; tests/test_grpc_node.py will skip" >&2
fi
