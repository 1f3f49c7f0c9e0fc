#!/usr/bin/env bash
# A stand-in for python:3.11-slim-bookworm made from Debian's archive with debootstrap, for hosts
# that reach Debian's mirror but no container registry. Debian bookworm's Python is 3.11, as in
# the official image; `pip` may install into the system as there (no PEP 668 marker).
# The host's own CA certificates (/usr/local/share/ca-certificates, e.g. a TLS-inspecting proxy's)
# are trusted in it too, so that the build reaches PyPI from where the host does; the official
# image trusts only Debian's.
# Usage (root): deploy/docker/base_image.sh TAG   (DEBIAN_MIRROR overrides the mirror)
set -euo pipefail

tag=${1:?usage: base_image.sh TAG}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}

command -v debootstrap >/dev/null || {
    echo "base_image.sh: debootstrap is missing (apt-get install -y debootstrap)" >&2
    exit 1
}
[ "$(id -u)" = 0 ] || {
    echo "base_image.sh: debootstrap must run as root" >&2
    exit 1
}

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
nice -n 19 debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
    bookworm "$root" "$mirror"
ln -sfn python3 "$root/usr/bin/python"
rm -f "$root"/usr/lib/python3.*/EXTERNALLY-MANAGED
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | "$docker" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    - "$tag"
